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
#: Types whose transformers ``output_hidden_states[i]`` is the *output* of block ``i``
#: (Mamba's and RWKV's own loops), not its input: there only the per-block reference applies.
SHIFTED_HIDDEN_STATES = frozenset({"mamba", "falcon_mamba", "mamba2", "rwkv"})

#: Hand-made tiny models, for the tests that force a layout on them or need a mixture of experts.
ARCHITECTURES: dict[str, tuple[str, dict[str, Any], str]] = {
    "gpt-oss-sinks": ("gpt_oss", dict(WINDOW, num_local_experts=4), PADDED),
    "qwen3-moe": ("qwen3_moe", MOE, "packed"),  # the experts and quantized-experts tests
    "gemma2-softcap": ("gemma2", WINDOW, PADDED),
    "qwen3-next": ("qwen3_next", dict(GDN, **MOE, shared_expert_intermediate_size=16), PADDED),
}

#: The sweep (``tests/integration/test_architectures.py``) over every decoder-only type
#: (``tests.support.tiny_configs``): the types no batching layout admits by their structure, served
#: one prompt per batch from the start (the phrase their layout's reason holds).
DSA = "a lightning indexer (index_topk)"  # its top-k breaks exact ties by the batch's width (the layout says why)
ONE_PER_BATCH: dict[str, str] = {name: DSA for name in ("deepseek_v32", "glm_moe_dsa", "axk2", "dots3_note_text",
                                                          "hy_v4", "deepseek_v4", "kolibri1_1")}
#: The types that end on a layout other than the one planned after the load-time self-check, with why.
FALLBACKS: dict[str, tuple[str, str]] = {
    "doge": ("single", "its dynamic mask keeps the top keep_window_size keys of a row as wide as the padded batch "
             "(the self-check measures it); one prompt per forward is the reference run itself"),
    "phimoe": ("padded", "packed attention does not apply its sliding window as its own attention does (the "
               "self-check measures it); padded batches run its own attention"),
    "qwen2_moe": ("padded", "packed attention does not apply its sliding window as its own attention does (the "
                  "self-check measures it); padded batches run its own attention"),
}

#: Types once refused falsely or unable to be captured (issue 24), now served exactly: the CI
#: portion of the sweep always runs them.
SERVED_SINCE_ISSUE_24 = ("longcat_flash", "modernbert-decoder", "deepseek_v4", "qwen4_exp_text", "gemma3n_text")
#: Types whose selective path (window, block, indexer) the tiny configs engage since issue 44, where
#: their defaults left it idle: the CI portion of the sweep always runs them too.
SELECTION_ENGAGED = ("deepseek_v4", "doge", "gpt_neo", "minimax", "minimax_m3_vl_text", "modernbert-decoder")


def check_layout(model_type: str, batching: Any, log_text: str, fallbacks: dict[str, tuple[str, str]],
                 one_per_batch: dict[str, str]) -> None:
    """The type ended on the layout its written expectation says: one prompt per batch by its
    structure, a fallback after the self-check, or the planned layout; a slow one says why in the log."""
    if model_type in one_per_batch:
        assert batching.name == "single" and one_per_batch[model_type] in batching.reason, batching.describe()
    fell_back = "failed the load-time self-check" in batching.reason
    assert fell_back == (model_type in fallbacks), batching.describe()
    if fell_back:
        assert batching.name == fallbacks[model_type][0], batching.describe()
    assert batching.slow == (model_type in one_per_batch or fallbacks.get(model_type, ("",))[0] == "single")
    if batching.slow:
        assert f"served one prompt per batch, which is slow: {batching.reason}" in log_text

