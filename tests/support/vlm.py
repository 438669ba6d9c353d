"""Tiny random vision-language checkpoints of every VLM family the tests cover, and the
plain-transformers reference for them (each prompt alone through the model's own
``forward``, the input of each language-model block caught by a hook).

Each family is ``(model_type, config fields)``, built with ``AutoConfig.for_model`` and
``AutoModelForImageTextToText.from_config`` (2 text layers, hidden 32, vocabulary 320;
a 2-block vision tower), saved with ``save_pretrained``. Image placeholder ids sit at
300 and up, so prompts drawn from ``[3, TEXT_VOCAB)`` are text only, and a tokenizer
trained to :data:`TEXT_VOCAB` entries (``layertap.worker.model.tiny_model.build_tokenizer``) fits.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from tests.support.reference import hooked_block_states
from tests.support.tiny_configs import fill_zero_parameters

TEXT_VOCAB = 300  # prompts draw ids below this: none is an image placeholder
TEXT: dict[str, Any] = dict(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                            tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
GDN = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8)
SIGLIP = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=28,
              patch_size=14)
QWEN_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32, patch_size=14,
                   spatial_merge_size=2, temporal_patch_size=2)
MROPE = {"rope_type": "default", "mrope_section": [1, 1, 2]}
QWEN_MOE = dict(num_experts=4, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                decoder_sparse_step=1)
#: LLaVA-NeXT's and LLaVA-OneVision's anyres grids (multiples of the tower's 28x28 image): 2, 2, 4
#: or 3 tiles plus the whole image.
PINPOINTS = [[28, 56], [56, 28], [56, 56], [28, 84]]
#: GLM-4.1V: half the head rotated (head_dim 16: M-RoPE sections over 4 frequencies), a tower with
#: a position-embedding table (4x4 patches) interpolated to each image's grid.
GLM4V = dict(
    text_config=dict(TEXT, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                     rope_parameters=dict(MROPE, partial_rotary_factor=0.5)),
    vision_config=dict(QWEN_VISION, image_size=56),
    image_token_id=300, image_start_token_id=301, image_end_token_id=302, video_token_id=303,
    video_start_token_id=304, video_end_token_id=305)
#: The Omni thinkers (Qwen2.5-Omni, Qwen3-Omni-MoE): a 1-layer audio tower (never run: no audio jobs) and
#: the ids of image, video, vision begin/end, audio and audio begin/end, 300-306.
OMNI_AUDIO = dict(num_mel_bins=16, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=32, d_model=16,
                  output_dim=32, max_source_positions=32, n_window=4)
OMNI_IDS = dict(image_token_id=300, video_token_id=301, vision_start_token_id=302, vision_end_token_id=303,
                audio_token_id=304, audio_start_token_id=305, audio_end_token_id=306)

VLM_FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2-vl": ("qwen2_vl", dict(
        text_config=dict(TEXT, rope_scaling=dict(MROPE, type="mrope")),
        vision_config=dict(depth=2, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2),
        image_token_id=300, video_token_id=301, vision_start_token_id=302)),
    "qwen2.5-vl": ("qwen2_5_vl", dict(
        text_config=dict(TEXT, rope_scaling=dict(MROPE, type="mrope")),
        vision_config=dict(QWEN_VISION, fullatt_block_indexes=[1], window_size=56),
        image_token_id=300, video_token_id=301, vision_start_token_id=302)),
    "qwen3-vl": ("qwen3_vl", dict(
        text_config=dict(TEXT, rope_scaling=dict(MROPE, mrope_interleaved=True)),
        vision_config=dict(QWEN_VISION, deepstack_visual_indexes=[0, 1], num_position_embeddings=16),
        image_token_id=300, video_token_id=301, vision_start_token_id=302)),
    "qwen3.5": ("qwen3_5", dict(
        text_config=dict(TEXT, **GDN), vision_config=dict(QWEN_VISION, num_position_embeddings=16),
        image_token_id=300, video_token_id=301, vision_start_token_id=302)),
    "qwen3-vl-moe": ("qwen3_vl_moe", dict(  # Qwen3-VL-30B-A3B / 235B-A22B: the same tower, experts
        text_config=dict(TEXT, rope_scaling=dict(MROPE, mrope_interleaved=True), **QWEN_MOE),
        vision_config=dict(QWEN_VISION, deepstack_visual_indexes=[0, 1], num_position_embeddings=16),
        image_token_id=300, video_token_id=301, vision_start_token_id=302)),
    "qwen3.5-moe": ("qwen3_5_moe", dict(  # the larger Qwen3.5 (397B-A17B): gated delta nets and experts
        text_config=dict(TEXT, **GDN, **QWEN_MOE, shared_expert_intermediate_size=16,
                         layer_types=["linear_attention", "full_attention"]),
        vision_config=dict(QWEN_VISION, num_position_embeddings=16),
        image_token_id=300, video_token_id=301, vision_start_token_id=302)),
    "gemma3": ("gemma3", dict(text_config=dict(TEXT), vision_config=SIGLIP, mm_tokens_per_image=4,
                              image_token_index=300, boi_token_index=301, eoi_token_index=302)),
    "llava": ("llava", dict(text_config=dict(TEXT, model_type="llama"),
                            vision_config=dict(SIGLIP, model_type="clip_vision_model"), image_token_index=300)),
    "llama4": ("llama4", dict(
        text_config=dict(TEXT, num_local_experts=2, intermediate_size_mlp=64, attention_chunk_size=8),
        vision_config=dict(SIGLIP, intermediate_size=128, vision_output_dim=32, projector_input_dim=32,
                           projector_output_dim=32),
        image_token_index=300)),
    "llava-next": ("llava_next", dict(text_config=dict(TEXT, model_type="llama"),
                                      vision_config=dict(SIGLIP, model_type="clip_vision_model"),
                                      image_grid_pinpoints=PINPOINTS, image_token_index=300)),
    "llava-onevision": ("llava_onevision", dict(text_config=dict(TEXT), vision_config=SIGLIP,
                                                image_grid_pinpoints=PINPOINTS, image_token_index=300,
                                                video_token_index=301)),
    "idefics3": ("idefics3", dict(text_config=dict(TEXT, model_type="llama"),
                                  vision_config=SIGLIP, scale_factor=2, image_token_id=300)),
    "internvl": ("internvl", dict(text_config=dict(TEXT, model_type="qwen2"), vision_config=SIGLIP,
                                  downsample_ratio=0.5, image_seq_length=1, image_token_id=300)),
    "mistral3": ("mistral3", dict(  # Pixtral tower: images of any size (a token per 28x28 after the 2x2 merge)
        text_config=dict(TEXT, model_type="mistral"),
        vision_config=dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, head_dim=16, image_size=56, patch_size=14),
        image_token_index=300, spatial_merge_size=2)),
    "glm4v": ("glm4v", GLM4V),
    "glm4.6v": ("glm46v", GLM4V),  # GLM-4.1V's modeling, its towers built from the sub-configs
    "gemma4": ("gemma4", dict(  # per-layer inputs, a sliding and a full layer (its own head size, K as V),
        # bidirectional image attention; the vision tower pools 3x3 patches of 4 pixels into a token
        text_config=dict(TEXT, layer_types=["sliding_attention", "full_attention"], sliding_window=16,
                         use_bidirectional_attention="vision", hidden_size_per_layer_input=8,
                         vocab_size_per_layer_input=320, global_head_dim=16, num_global_key_value_heads=1,
                         attention_k_eq_v=True),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           num_key_value_heads=2, head_dim=16, patch_size=4, pooling_kernel_size=3,
                           position_embedding_size=256),
        audio_config=None, image_token_id=300, boi_token_id=301, eoi_token_id=302, audio_token_id=303,
        boa_token_id=304, eoa_token_index=305, video_token_id=306)),
    "deepseek-vl": ("deepseek_vl", dict(text_config=dict(TEXT, model_type="llama"), vision_config=SIGLIP,
                                        image_token_id=300)),
    "deepseek-vl-hybrid": ("deepseek_vl_hybrid", dict(  # SigLIP at 28x28 beside a SAM tower at 64x64 (8x8
        # patches, windows of 3 padded per image, the second block global), its features brought to SigLIP's 2x2
        text_config=dict(TEXT, model_type="llama"), vision_config=SIGLIP, image_token_id=300,
        high_res_vision_config=dict(hidden_size=32, output_channels=8, num_hidden_layers=2, num_attention_heads=2,
                                    image_size=64, patch_size=8, window_size=3, global_attn_indexes=[1],
                                    num_pos_feats=16, mlp_dim=64, initializer_range=0.02))),  # SAM's 1e-10: ~0
    "janus": ("janus", dict(  # DeepSeek-VL's understanding path (a SigLIP-like tower) plus a VQ model for
        # image generation, unused by a forward on text and images (GroupNorm's 32 groups: 32 channels)
        text_config=dict(TEXT, model_type="llama"), image_token_id=300,
        vision_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=28, patch_size=14,
                           projection_dim=32, num_image_tokens=4),
        vq_config=dict(embed_dim=8, num_embeddings=32, latent_channels=32, base_channels=32, channel_multiplier=[1, 1],
                       num_res_blocks=1, projection_dim=32, image_token_embed_dim=32))),
    "kimi-k2.5": ("kimi_k25", dict(  # DeepSeek-V3's decoder (MLA, a dense then an expert layer: 4 experts in 2
        # groups); a tower of 14-pixel patches, 2x2 merged, its 4x4 position table interpolated to each grid
        text_config=dict(TEXT, model_type="deepseek_v3", num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16,
                         qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_routed_experts=4,
                         num_experts_per_tok=2, n_group=2, topk_group=1, moe_intermediate_size=16,
                         first_k_dense_replace=1),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           patch_size=14, pos_emb_height=4, pos_emb_width=4),
        projection_hidden_size=32, image_token_id=300, video_token_id=301, vision_start_token_id=302,
        vision_end_token_id=303)),
    "smolvlm": ("smolvlm", dict(text_config=dict(TEXT, model_type="llama"), vision_config=SIGLIP, scale_factor=2,
                                image_token_id=300)),  # Idefics3's modeling: a token per 28x28 tile
    "idefics2": ("idefics2", dict(  # a perceiver resampler: 4 latents (tokens) per tile, whatever its size
        text_config=dict(TEXT, model_type="mistral"), vision_config=SIGLIP, image_token_id=300,
        perceiver_config=dict(hidden_size=32, resampler_n_latents=4, resampler_depth=2, resampler_n_heads=2,
                              resampler_head_dim=16, num_key_value_heads=1))),
    "paligemma": ("paligemma", dict(  # PaliGemma 2: a Gemma 2 decoder (a sliding and a full layer), a prefix-LM
        # (token_type_ids 0 attend both ways, 1 causally); a 28x28 image is 4 tokens
        text_config=dict(TEXT, model_type="gemma2", sliding_window=8), vision_config=SIGLIP, projection_dim=32,
        image_token_index=300)),
    "aya-vision": ("aya_vision", dict(  # a Cohere 2 decoder (a sliding and a full layer); each 28x28 tile's 2x2
        # patches pixel-shuffled into one token
        text_config=dict(TEXT, model_type="cohere2", layer_types=["sliding_attention", "full_attention"],
                         sliding_window=8), vision_config=SIGLIP, downsample_factor=2, image_token_index=300)),
    "qwen2.5-omni": ("qwen2_5_omni_thinker", dict(  # Qwen2.5-VL's tower and M-RoPE numbered by the Omni rules
        text_config=dict(TEXT, rope_scaling=dict(MROPE, type="mrope")),
        vision_config=dict(QWEN_VISION, fullatt_block_indexes=[1], window_size=56), audio_config=OMNI_AUDIO,
        **OMNI_IDS)),
    "qwen3-omni-moe": ("qwen3_omni_moe_thinker", dict(  # Qwen3-VL's tower (deepstack), experts
        text_config=dict(TEXT, rope_scaling=dict(MROPE, mrope_interleaved=True), **QWEN_MOE),
        vision_config=dict(QWEN_VISION, deepstack_visual_indexes=[0, 1], num_position_embeddings=16),
        audio_config=dict(OMNI_AUDIO, downsample_hidden_size=8), **OMNI_IDS)),
    "lfm2-vl": ("lfm2_vl", dict(  # LFM2's short convolutions and attention; a SigLIP2 (NaFlex) tower: patches of 4
        # pixels, each tile's own grid, 2x2 merged into a token
        text_config=dict(TEXT, model_type="lfm2", layer_types=["conv", "full_attention"]),
        vision_config=dict(model_type="siglip2_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, num_patches=16, patch_size=4),
        image_token_id=300, projector_hidden_size=32, downsample_factor=2)),
}


def build_tiny_vlm(family: str, out: Path, seed: int = 0) -> Path:
    """Build the family's tiny VLM with random (seeded) float32 weights and save it to ``out``."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    model_type, fields = VLM_FAMILIES[family]
    config = AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    fill_zero_parameters(model, seed)  # DeepSeek-VL hybrid's alpha, InternVL's position embeddings...
    model.save_pretrained(out)
    return out


