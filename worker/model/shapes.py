"""Config-only model shapes with random weights, for benchmarks on machines with no hub.

``load_model("shape:qwen3-8b")`` builds the model from its config directly on the
device (random init, no download, no tokenizer: such a worker takes ``token_ids`` jobs).
Speed does not depend on the weights' values.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from layertap.protocol.naming import SHAPE_PREFIX

if TYPE_CHECKING:
    from torch import nn
    from transformers import PretrainedConfig

SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3-8b": ("qwen3", dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                               num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                               max_position_embeddings=40960, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                               tie_word_embeddings=False)),
    "llama3-8b": ("llama", dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                                rope_theta=500_000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)),
    # A Qwen3-Next-style hybrid of about 8B compute (7.8B in its layers): 3 gated-delta-net
    # layers to 1 gated attention layer, dense MLPs (no experts). Batched padded (``layertap.worker.model.batching``).
    "qwen3-next-8b": ("qwen3_next", dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                                         num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                                         head_dim=128, linear_conv_kernel_dim=4, linear_key_head_dim=128,
                                         linear_value_head_dim=128, linear_num_key_heads=16,
                                         linear_num_value_heads=32, mlp_only_layers=list(range(36)),
                                         max_position_embeddings=40960, rope_theta=10_000_000.0,
                                         rms_norm_eps=1e-6, tie_word_embeddings=False)),
    # Llama-3.3-70B: 80 layers, hidden 8192, GQA 64/8 heads.
    "llama3.3-70b": ("llama", dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                   num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=131072,
                                   rope_theta=500_000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)),
    # Qwen3-30B-A3B: 48 layers, 128 experts, 8 chosen per token.
    "qwen3-30b-a3b": ("qwen3_moe", dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                        moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                                        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                                        head_dim=128, max_position_embeddings=40960, rope_theta=1_000_000.0,
                                        rms_norm_eps=1e-6, norm_topk_prob=True, tie_word_embeddings=False)),
    # Qwen3-235B-A22B: 94 layers, 128 experts, 8 chosen per token; 470 GB in bf16, so split over GPUs
    # (--gpus-per-worker 8, or the bench's --split-stages 8), each stage's weights made on its GPU.
    "qwen3-235b-a22b": ("qwen3_moe", dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                                          moe_intermediate_size=1536, num_experts=128, num_experts_per_tok=8,
                                          num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4,
                                          head_dim=128, max_position_embeddings=40960, rope_theta=1_000_000.0,
                                          rms_norm_eps=1e-6, norm_topk_prob=True, tie_word_embeddings=False)),
    # Qwen2.5-VL-7B's shape (vision tower included): its text jobs measure the VLM's decoder
    # (issue 25's text-only figure); its text decoder is found as for any VLM checkpoint.
    "qwen2.5-vl-7b": ("qwen2_5_vl", dict(
        text_config=dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                         num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=128000,
                         rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                         rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]}),
        vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           fullatt_block_indexes=[7, 15, 23, 31]),
        image_token_id=151655, video_token_id=151656, vision_start_token_id=151652)),
    # The same family at a size a CPU runs in seconds (benchmarks/vlm.py's smoke test).
    "qwen2.5-vl-tiny": ("qwen2_5_vl", dict(
        text_config=dict(vocab_size=4608, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32768,
                         tie_word_embeddings=False, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           fullatt_block_indexes=[1]),
        image_token_id=4097, video_token_id=4098, vision_start_token_id=4099)),
    "qwen3-tiny": ("qwen3", dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                 max_position_embeddings=32768, tie_word_embeddings=False)),
}


def is_shape(source: str) -> bool:
    """``source`` names a random-weight shape (``shape:<name>``), not a checkpoint."""
    return source.startswith(SHAPE_PREFIX)


def shape_config(name: str) -> PretrainedConfig:
    """The transformers config of shape ``name`` (:data:`SHAPES`, without ``shape:``); ``ValueError`` for an
    unknown one."""
    from transformers import AutoConfig

    if name not in SHAPES:
        raise ValueError(f"unknown model shape {name!r}; known: {', '.join(sorted(SHAPES))}")
    family, fields = SHAPES[name]
    return AutoConfig.for_model(family, **fields)


def shape_parameters(name: str) -> int:
    """The shape's parameter count, from a model built on the meta device (no memory, no init)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(shape_config(name))
    return sum(parameter.numel() for parameter in model.parameters())


def build_random_model(name: str, device: torch.device, dtype: torch.dtype, seed: int = 0) -> nn.Module:
    """The shape's model (a CausalLM, or a VLM's ``...ForConditionalGeneration``) with random
    weights, built on ``device`` in ``dtype``."""
    from layertap.worker.model.classes import auto_class

    config = shape_config(name)
    torch.manual_seed(seed)
    with torch.device(device):
        model = auto_class(config).from_config(config, dtype=dtype)
    return model.eval()


def fill_random(model: nn.Module, placement: dict[str, str], dtype: torch.dtype, seed: int = 0) -> None:
    """Give a model built with empty weights (``accelerate.init_empty_weights``: parameters on the
    meta device, buffers real) random weights, each made on the device ``placement`` (an accelerate
    device map) names for it: a shape too big for one GPU is never whole on one. Matrices are
    normal with the config's ``initializer_range``, norm weights ones, other vectors zeros (the
    values ``from_config`` would draw differ; speed does not depend on them)."""
    from accelerate.utils import set_module_tensor_to_device

    def device_of(name: str) -> str:
        prefix = name
        while prefix not in placement:
            if not prefix:
                raise ValueError(f"the device map places no prefix of {name}")
            prefix = prefix.rpartition(".")[0]
        return placement[prefix]

    std = getattr(model.config.get_text_config(), "initializer_range", 0.02)
    torch.manual_seed(seed)
    for name, parameter in list(model.named_parameters()):
        value = torch.empty(parameter.shape, dtype=dtype, device=device_of(name))
        if parameter.dim() > 1:
            value.normal_(0.0, std)
        else:
            value.fill_(1.0 if "norm" in name.rpartition(".")[0].rpartition(".")[2] else 0.0)
        set_module_tensor_to_device(model, name, device_of(name), value=value)
    for name, buffer in list(model.named_buffers()):
        set_module_tensor_to_device(model, name, device_of(name), value=buffer)
    if getattr(model.config.get_text_config(), "tie_word_embeddings", False):
        model.tie_weights()
    model.eval()
