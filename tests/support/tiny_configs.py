"""Tiny random configs of every decoder-only causal-LM type the installed transformers has,
listed by code (:func:`decoder_only_types`), not by hand.

:func:`tiny_config` starts from the type's default config and shrinks every size field it
has (hidden 32, 2 layers, vocabulary 128, 4 experts...), recursively through its sub-configs,
so the type's distinctive parts stay present but small, and every selective path (window,
chunk, compression block, indexer top-k) is shorter than the sweep's prompts, so it selects.
:data:`OVERRIDES` holds the few fields a type needs beyond that (a layer pattern that must keep
both mixers, a window under a generic name).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

#: Size fields and their tiny values, applied wherever a (sub-)config has the field.
SMALL: dict[str, Any] = {
    "vocab_size": 128, "hidden_size": 32, "d_model": 32, "n_embd": 32, "embed_dim": 32, "dim": 32,
    "intermediate_size": 64, "ffn_hidden_size": 64, "ffn_dim": 64, "n_inner": 64, "d_ff": 64,
    "num_hidden_layers": 2, "num_layers": 2, "n_layer": 2, "n_layers": 2,
    "num_attention_heads": 4, "n_head": 4, "n_heads": 4, "num_heads": 4,
    "head_dim": 8, "kv_channels": 8, "attention_head_dim": 8, "d_head": 8,
    "max_position_embeddings": 256, "n_positions": 256, "n_ctx": 256, "max_seq_len": 256,
    "moe_intermediate_size": 16, "expert_ffn_hidden_size": 16, "shared_expert_intermediate_size": 16,
    "shared_experts_intermediate_size": 16, "expert_intermediate_size": 16,
    "num_experts": 4, "n_routed_experts": 4, "num_local_experts": 4, "moe_num_experts": 4, "n_experts": 4,
    "num_experts_per_tok": 2, "moe_topk": 2, "moe_k": 2, "top_k": 2, "num_experts_per_token": 2,
    "zero_expert_num": 2, "n_group": 1, "topk_group": 1,
    "q_lora_rank": 16, "kv_lora_rank": 16, "o_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
    "v_head_dim": 8, "qk_head_dim": 16, "o_groups": 2,
    "index_n_heads": 2, "index_head_dim": 8,
    # selective paths engaged by the sweep's prompts (3 to 41 tokens): a top-k of 2 key blocks of 4,
    # compression blocks of 4 and 8, windows and chunks of 8
    "index_topk": 2, "index_topk_blocks": 2, "index_block_size": 4,
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    "keep_window_size": 8, "local_attention": 8,
    "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
    "linear_head_dim": 8, "linear_num_heads": 4,
    "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_state": 8, "mamba_n_groups": 1, "mamba_chunk_size": 8,
    "mamba_d_ssm": 64, "state_size": 8, "chunk_size": 8, "ssm_state_size": 8, "time_step_rank": 4,
    "lru_width": 32, "attention_window_size": 8, "sliding_window": 8, "sliding_window_size": 8,
    "attention_chunk_size": 8, "swa_head_dim": 8, "swa_num_attention_heads": 4, "swa_num_key_value_heads": 2,
    "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 128, "laurel_rank": 4,
    "ple_embed_dim": 32, "hc_lowrank": 8, "loop_gate_rank": 4, "gated_norm_rank": 4,
    "d_rel": 4, "rel_extent": 16, "unpadded_vocab_size": 128, "encoder_hash_byte_group_vocab": 128,
    "image_size": 32, "patch_size": 8, "num_channels": 3, "projection_dim": 32, "vision_output_dim": 32,
    "num_key_value_heads": 2, "rotary_dim": 4, "n_shared_experts": 1, "n_groups": 1,
}
#: Fields that set how many experts a token is routed to: with :func:`every_expert`, all of :data:`SMALL`'s 4.
TOP_K_FIELDS = ("num_experts_per_tok", "moe_topk", "moe_k", "top_k", "num_experts_per_token")


def every_expert(sizes: dict[str, Any]) -> dict[str, Any]:
    """``sizes`` with every token routed to every expert: no top-k choice of experts that a bf16 rounding
    can flip (the GPU sweep's bound is on rounding; the CPU sweep holds top-k routing in float32)."""
    return {**sizes, **dict.fromkeys(TOP_K_FIELDS, sizes["num_experts"])}


#: :data:`SMALL` with attention heads of 64 and room for prompts of a thousand tokens: the head size and
#: lengths at which a GPU's packed attention takes NVIDIA's cuDNN frontend (``cudnn_attention.takes``).
WIDE_HEADS: dict[str, Any] = {
    **SMALL,
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "embed_dim", "dim", "lru_width", "ple_embed_dim"), 256),
    **dict.fromkeys(("head_dim", "kv_channels", "attention_head_dim", "d_head", "swa_head_dim"), 64),
    **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len"), 1024),
}
#: Size fields set even where the default is None (None there means "derive it", not "off").
DERIVED_WHEN_NONE = frozenset({"head_dim", "num_key_value_heads", "intermediate_size", "num_experts_per_tok",
                               "n_group", "topk_group"})