@lru_cache(maxsize=4)
def load_reference(model_dir: str):
    from transformers import AutoModelForImageTextToText

    try:
        return AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32, use_kernels=False).eval()
    except ValueError as exc:  # a part with no SDPA: transformers' eager attention, as the worker loads it
        if "does not support an attention implementation" not in str(exc):
            raise
        return AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32, use_kernels=False,
                                                           attn_implementation="eager").eval()


def language_layers(model) -> torch.nn.ModuleList:
    """The language model's blocks, by the attribute paths transformers' VLM classes use."""
    inner = getattr(model, "model", model)
    for name in ("language_model", "text_model"):  # Idefics3 names it text_model
        if hasattr(inner, name):
            language_model = getattr(inner, name)
            break
    if hasattr(language_model, "model"):  # a causal LM wrapping its decoder (Llama 4)
        language_model = language_model.model
    return language_model.layers


def is_llama4(model) -> bool:
    return type(model).__name__ == "Llama4ForConditionalGeneration"


def vlm_block_states(model_dir: str, layer_ids: list[int], **inputs: Any) -> torch.Tensor:
    """``[T, len(layer_ids), H]``: the input of each language block ``i < L`` and the output of
    the last (id ``L``), from the plain model's own ``forward`` on one prompt (``inputs``:
    ``input_ids`` ``[1, T]`` and whatever else that forward takes, such as ``pixel_values``)."""
    model = load_reference(model_dir)
    layers = language_layers(model)
    # transformers 5.24's Llama4ForConditionalGeneration.forward fails without pixel_values
    # (it reads ``image_outputs`` off its language model's output); without images it is
    # its language model's forward, so that runs.
    forward = model.language_model if "pixel_values" not in inputs and is_llama4(model) else model

    def run() -> None:
        try:
            forward(**inputs, use_cache=False)
        except AttributeError as exc:  # 5.24's Llama 4 fails after its layers ran, building its output
            if not (is_llama4(model) and "image_outputs" in str(exc)):
                raise

    return hooked_block_states(layers, layer_ids, inputs["input_ids"].shape[-1], run)


