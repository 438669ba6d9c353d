"""The bench's useful FLOPs (the numerator of its MFU) count the weights a token meets: a quantized
checkpoint as many as the float model it was made from, a mixture of experts only the experts each
token is routed to. Tiny real models loaded by the worker's loader; the expected counts are worked
out here from each config, not from the code under test."""

from __future__ import annotations

from layertap.worker.bench.measure import useful_flops
from layertap.worker.model.loading import load_model
from tests.support.architectures import BASE, MOE, build_tiny
from tests.support.quantized import write_quantized

LENGTHS = [5, 9]


def attention_weights(hidden: int, heads: int, kv_heads: int, head_dim: int) -> int:
    """q, k, v, o projections, the two layer norms and Qwen3's q/k norms."""
    return hidden * head_dim * (2 * heads + 2 * kv_heads) + 2 * hidden + 2 * head_dim


def attention_flops(layers: int) -> int:
    return sum(2 * n * n * BASE["num_attention_heads"] * BASE["head_dim"] for n in LENGTHS) * layers


def expected(mlp_weights: int, layers: int) -> int:
    per_layer = attention_weights(BASE["hidden_size"], BASE["num_attention_heads"], BASE["num_key_value_heads"],
                                  BASE["head_dim"]) + mlp_weights
    return 2 * per_layer * layers * sum(LENGTHS) + attention_flops(layers)


def test_a_mixture_counts_the_experts_a_token_is_routed_to(tmp_path):
    hidden, inter = BASE["hidden_size"], MOE["moe_intermediate_size"]
    loaded = load_model(str(build_tiny("qwen3-moe", tmp_path / "moe")), name="moe", device="cpu", dtype="float32")
    router = MOE["num_experts"] * hidden
    routed = MOE["num_experts_per_tok"] * 3 * hidden * inter  # gate, up, down of each expert met
    assert useful_flops(loaded, [3], LENGTHS) == expected(router + routed, 3)


def test_a_quantized_checkpoint_counts_the_weights_of_the_model_it_was_made_from(tiny_models, tmp_path):
    sources = {"dense": tiny_models["qwen3"], "mixture": build_tiny("qwen3-moe", tmp_path / "moe")}
    for kind, source in sources.items():
        float_model = load_model(str(source), name=kind, device="cpu", dtype="float32")
        fp8 = load_model(str(write_quantized(source, tmp_path / f"fp8-{kind}", "fp8-block")), name=f"fp8-{kind}",
                         device="cpu", dtype="float32")
        assert fp8.quantization is not None, kind
        assert useful_flops(fp8, [4], LENGTHS) == useful_flops(float_model, [4], LENGTHS), kind