LAYER_COUNT_FIELDS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers")
#: Token-id fields: kept inside the tiny vocabulary.
TOKEN_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}

#: Fields a type needs beyond :data:`SMALL` (keyed by model type).
OVERRIDES: dict[str, dict[str, Any]] = {
    "dory": dict(n_input_layers=1, n_recurrent_layers=1, n_output_layers=1, num_hidden_layers=3),
    "mamba2": dict(num_heads=4, head_dim=16),  # hidden x expand = heads x head dim
    "zaya": dict(num_experts_per_tok=1),  # the only value it takes
    "gemma3n_text": dict(num_kv_shared_layers=0),  # the layers that share a cache must keep one that fills it
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),  # its default (None) leaves the pattern unset
    "lfm2": dict(layer_types=["conv", "full_attention"]),  # its default is attention only: keep its convolutions
    "inkling2_loop_text": dict(loop_layer_index_start=1, loop_layer_index_end=2, loop_num_passes=2,
                               n_layers_per_attn_res_block=1),  # a loop inside the tiny stack
    # sliding windows on, shorter than the prompts (their defaults turn them off)
    "qwen2_moe": dict(use_sliding_window=True, sliding_window=8, max_window_layers=1,
                      layer_types=["full_attention", "sliding_attention"]),
    "phimoe": dict(sliding_window=8),
    "dots1": dict(n_routed_experts=4, n_shared_experts=1),  # its defaults (None) build no MoE layer that runs
    # windows and blocks under generic names, shorter than the prompts (their defaults: 256)
    "gpt_neo": dict(window_size=8),
    "minimax": dict(block_size=8),
    # keys and values rounded to NVFP4 (16-wide blocks); an indexer over a pool of 4 blocks of 4, its sparse
    # layer's top-k, local and sink tokens shorter than the prompts; experts in the second layer
    "kolibri1_1": dict(head_dim=16, layer_types=["sliding_attention", "indexed_attention"], index_layers=[1],
                       kv_source_layers=[0, 1], index_num_heads=2, index_pool_size=16, index_compression=4,
                       index_num_local_tokens=4, index_num_sink_tokens=2, mlp_only_layers=[0]),
}


def decoder_only_types() -> list[str]:
    """Every model type transformers maps to a causal-LM class, less the encoder-decoders
    (seq2seq mappings, ``is_encoder_decoder``), the bidirectional encoders that can also be run
    as decoders (masked-LM mapping), the decoder halves of encoder-decoders (``is_decoder`` False
    by default), and text-to-audio generators (text-to-waveform and -spectrogram mappings: their
    causal-LM class decodes audio codes conditioned on a text encoder; MusicGen's). Sorted. The last
    keeps the list the same where a composite config's defaults do not validate: transformers 5.17's
    ``MusicgenConfig()`` raises, and its dataclass defaults say ``is_encoder_decoder`` False."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto import modeling_auto

    causal = set(modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    encoders = (set(modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES)
                | set(modeling_auto.MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES)
                | set(modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES)
                | set(modeling_auto.MODEL_FOR_TEXT_TO_WAVEFORM_MAPPING_NAMES)
                | set(modeling_auto.MODEL_FOR_TEXT_TO_SPECTROGRAM_MAPPING_NAMES))
    kept = []
    for model_type in sorted(causal - encoders):
        defaults = _defaults(CONFIG_MAPPING[model_type])
        if defaults.get("is_encoder_decoder") or defaults.get("is_decoder") is False:
            continue
        kept.append(model_type)
    return kept


def _defaults(config_class: type) -> dict[str, Any]:
    """The class's default fields (from its dataclass fields where its defaults do not validate)."""
    try:
        return config_class().to_dict()
    except Exception:  # noqa: BLE001 (transformers' strict dataclasses raise their own error types)
        fields = getattr(config_class, "__dataclass_fields__", {})
        return {name: field.default for name, field in fields.items()
                if field.default is not dataclasses.MISSING}