#: A ChatML template that takes content parts (an image part renders as the processor's placeholder).
def parts_template(image_placeholder: str) -> str:
    return ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
            "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}" + image_placeholder +
            "{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


QWEN_FAMILIES = ("qwen2-vl", "qwen2.5-vl", "qwen3-vl", "qwen3.5")
#: The mixture-of-experts Qwen VLMs: Qwen's tower and processor, checked with image chats batched.
QWEN_MOE_FAMILIES = ("qwen3-vl-moe", "qwen3.5-moe")
QWEN_TOKENS = {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>", "vision_bos_token": "<|vision_start|>",
               "vision_eos_token": "<|vision_end|>"}
QWEN_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
GLM_FAMILIES = ("glm4v", "glm4.6v")
GLM_TOKENS = {"image_token": "<|image|>", "boi_token": "<|begin_of_image|>", "eoi_token": "<|end_of_image|>",
              "video_token": "<|video|>", "bov_token": "<|begin_of_video|>", "eov_token": "<|end_of_video|>"}
GLM_PLACEHOLDER = "<|begin_of_image|><|image|><|end_of_image|>"
#: Families whose processor class needs torchvision (its video processor), and the image token
#: their processor repeats once per merged 2x2 patch group: their folders hold the tokenizer
#: and the image processor's files as a checkpoint does.
IMAGE_ONLY = {**dict.fromkeys(QWEN_FAMILIES + QWEN_MOE_FAMILIES, "<|image_pad|>"),
              **dict.fromkeys(GLM_FAMILIES, "<|image|>")}
