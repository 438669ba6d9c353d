"""What the architecture sweep expects of each decoder-only type, and a few hand-made tiny models.

The types themselves are listed by code (``tests.support.tiny_configs.decoder_only_types``);
here are only the exceptions, each with a written reason: the types that fall back to a slower
layout, the ones refused, and the ones no tiny model can be built of. Hand-made models
(``(model_type, config overrides, batching layout)`` on top of :data:`BASE`) serve the tests
that force a layout.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

BASE: dict[str, Any] = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                            tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
WINDOW = dict(sliding_window=8)  # shorter than most test prompts
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
GDN = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8)

PADDED = "padded"
#: Families whose transformers ``output_hidden_states[i]`` is the *output* of block ``i``
#: (Mamba's own loop), not its input: there only the per-block reference applies.
SHIFTED_HIDDEN_STATES = frozenset({"mamba", "falcon_mamba", "mamba2"})

#: Hand-made tiny models of three families, for the tests that force a layout on them.
ARCHITECTURES: dict[str, tuple[str, dict[str, Any], str]] = {
    "gpt-oss-sinks": ("gpt_oss", dict(WINDOW, num_local_experts=4), PADDED),
    "gemma2-softcap": ("gemma2", WINDOW, PADDED),
    "qwen3-next": ("qwen3_next", dict(GDN, **MOE, shared_expert_intermediate_size=16), PADDED),
}

#: The sweep (``tests/integration/test_architectures.py``) over every decoder-only type
#: (``tests.support.tiny_configs``): the types that end on a layout other than packed or padded
#: after the load-time self-check, with why.
FALLBACKS: dict[str, tuple[str, str]] = {}

#: Types refused at load: (a phrase of the refusal, why that refusal holds).
REFUSED: dict[str, tuple[str, str]] = {}

#: Types of which no tiny model can be built here: why.
NOT_BUILT: dict[str, str] = {}

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