def _shrunk(config_class: type, overrides: dict[str, Any], per_layer: bool = True,
            sizes: dict[str, Any] = SMALL) -> dict[str, Any]:
    """Keyword arguments that build a tiny ``config_class``: every size field of ``sizes`` it has,
    unless its default is 0 or None (a part that is off stays off)."""
    present = _defaults(config_class)
    aliases = getattr(config_class, "attribute_map", {}) or {}
    fields: dict[str, Any] = {}
    for key, value in sizes.items():
        if key in present and not isinstance(present[key], bool) and (
                present[key] or (present[key] is None and key in DERIVED_WHEN_NONE)):
            fields[key] = value
        elif key in aliases and aliases[key] not in fields and aliases[key] in present:
            fields[aliases[key]] = value
    for key, value in TOKEN_IDS.items():
        if present.get(key) is not None:
            fields[key] = value
    heads, kv_heads = present.get("num_attention_heads"), present.get("num_key_value_heads")
    if heads and kv_heads == heads:
        fields["num_key_value_heads"] = sizes["num_attention_heads"]  # no grouping in the original: none here
    elif kv_heads == 1:
        fields["num_key_value_heads"] = 1
    if per_layer:
        fields.update(_per_layer_fields(present))
    for name, sub_class in (getattr(config_class, "sub_configs", None) or {}).items():
        sub_default = present.get(name)
        sub_type = sub_default.get("model_type") if isinstance(sub_default, dict) else None
        if sub_class.__name__ == "AutoConfig":
            if not sub_type:
                continue
            from transformers import CONFIG_MAPPING
            sub_class = CONFIG_MAPPING[sub_type]
        sub_fields = _shrunk(sub_class, overrides.get(name, {}), per_layer, sizes)
        fields[name] = {**sub_fields, "model_type": sub_type} if sub_type else sub_fields
    fields.update({key: value for key, value in overrides.items() if not isinstance(value, dict)
                   or key not in (getattr(config_class, "sub_configs", None) or {})})
    return fields


def _per_layer_fields(present: dict[str, Any]) -> dict[str, Any]:
    """The layer count and every per-layer list (or dict keyed by layer index) cut down to one
    layer of each distinct kind (at least two layers), so a hybrid keeps all its mixers."""
    count_field = next((key for key in LAYER_COUNT_FIELDS if isinstance(present.get(key), int)), None)
    if count_field is None:
        return {}
    count = present[count_field]
    lists = {key: value for key, value in present.items() if isinstance(value, list) and len(value) == count}
    per_index = {key: value for key, value in present.items() if isinstance(value, dict) and value
                 and all(isinstance(k, int) or (isinstance(k, str) and k.isdigit()) for k in value)}
    kinds: dict[tuple, int] = {}
    for index in range(count):
        kind = tuple(repr(value[index]) for value in lists.values()) + tuple(
            repr(index in value or str(index) in value) for value in per_index.values())
        kinds.setdefault(kind, index)
    kept = sorted(kinds.values())
    if len(kept) < 2:
        kept = list(range(min(2, count)))
    fields: dict[str, Any] = {count_field: len(kept)}
    for key, value in lists.items():
        fields[key] = [value[index] for index in kept]
    for key, value in per_index.items():
        fields[key] = {new: value.get(old, value.get(str(old))) for new, old in enumerate(kept)
                       if old in value or str(old) in value}
    return fields


def build_tiny_type(model_type: str, out: Path, seed: int = 0, sizes: dict[str, Any] = SMALL) -> Path:
    """Build the type's tiny causal LM (``sizes``: :data:`SMALL`, or :data:`WIDE_HEADS`) with seeded
    random float32 weights and save it to ``out``: one layer of each kind first; where the type
    objects (its validation, or a forward of a few tokens), its default layer pattern on two layers.
    Raises the last error when neither builds."""
    from transformers import AutoModelForCausalLM

    return _build_tiny(model_type, out, seed, AutoModelForCausalLM, OVERRIDES, run_forward=True, sizes=sizes)


#: The spread of the values :func:`fill_zero_parameters` gives.
FILLED_STD = 0.1


