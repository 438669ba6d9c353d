"""The self-check's probes reach past every selective span the config names (issue 44): a
window, chunk, compression block or indexer top-k is engaged by the longest probe, and the
probes mix very short with very long."""

from __future__ import annotations

from transformers import DeepseekV4Config, GPTNeoConfig, LlamaConfig, MistralConfig

from layertap.worker.engine.probes import (
    MIN_LONGEST,
    PROBE_COUNT,
    PROBE_STATE_BYTES,
    SHORTEST,
    SPAN_MULTIPLE,
    interleaved,
    plan_probes,
    selection_span,
    spread,
)


def test_a_model_with_no_span_gets_short_and_long_probes_all_the_same():
    assert selection_span(LlamaConfig()) == (0, [])
    plan = plan_probes(LlamaConfig(num_hidden_layers=2, hidden_size=32), 2, 32, 4)
    assert (min(plan.lengths), max(plan.lengths)) == (SHORTEST, MIN_LONGEST)
    assert len(set(plan.lengths)) == len(plan.lengths) == PROBE_COUNT
    assert not plan.short_of


def test_deepseek_v4s_indexer_span_is_its_top_k_times_its_smallest_block():
    """V4's compressed-sparse top-k selects once a prompt has more than index_topk blocks of 4."""
    config = DeepseekV4Config()  # index_topk 512, compress rates 4 and 128, window 128
    assert selection_span(config) == (512 * 4, ["index_topk"])
    tiny = DeepseekV4Config(index_topk=2, sliding_window=8,
                            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8})
    assert selection_span(tiny) == (8, ["compress_rates", "index_topk", "sliding_window"])


def test_the_longest_probe_covers_several_windows():
    for config, span in ((MistralConfig(sliding_window=700), 700), (GPTNeoConfig(window_size=256), 256)):
        plan = plan_probes(config, 2, 32, 2)
        assert max(plan.lengths) == SPAN_MULTIPLE * span, plan
        assert min(plan.lengths) == SHORTEST


def test_memory_and_positions_bound_the_longest_probe_and_the_plan_says_so():
    wide = plan_probes(MistralConfig(sliding_window=4096), 80, 8192, 2)
    longest = PROBE_STATE_BYTES // (81 * 8192 * 2) // 2
    assert max(wide.lengths) == longest < SPAN_MULTIPLE * 4096
    assert "memory bound" in wide.short_of
    short = plan_probes(MistralConfig(sliding_window=100, max_position_embeddings=128), 2, 32, 2)
    assert max(short.lengths) == 128 and "max_position_embeddings" in short.short_of


def test_probes_are_distinct_and_each_short_one_sits_beside_a_long_one():
    lengths = spread(64)
    assert lengths == sorted(set(lengths)) and lengths[0] == SHORTEST and lengths[-1] == 64
    assert interleaved([3, 5, 9, 64]) == (64, 3, 9, 5)
    assert spread(10, count=8) == [3, 4, 5, 6, 7, 8, 9, 10]  # never two of one length