#: Gemma 4's tokens (image, begin/end of image, audio, begin/end of audio: 300-305; its processor adds
#: ``<|video|>``, 306); a template writes the image token, which its processor expands.
GEMMA4_TOKENS = {"image_token": "<|image|>", "boi_token": "<|image>", "eoi_token": "<image|>",
                 "audio_token": "<|audio|>", "boa_token": "<|audio>", "eoa_token": "<audio|>"}
#: Kimi K2.5's tokens (image, video, begin/end of media: 300-303), its template's image placeholder.
KIMI_TOKENS = {"image_token": "<|media_pad|>", "video_token": "<|kimi_k25_video_placeholder|>",
               "media_begin_token": "<|media_begin|>", "media_end_token": "<|media_end|>"}
KIMI_PLACEHOLDER = "<|media_begin|><|media_pad|><|media_end|>"
#: Aya Vision's tokens: the patch token (the config's image token, 300), the template's ``<image>``, which its
#: processor expands, begin/end of image, line break and the tile markers (301-306).
AYA_TOKENS = {"img_patch_token": "<|IMG_PATCH|>", "image_token": "<image>", "start_of_img_token": "<|START_OF_IMG|>",
              "end_of_img_token": "<|END_OF_IMG|>", "img_line_break_token": "<|IMG_LINE_BREAK|>",
              "tile_token": "TILE", "tile_global_token": "TILE_GLOBAL"}
OMNI_FAMILIES = ("qwen2.5-omni", "qwen3-omni-moe")
#: The Omni processors' tokens (Qwen2.5-Omni's names), at the ids of :data:`OMNI_IDS`.
OMNI_TOKENS = {"image_token": "<|IMAGE|>", "video_token": "<|VIDEO|>", "vision_bos_token": "<|vision_bos|>",
               "vision_eos_token": "<|vision_eos|>", "audio_token": "<|AUDIO|>", "audio_bos_token": "<|audio_bos|>",
               "audio_eos_token": "<|audio_eos|>"}
OMNI_PLACEHOLDER = "<|vision_bos|><|IMAGE|><|vision_eos|>"
OMNI_PROCESSORS = {"qwen2.5-omni": "Qwen2_5OmniProcessor", "qwen3-omni-moe": "Qwen3OmniMoeProcessor"}


