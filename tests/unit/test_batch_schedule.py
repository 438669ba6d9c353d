"""The layouts' batch selection (their cost for the scheduler) and the policy that plans a backlog:
pure functions of lengths (no model, no processes)."""

from __future__ import annotations

from layertap.worker.engine.scheduler import BatchPolicy
from layertap.worker.model.batching import layout_class


def policy(layout: str, budget=100, max_jobs=256, pad_to=1, max_padding=0.25) -> BatchPolicy:
    return BatchPolicy(layout_class(layout)("test"), token_budget=budget, max_jobs=max_jobs, pad_to=pad_to,
                       max_padding=max_padding)


def choose(lengths, layout, budget=100, max_jobs=256, compatible=None, pad_to=1):
    return policy(layout, budget, max_jobs, pad_to).select(lengths, compatible or [True] * len(lengths))


def test_packed_fills_the_budget_first_fit_in_arrival_order():
    assert choose([40, 70, 30, 20, 10], "packed") == [0, 2, 3, 4]  # 70 does not fit beside 40
    assert choose([120, 5], "packed") == [0]  # the head goes alone even past the budget


def test_padded_groups_similar_lengths_and_counts_padding_against_the_budget():
    # head 30: 31 and 28 join (3 x 31 = 93 <= 100); 5 would leave most of its row padding
    assert choose([30, 5, 31, 28, 60], "padded") == [0, 2, 3]
    # four rows of 30 cost 120 > 100: only three fit
    assert choose([30, 30, 30, 30], "padded") == [0, 1, 2]


def test_padded_never_lets_padding_pass_a_quarter_of_the_batch():
    lengths = [40, 10, 12, 30]
    chosen = choose(lengths, "padded", budget=1000)
    longest = max(lengths[i] for i in chosen)
    assert len(chosen) * longest - sum(lengths[i] for i in chosen) <= 0.25 * len(chosen) * longest
    assert chosen == [0, 3]


def test_rounding_up_to_pad_to_counts_against_the_budget_not_the_padding_share():
    assert choose([10, 10, 10], "padded", budget=48, pad_to=16) == [0, 1, 2]
    assert choose([10, 10, 10, 10], "padded", budget=48, pad_to=16) == [0, 1, 2]


def test_the_head_always_goes_first_and_incompatible_jobs_wait():
    assert choose([50, 50, 50], "padded", compatible=[True, False, True]) == [0, 2]
    assert choose([50, 50, 50], "packed", compatible=[True, False, True]) == [0, 2]
    assert choose([5, 5, 5, 5], "padded", max_jobs=2) == [0, 1]


def test_one_prompt_per_batch_takes_the_head_alone():
    assert choose([5, 5, 5], "single") == [0]
    assert policy("single").plan([5, 7, 9]) == [[0], [1], [2]]


def test_a_policy_plans_every_job_once_in_the_order_the_engine_would():
    lengths = [40, 70, 30, 20, 10, 90]
    batches = policy("packed").plan(lengths)
    assert batches == [[0, 2, 3, 4], [1], [5]]
    assert sorted(i for batch in batches for i in batch) == list(range(len(lengths)))


def test_a_queue_is_full_at_the_token_budget_or_the_job_limit():
    full = policy("packed", budget=100, max_jobs=4)
    assert not full.is_full(99, 3)
    assert full.is_full(100, 1)
    assert full.is_full(10, 4)