#: Types refused at load: (a phrase of the refusal, why that refusal holds).
LOOPED = "runs the same decoder block more than once per forward: which pass is layer i's input is not defined"
REFUSED: dict[str, tuple[str, str]] = {
    "dory": ("runs 2 times per forward (a looped block)", LOOPED),
    "inkling2_loop_text": ("times per forward (a looped block)", LOOPED),
    "hrm_text": ("separate lists", "two stacks (H and L modules) run in cycles: " + LOOPED),
    "emu3": ("transformers has no causal LM class", "transformers saves its causal LM with a text config "
             "(emu3_text_model) that AutoModelForCausalLM cannot load back"),
    "mllama": ("transformers has no causal LM class", "transformers saves its causal LM with a text config "
               "(mllama_text_model) that AutoModelForCausalLM cannot load back"),
    "cpmant": ("residual stream between blocks has shapes", "CPM-Ant puts learned prompt positions before every "
               "input, so its blocks hold more positions than the input has tokens: no state per input token"),
    "xlnet": ("residual stream between blocks has shapes", "XLNet is a permutation LM run time-major ([T, B, H]) "
              "with two streams (content and query), not a left-to-right decoder with one residual stream"),
}

#: Types of which no tiny model can be built here: why.
ASSISTANT = "an assistant (draft) model: its forward needs the target model's shared KV states, so it has none alone"
NOT_BUILT: dict[str, str] = {
    "gemma4_assistant": ASSISTANT + "; its default config does not validate either (hidden_size_per_layer_input)",
    "gemma4_unified_assistant": ASSISTANT,
    "gemma3n": "its vision tower is a timm model, and timm is not installed (gemma3n_text, the same decoder, is swept)",
    "blt": "byte latent transformer: its patcher, local encoder/decoder and global model sizes are tied in ways the "
           "generic shrinking of tests.support.tiny_configs does not follow",
    "dbrx": "its attention and FFN settings are nested configs the generic shrinking does not build (rope_theta)",
    "cohere_compass_text": "its default rope parameters are not keyed by its layer types, so a tiny one does not build",
    "dots3_note": "its per-layer config is keyed by layer indices of the full model; dots3_note_text (the same decoder)"
                  " is swept",
    "zamba": "its shared transformer's tied weights need the full layer pattern; zamba2 is swept",
}

#: Types of which no tiny model with :data:`~tests.support.tiny_configs.WIDE_HEADS` sizes builds (the GPU
#: sweep's cuDNN part, ``tests/gpu/test_architectures_bf16.py``): why.
MLA_WIDE = ("multi-head latent attention: its heads are sized by qk_nope_head_dim, qk_rope_head_dim and v_head_dim, "
            "and a hidden size of 256 does not fit its projections as the generic shrinking sets them")
SSM_WIDE = "its state-space heads are tied to hidden_size x expand, which the generic shrinking does not follow"
NOT_BUILT_WIDE: dict[str, str] = {
    **dict.fromkeys(("axk1", "deepseek_v3", "longcat_flash", "youtu"), MLA_WIDE),
    **dict.fromkeys(("bamba", "granitemoehybrid", "mamba2"), SSM_WIDE),
}

#: The sweeps' prompt lengths (CPU, and the GPU's tiny heads), all sent at once: the engine batches them.
SWEEP_LENGTHS = (3, 41, 17, 9, 26, 38, 30, 12)


def sweep_prompts(vocab_size: int, lengths: tuple[int, ...] = SWEEP_LENGTHS, seed: int = 0) -> list[list[int]]:
    """Seeded random prompts of ``lengths`` tokens, ids from 3 (past the special ones) to the vocabulary or 128."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, min(vocab_size, 128), (n,), generator=generator).tolist() for n in lengths]


#: the three architectures the integration tests run workers on (``tiny_models``)
ARCHES = ("qwen3", "llama", "gpt2")


def build_tiny(name: str, out: Path, seed: int = 0) -> Path:
    """Build the named tiny model with random (seeded) float32 weights and save it to ``out``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.support.tiny_configs import fill_zero_parameters

    model_type, overrides, _ = ARCHITECTURES[name]
    fields = {**BASE, **overrides}
    fields = {key: value for key, value in fields.items() if value is not None}
    config = AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fill_zero_parameters(model, seed)
    model.save_pretrained(out)
    return out
