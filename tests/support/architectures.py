"""Tiny random configs of every causal-LM family the architecture sweep covers.

Each entry is ``(model_type, config overrides, expected batching path)``: built with
``AutoConfig.for_model`` on top of :data:`BASE` (hidden 32, 4 layers, vocabulary 128),
saved with ``save_pretrained`` and loaded back through ``from_pretrained``. Overrides make
the family's distinctive parts small but present: sliding windows shorter than the
prompts, local/global patterns, experts, MLA, and hybrid layer patterns that include
attention and the non-attention mixer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

BASE: dict[str, Any] = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                            tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
WINDOW = dict(sliding_window=8)  # shorter than most test prompts
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
MAMBA = dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1, mamba_expand=2, mamba_chunk_size=8)
MLA = dict(num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
           n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, first_k_dense_replace=1,
           n_group=1, topk_group=1)
GDN = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8)

PACKED, PADDED = "packed", "padded"
#: Families whose transformers ``output_hidden_states[i]`` is the *output* of block ``i``
#: (Mamba's own loop), not its input: there only the per-block reference applies.
SHIFTED_HIDDEN_STATES = frozenset({"mamba", "falcon-mamba", "mamba2"})

ARCHITECTURES: dict[str, tuple[str, dict[str, Any], str]] = {
    # attention only: packed
    "llama": ("llama", {}, PACKED),
    "mistral-sliding": ("mistral", WINDOW, PACKED),
    "qwen2": ("qwen2", {}, PACKED),
    "qwen3": ("qwen3", {}, PACKED),
    "qwen3-moe": ("qwen3_moe", MOE, PACKED),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2), PACKED),
    "gemma": ("gemma", {}, PACKED),
    "gemma3-local-global": ("gemma3_text", dict(WINDOW, layer_types=["sliding_attention", "full_attention"] * 2),
                            PACKED),
    "gemma4-local-global": ("gemma4_text", WINDOW, PACKED),
    "phi": ("phi", {}, PACKED),
    "phi3": ("phi3", {}, PACKED),
    "gpt2": ("gpt2", {}, PACKED),
    "gpt-neox": ("gpt_neox", {}, PACKED),
    "gptj": ("gptj", dict(rotary_dim=8, n_embd=32, n_head=4, n_layer=4, n_positions=512), PACKED),

    "olmo2": ("olmo2", {}, PACKED),
    "olmo3-sliding": ("olmo3", WINDOW, PACKED),
    "granite": ("granite", {}, PACKED),
    "cohere": ("cohere", {}, PACKED),
    "cohere2-sliding": ("cohere2", WINDOW, PACKED),
    "starcoder2": ("starcoder2", {}, PACKED),
    "deepseek-v2-mla": ("deepseek_v2", dict(MLA, q_lora_rank=None), PACKED),
    "deepseek-v3-mla": ("deepseek_v3", dict(MLA, q_lora_rank=16), PACKED),
    "llama4-chunked": ("llama4_text", dict(attention_chunk_size=8, num_local_experts=2), PADDED),
    "glm4": ("glm4", {}, PACKED),
    "glm4-moe": ("glm4_moe", dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                  first_k_dense_replace=1, n_group=1, topk_group=1), PACKED),
    "ernie4.5-moe": ("ernie4_5_moe", dict(moe_num_experts=4, moe_k=2, moe_intermediate_size=16), PACKED),
    "hunyuan-dense": ("hunyuan_v1_dense", {}, PACKED),
    "seed-oss": ("seed_oss", {}, PACKED),
    "smollm3": ("smollm3", {}, PACKED),
    "exaone4-sliding": ("exaone4", WINDOW, PACKED),
    # attention whose features packed attention lacks, or outside transformers' interface: padded
    "gpt-oss-sinks": ("gpt_oss", dict(WINDOW, num_local_experts=4), PADDED),
    "gemma2-softcap": ("gemma2", WINDOW, PADDED),
    "bloom-alibi": ("bloom", dict(n_layer=4, n_head=4), PADDED),
    "stablelm": ("stablelm", {}, PADDED),
    "falcon": ("falcon", dict(new_decoder_architecture=True, num_kv_heads=2, head_dim=None), PADDED),
    # linear attention, SSM, convolution and recurrent mixers (hybrids and pure): padded
    "qwen3.5": ("qwen3_5_text", GDN, PADDED),
    "qwen3.5-moe": ("qwen3_5_moe_text", dict(GDN, **MOE, shared_expert_intermediate_size=16), PADDED),
    "qwen3-next": ("qwen3_next", dict(GDN, **MOE, shared_expert_intermediate_size=16), PADDED),
    "kimi-linear": ("kimi_linear", dict(num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=8,
                                        qk_nope_head_dim=8, v_head_dim=8, num_experts=4, num_experts_per_token=2,
                                        moe_intermediate_size=16, linear_head_dim=8, linear_num_heads=4,
                                        layer_types=["linear_attention", "full_attention"] * 2,
                                        mlp_layer_types=["dense", "sparse"] * 2), PADDED),
    "minimax-lightning": ("minimax", dict(num_local_experts=4, num_experts_per_tok=2), PADDED),
    "nemotron-h": ("nemotron_h", dict(MAMBA, hybrid_override_pattern="M*M-", n_routed_experts=4), PADDED),
    "granite4-hybrid": ("granitemoehybrid", dict(MAMBA, layer_types=["mamba", "attention", "mamba", "mamba"],
                                                 num_local_experts=4, num_experts_per_tok=2), PADDED),
    "bamba": ("bamba", dict(MAMBA, attn_layer_indices=[1]), PADDED),
    "falcon-h1": ("falcon_h1", dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_ssm=64, mamba_d_state=8,
                                    mamba_n_groups=1, mamba_chunk_size=8), PADDED),
    "jamba": ("jamba", dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                            num_experts=4, mamba_d_state=8), PADDED),
    "olmo-hybrid": ("olmo_hybrid", {}, PADDED),
    "zamba": ("zamba", dict(mamba_d_state=8, attn_layer_period=2, attn_layer_offset=1, n_mamba_heads=2), PADDED),
    "lfm2-conv": ("lfm2", dict(layer_types=["conv", "full_attention", "conv", "conv"]), PADDED),
    "recurrent-gemma": ("recurrent_gemma", dict(lru_width=32, attention_window_size=8), PADDED),
    "mamba": ("mamba", {}, PADDED),
    "falcon-mamba": ("falcon_mamba", {}, PADDED),
    "mamba2": ("mamba2", dict(num_heads=4, head_dim=16, state_size=8, n_groups=1, expand=2, chunk_size=8), PADDED),
}

#: the three architectures the integration tests run workers on (``tiny_models``)
ARCHES = ("qwen3", "llama", "gpt2")


def build_tiny(name: str, out: Path, seed: int = 0) -> Path:
    """Build the named tiny model with random (seeded) float32 weights and save it to ``out``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, overrides, _ = ARCHITECTURES[name]
    fields = {**BASE, **overrides}
    fields = {key: value for key, value in fields.items() if value is not None}
    config = AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    return out