def fill_zero_parameters(model: Any, seed: int) -> None:
    """Give every all-zero parameter of ``model`` (biases aside) seeded random values, N(0, 0.1).
    Transformers zero-initializes gates, sinks, position tables and
    length scales (Mllama's cross-attention gates, DeepSeek-VL hybrid's alpha, InternVL's and
    SAM towers' position embeddings, Mistral Large 4's length-scaled softmax, Doge's mask...):
    their paths then add nothing, and a test comparing batched with alone could not see them
    computed wrongly. Zero biases stay (a bias adds the same at every position)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.is_floating_point() and not name.endswith("bias") and not bool(parameter.any()):
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * FILLED_STD)


def _build_tiny(model_type: str, out: Path, seed: int, auto_class: Any, overrides: dict[str, dict[str, Any]],
                run_forward: bool, sizes: dict[str, Any] = SMALL) -> Path:
    """The type's tiny model as ``auto_class`` builds it from :func:`_shrunk` fields (one layer of
    each kind, else the default pattern on two layers; ``run_forward``: a forward of a few tokens
    must run too), saved to ``out``. Raises the last error when neither builds."""
    import torch
    from transformers import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    error: Exception | None = None
    for per_layer in (True, False):
        try:
            config = config_class(**_shrunk(config_class, overrides.get(model_type, {}), per_layer, sizes))
            torch.manual_seed(seed)
            model = auto_class.from_config(config, dtype=torch.float32).eval()
            fill_zero_parameters(model, seed)
            if run_forward:
                with torch.no_grad():
                    model(torch.arange(3, 11)[None], use_cache=False)
        except Exception as exc:  # noqa: BLE001 (transformers' strict dataclasses raise their own error types)
            error = exc
            continue
        model.save_pretrained(out)
        return out
    raise error  # type: ignore[misc]


#: M-RoPE's sections (time, height, width) for a tiny head of 8: they sum to half of it.
TINY_MROPE = {"text_config": {"rope_parameters": {"rope_type": "default", "mrope_section": [1, 1, 2]}}}
#: Fields a vision-language type needs beyond :data:`SMALL` (keyed by model type).
#: GLM's that rotate half of each head: a head of 16, so the sections cover its 4 rotated frequencies.
HALF_ROTARY_MROPE = {"text_config": {**TINY_MROPE["text_config"], "head_dim": 16, "num_attention_heads": 2,
                                     "num_key_value_heads": 1}}
VLM_OVERRIDES: dict[str, dict[str, Any]] = {
    **{name: TINY_MROPE for name in ("qwen2_vl", "qwen2_5_vl", "qwen2_5_omni_thinker", "glm4v", "glm46v",
                                     "paddleocr_vl", "cosmos3_edge", "hy_v4_vl")},
    **{name: HALF_ROTARY_MROPE for name in ("glm4v_moe", "glm_ocr")},
    "glmga": {"text_config": {**HALF_ROTARY_MROPE["text_config"],  # rotates its whole head of 16
                              "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3]}}},
    "step3p7": {"text_config": {"sliding_window": 8}},  # its default leaves the window unset
    # two layers of each MLP kind, one without rotary; each layer its own KV source (72 by default)
    "mistral_large4": {"text_config": {"num_hidden_layers": 2, "mlp_layer_types": ["dense", "sparse"],
                                       "layer_types": ["indexed_attention"] * 2, "no_rope_layers": [1, 0],
                                       "kv_source_layers": [0, 1]}},
    "lfm2_vl": {"text_config": {"num_hidden_layers": 2, "layer_types": ["conv", "full_attention"]}},
    # its image tokenizer, which no token-id job reaches, at sizes SMALL has no field for (32 channels: its
    # GroupNorm's 32 groups): built and initialized at its defaults, twice before the build fails as
    # vlm_types.NOT_BUILT says (its vocabulary map unset), it took 6 s of the sweep's CPU
    "emu3": {"vq_config": {"base_channels": 32, "codebook_size": 64}},
    "llava_onevision1_5": {"vision_config": {"out_hidden_size": 32}},  # its merger's width: the text's hidden size
}


def image_text_types() -> list[str]:
    """Every model type transformers maps to an image-text-to-text class, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return sorted(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


def build_tiny_vlm_type(model_type: str, out: Path, seed: int = 0) -> Path:
    """Build the type's tiny vision-language model (``AutoModelForImageTextToText``, every size
    field shrunk through its text and vision configs) with seeded random float32 weights and
    save it to ``out``; as :func:`build_tiny_type`, one layer of each kind first, else its
    default layer pattern on two layers. Raises the last error when neither builds."""
    from transformers import AutoModelForImageTextToText

    return _build_tiny(model_type, out, seed, AutoModelForImageTextToText, VLM_OVERRIDES, run_forward=False)