def qwen_image_processor():
    """Qwen's image processor (transformers' PIL one: no torchvision here) at the tiny sizes:
    images resized to 28x28 .. 112x112 pixels, patches of 14, 2x2 merged into a token."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=28 * 28 * 16, patch_size=14, merge_size=2,
                                    temporal_patch_size=2)


INTERNVL_TOKENS = {"context_image_token": "<IMG_CONTEXT>", "start_image_token": "<img>",
                   "end_image_token": "</img>", "video_token": "<video>"}
INTERNVL_PLACEHOLDER = "<IMG_CONTEXT>"


def internvl_image_processor():
    """InternVL's image processor (GOT-OCR2's, PIL: no torchvision here) at the tiny size: an
    image cut into 28x28 tiles on the grid of 1 to 4 closest to its aspect, plus a 28x28
    thumbnail where there are several."""
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    return GotOcr2ImageProcessorPil(size={"height": 28, "width": 28}, crop_to_patches=True, max_patches=4)


def glm_image_processor(family: str):
    """GLM-4.1V's (or GLM-4.6V's) PIL image processor at Qwen's tiny sizes (its pixel bounds
    count the 2 temporal frames)."""
    from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil
    from transformers.models.glm46v.image_processing_pil_glm46v import Glm46VImageProcessorPil

    kind = Glm4vImageProcessorPil if family == "glm4v" else Glm46VImageProcessorPil
    return kind(size={"shortest_edge": 2 * 28 * 28, "longest_edge": 2 * 28 * 28 * 16}, patch_size=14, merge_size=2,
                temporal_patch_size=2)


def gemma4_image_processor():
    """Gemma 4's image processor (transformers' PIL one) at the tiny sizes: an image resized, its
    aspect kept, to at most 70 tokens of 3x3 patches of 4 pixels (630 patches, the rows past
    the image's padded with position -1); 28x28 gives 64 tokens, 90x20 gives 51."""
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    return Gemma4ImageProcessorPil(patch_size=4, pooling_kernel_size=3, max_soft_tokens=70)


#: DeepSeek-VL's families (the hybrid's image processor also makes the SAM tower's high-resolution pixels).
DEEPSEEK_FAMILIES = ("deepseek-vl", "deepseek-vl-hybrid", "janus")
#: Janus's tokens: its processor puts ``num_image_tokens`` image tokens between begin/end of image (300-302).
JANUS_TOKENS = {"image_token": "<image_placeholder>", "boi_token": "<begin_of_image>", "eoi_token": "<end_of_image>"}


def deepseek_processor(family: str, tokenizer: Any, template: str) -> Any:
    """DeepSeek-VL's (or the hybrid's, or Janus's) processor with its PIL image processor: an image
    resized to a longest edge of 28 and padded to a square (the hybrid's also to 64 for SAM), 4
    image tokens each whatever its size, as the towers give (Janus's between begin/end of image)."""
    from transformers import DeepseekVLHybridProcessor, DeepseekVLProcessor, JanusProcessor
    from transformers.models.deepseek_vl.image_processing_pil_deepseek_vl import DeepseekVLImageProcessorPil
    from transformers.models.deepseek_vl_hybrid.image_processing_pil_deepseek_vl_hybrid import (
        DeepseekVLHybridImageProcessorPil,
    )
    from transformers.models.janus.image_processing_pil_janus import JanusImageProcessorPil

    size = {"height": 28, "width": 28}
    if family == "deepseek-vl-hybrid":
        kind, images = DeepseekVLHybridProcessor, DeepseekVLHybridImageProcessorPil(
            size=size, high_res_size={"height": 64, "width": 64})
    else:
        kind, images = {"deepseek-vl": (DeepseekVLProcessor, DeepseekVLImageProcessorPil),
                        "janus": (JanusProcessor, JanusImageProcessorPil)}[family]
        images = images(size=size)
    return kind(image_processor=images, tokenizer=tokenizer, chat_template=template, num_image_tokens=4)


#: SmolVLM's image, tile-boundary and global-image tokens (300-302), as its processor reads them off the tokenizer.
SMOLVLM_TOKENS = {"image_token": "<image>", "fake_image_token": "<fake_token_around_image>",
                  "global_image_token": "<global-img>"}


def smolvlm_image_processor():
    """SmolVLM's PIL image processor at the tiny sizes: an image resized to a longest edge of 56,
    then to multiples of 28, cut into 28x28 tiles (up to 2x2) plus a 28x28 global image, or
    one 28x28 image where it fits in one tile (a token each)."""
    from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil

    return SmolVLMImageProcessorPil(size={"longest_edge": 56}, max_image_size={"longest_edge": 28})


def add_processor(family: str, model_dir: Path) -> Path:
    """Save a processor beside a tiny VLM: a trained tokenizer of :data:`TEXT_VOCAB` entries
    plus the family's image tokens at the ids its config names (300 the image token; Gemma
    3's begin/end of image 301/302; Qwen's video and vision start/end 301-303; GLM's
    begin/end of image 301/302, video and its begin/end 303-305; Gemma 4's
    :data:`GEMMA4_TOKENS`), an image
    processor that makes 28x28 images (4 patches of 14: 4 image tokens; Idefics3 resizes to
    a longest edge of 56 and splits into 28x28 tiles plus a global one, a token each;
    LLaVA-NeXT's and LLaVA-OneVision's tile an image on the :data:`PINPOINTS` grid that fits
    it best, plus the whole image, its tokens the unpadded grid with a newline a row; Qwen's
    keeps the size within 28..112 pixels a side, a token per 28x28, GLM's the same;
    Gemma 4's keeps the aspect, up to 70 tokens, :func:`gemma4_image_processor`), and a template that puts
    the processor's placeholder where a chat's image part is. A Qwen folder holds the
    tokenizer and the image processor's files as a checkpoint does (its video processor
    needs torchvision, which this environment lacks), as does a GLM one (both
    :data:`IMAGE_ONLY`). So does an InternVL one (its tokenizer
    names its image context and begin/end tokens 300-302, video 303; its image processor cuts
    28x28 tiles, up to 4 plus a thumbnail, a token each; ``processor_config.json`` holds
    ``image_seq_length``, as a checkpoint's does: its processor class cannot be built here). A Mistral 3
    folder holds a checkpoint's files too: ``[IMG]``, ``[IMG_BREAK]``, ``[IMG_END]`` at 300-302, Pixtral's PIL image
    processor (a longest edge of 56) and a ``processor_config.json`` naming
    ``PixtralProcessor``, written here: that class's module imports torchvision, so it
    cannot be built (nor loaded) here. So does a LLaVA-OneVision
    folder (its processor class, which holds a video processor too, cannot be built here), with the
    class's settings in its ``processor_config.json``; a Gemma 4 folder the tokenizer and a
    ``processor_config.json`` naming its image processor and audio feature extractor (its
    processor class takes a video processor too, so it cannot be built here to save). DeepSeek-VL's,
    its hybrid's and Janus's are their processor classes (:func:`deepseek_processor`). A SmolVLM
    folder holds the tokenizer (:data:`SMOLVLM_TOKENS`), :func:`smolvlm_image_processor` and a
    ``processor_config.json`` (``image_seq_len`` 1): its processor class needs num2words, not
    installed here, besides its video processor. Idefics2's is built (``<image>`` and
    ``<fake_token_around_image>`` at 300-301; its image processor splits an image into 4 crops
    plus itself, each resized to edges of 28..56, aspect kept; 4 perceiver latents a tile). PaliGemma's
        processor (SigLIP's PIL image processor: 28x28, 4 tokens an image, whatever its size) puts the
    tokenizer's BOS (``<bos>``, 301, added for it) after a prompt's last image and a newline after
    its text; Aya Vision's (GOT-OCR2's PIL image processor as InternVL's: 28x28 tiles, a token each
    after the pixel shuffle, plus a global tile) expands ``<image>`` into :data:`AYA_TOKENS`' markers
    and patch tokens. An Omni folder (:data:`OMNI_FAMILIES`) holds the tokenizer
    (:data:`OMNI_TOKENS`) and one ``preprocessor_config.json`` holding Qwen's image processor, a
    Whisper feature extractor and the processor class's name, as the Omni checkpoints have it (the
    class takes a video processor too)."""
    from transformers import (
        AutoTokenizer,
        AyaVisionProcessor,
        CLIPImageProcessor,
        Gemma3ImageProcessor,
        Gemma3Processor,
        Idefics3ImageProcessor,
        Idefics3Processor,
        LlavaNextProcessor,
        LlavaProcessor,
        PaliGemmaProcessor,
    )
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil,
    )
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    from layertap.worker.model.tiny_model import build_tokenizer

    tokens = {"llava": {"image_token": "<image>"}, "idefics3": {"image_token": "<image>"},
              "gemma3": {"image_token": "<image_soft_token>", "boi_token": "<start_of_image>",
                         "eoi_token": "<end_of_image>"}, "internvl": INTERNVL_TOKENS,
              "llava-onevision": {"image_token": "<image>", "video_token": "<video>"},
              "mistral3": {"image_token": "[IMG]", "image_break_token": "[IMG_BREAK]",
                           "image_end_token": "[IMG_END]"}, "gemma4": GEMMA4_TOKENS, "kimi-k2.5": KIMI_TOKENS,
              "aya-vision": AYA_TOKENS,
              **dict.fromkeys(GLM_FAMILIES, GLM_TOKENS), "janus": JANUS_TOKENS, "smolvlm": SMOLVLM_TOKENS,
              "idefics2": {"image_token": "<image>", "image_boundary_token": "<fake_token_around_image>"},
              **dict.fromkeys(OMNI_FAMILIES, OMNI_TOKENS)}.get(
        family, QWEN_TOKENS if family in QWEN_FAMILIES + QWEN_MOE_FAMILIES else {"image_token": "<image>"})
    build_tokenizer("qwen3", vocab_size=TEXT_VOCAB).save_pretrained(model_dir / "tokenizer-base")
    tokenizer = AutoTokenizer.from_pretrained(model_dir / "tokenizer-base", extra_special_tokens=tokens)
    assert tokenizer.convert_tokens_to_ids(list(tokens.values())) == list(range(300, 300 + len(tokens)))
    placeholders = {**dict.fromkeys(QWEN_FAMILIES + QWEN_MOE_FAMILIES, QWEN_PLACEHOLDER),
                    **dict.fromkeys(GLM_FAMILIES, GLM_PLACEHOLDER),
                    "gemma4": GEMMA4_TOKENS["image_token"], "janus": JANUS_TOKENS["image_token"],
                    "kimi-k2.5": KIMI_PLACEHOLDER, **dict.fromkeys(OMNI_FAMILIES, OMNI_PLACEHOLDER)}
    template = parts_template(placeholders.get(family, tokens.get("boi_token", tokens.get("image_token",
                                                                                          INTERNVL_PLACEHOLDER))))
    tokenizer.chat_template = template
    if family in IMAGE_ONLY:
        tokenizer.save_pretrained(model_dir)
        (glm_image_processor(family) if family in GLM_FAMILIES else qwen_image_processor()).save_pretrained(model_dir)
        return model_dir
    if family == "internvl":
        tokenizer.save_pretrained(model_dir)
        internvl_image_processor().save_pretrained(model_dir)
        (model_dir / "processor_config.json").write_text(json.dumps(
            {"processor_class": "InternVLProcessor", "image_seq_length": VLM_FAMILIES[family][1]["image_seq_length"]}))
        return model_dir
    if family == "mistral3":
        from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

        tokenizer.save_pretrained(model_dir)
        PixtralImageProcessorPil(size={"longest_edge": 56}, patch_size=14).save_pretrained(model_dir)
        (model_dir / "processor_config.json").write_text(json.dumps(
            {"processor_class": "PixtralProcessor", "patch_size": 14, "spatial_merge_size": 2, **tokens}))
        return model_dir
    if family == "llava-onevision":  # 4 tokens a 28x28 tile (SigLIP: no CLS token)
        tokenizer.save_pretrained(model_dir)
        LlavaOnevisionImageProcessorPil(size={"height": 28, "width": 28},
                                        image_grid_pinpoints=PINPOINTS).save_pretrained(model_dir)
        (model_dir / "processor_config.json").write_text(json.dumps({
            "processor_class": "LlavaOnevisionProcessor", "num_image_tokens": 4,
            "vision_feature_select_strategy": "full", "vision_aspect_ratio": "anyres_max_9"}))
        return model_dir
    if family == "gemma4":
        tokenizer.save_pretrained(model_dir)
        parts = {"image_processor": gemma4_image_processor(), "feature_extractor": Gemma4AudioFeatureExtractor()}
        config = {"processor_class": "Gemma4Processor", "image_seq_length": 70,
                  **{name: json.loads(part.to_json_string()) for name, part in parts.items()}}
        (model_dir / "processor_config.json").write_text(json.dumps(config, indent=2))
        return model_dir
    if family in DEEPSEEK_FAMILIES:
        deepseek_processor(family, tokenizer, template).save_pretrained(model_dir)
        return model_dir
    if family == "kimi-k2.5":  # its image processor is torchvision's only: the files a checkpoint holds
        tokenizer.save_pretrained(model_dir)
        (model_dir / "preprocessor_config.json").write_text(json.dumps({
            "image_processor_type": "Kimi_K25ImageProcessor", "patch_size": 14, "merge_size": 2,
            "max_patches": 16384, "size": {"max_height": 512, "max_width": 512}}))
        (model_dir / "processor_config.json").write_text(json.dumps({"processor_class": "Kimi_K25Processor"}))
        return model_dir
    if family == "smolvlm":
        tokenizer.save_pretrained(model_dir)
        smolvlm_image_processor().save_pretrained(model_dir)
        (model_dir / "processor_config.json").write_text(json.dumps(
            {"processor_class": "SmolVLMProcessor", "image_seq_len": 1}))
        return model_dir
    if family in OMNI_FAMILIES:  # one preprocessor_config.json for both parts, as the Omni checkpoints have
        from transformers import WhisperFeatureExtractor

        tokenizer.save_pretrained(model_dir)
        parts = [qwen_image_processor(), WhisperFeatureExtractor(feature_size=16)]
        config = {key: value for part in parts for key, value in json.loads(part.to_json_string()).items()}
        (model_dir / "preprocessor_config.json").write_text(json.dumps(
            dict(config, processor_class=OMNI_PROCESSORS[family]), indent=2))
        return model_dir
    if family == "llava":
        processor = LlavaProcessor(
            image_processor=CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}),
            tokenizer=tokenizer, chat_template=template, patch_size=14, vision_feature_select_strategy="default",
            num_additional_image_tokens=1)
    elif family == "llava-next":
        image_processor = LlavaNextImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28},
                                                     image_grid_pinpoints=PINPOINTS)
        processor = LlavaNextProcessor(image_processor=image_processor, tokenizer=tokenizer, chat_template=template,
                                       patch_size=14, vision_feature_select_strategy="default",
                                       num_additional_image_tokens=1)
    elif family == "idefics3":
        image_processor = Idefics3ImageProcessor(size={"longest_edge": 56}, max_image_size={"longest_edge": 28},
                                                 do_image_splitting=True)
        processor = Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer, chat_template=template,
                                      image_seq_len=1)
    elif family == "idefics2":
        from transformers import Idefics2Processor
        from transformers.models.idefics2.image_processing_pil_idefics2 import Idefics2ImageProcessorPil

        image_processor = Idefics2ImageProcessorPil(size={"shortest_edge": 28, "longest_edge": 56},
                                                    do_image_splitting=True)
        processor = Idefics2Processor(image_processor=image_processor, tokenizer=tokenizer, chat_template=template,
                                      image_seq_len=VLM_FAMILIES[family][1]["perceiver_config"]["resampler_n_latents"])
    elif family == "paligemma":  # its processor puts the tokenizer's BOS after the last image (<bos>, 301)
        tokenizer.add_special_tokens({"bos_token": "<bos>"})
        image_processor = SiglipImageProcessorPil(size={"height": 28, "width": 28}, image_seq_length=4)
        processor = PaliGemmaProcessor(image_processor=image_processor, tokenizer=tokenizer, chat_template=template)
    elif family == "aya-vision":
        processor = AyaVisionProcessor(image_processor=internvl_image_processor(), tokenizer=tokenizer,
                                       chat_template=template, patch_size=14, img_size=28, downsample_factor=2)
    else:
        processor = Gemma3Processor(image_processor=Gemma3ImageProcessor(size={"height": 28, "width": 28}),
                                    tokenizer=tokenizer, chat_template=template, image_seq_length=4)
    processor.save_pretrained(model_dir)
    return model_dir


def special_token_ids(config: Any) -> set[int]:
    """Every id a vision-language config names for a token of its own (``*_token_id``,
    ``*_token_index``, at any depth): ids a text-only prompt must avoid."""
    found: set[int] = set()
    for key, value in config.to_dict().items():
        if isinstance(value, dict):
            found |= {v for k, v in value.items()
                      if isinstance(k, str) and k.endswith(("token_id", "token_index")) and isinstance(v, int)}
        elif key.endswith(("token_id", "token_index")) and isinstance(value, int):
            found.add(value)
    return found - {0, 1, 2}  # pad, bos, eos of the tiny vocabulary: ordinary text ids here


def text_reference_states(model_dir: str, token_ids: list[int], layer_ids: list[int],
                          through_decoder: bool = False) -> torch.Tensor:
    """``[T, len(layer_ids), ...]`` of a text-only prompt through the plain vision-language model's
    own ``forward`` (``through_decoder``: its ``get_decoder()``, for a model whose forward
    takes no text without images): each block's input (id ``i < L``) and the last block's
    output (id ``L``), hooked on the blocks whose inputs transformers records as its
    ``hidden_states`` (checked: the first block's input is ``hidden_states[0]``, and there are
    as many blocks as it records)."""
    model = load_reference(model_dir)
    forward = model.get_decoder() if through_decoder else model
    ids = torch.tensor([token_ids])
    with torch.no_grad():
        recorded = forward(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
    blocks = min((module for name, module in model.get_decoder().named_modules(prefix="decoder")
                  if isinstance(module, torch.nn.ModuleList) and len(module) == len(recorded) - 1),
                 key=lambda module: next(n for n, m in model.named_modules() if m is module).count("."))
    states = hooked_block_states(blocks, layer_ids, len(token_ids),
                                 lambda: forward(input_ids=ids, use_cache=False))
    assert torch.equal(states[:, 0], recorded[0][0]), "the hooked blocks are not those transformers records"
    for position, layer in enumerate(layer_ids):
        if layer < len(recorded) - 1:
            assert torch.equal(states[:, position], recorded[layer][0]), f"block {layer}'s input is not recorded"
    return states
