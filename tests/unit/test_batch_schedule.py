"""The batching policy alone: a pure function of lengths (no torch, no processes)."""

from __future__ import annotations

from worker.engine.scheduler import BatchPolicy, plan_batches, select_batch


def choose(lengths, padded, budget=100, max_jobs=256, compatible=None, pad_to=1):
    return select_batch(lengths, compatible or [True] * len(lengths), padded=padded, token_budget=budget,
                        max_jobs=max_jobs, pad_to=pad_to)


def test_packed_fills_the_budget_first_fit_in_arrival_order():
    assert choose([40, 70, 30, 20, 10], padded=False) == [0, 2, 3, 4]  # 70 does not fit beside 40
    assert choose([120, 5], padded=False) == [0]  # the head goes alone even past the budget


def test_padded_groups_similar_lengths_and_counts_padding_against_the_budget():
    # head 30: 31 and 28 join (3 x 31 = 93 <= 100); 5 would leave most of its row padding
    assert choose([30, 5, 31, 28, 60], padded=True) == [0, 2, 3]
    # four rows of 30 cost 120 > 100: only three fit
    assert choose([30, 30, 30, 30], padded=True) == [0, 1, 2]


def test_padded_never_lets_padding_pass_a_quarter_of_the_batch():
    lengths = [40, 10, 12, 30]
    chosen = choose(lengths, padded=True, budget=1000)
    longest = max(lengths[i] for i in chosen)
    assert len(chosen) * longest - sum(lengths[i] for i in chosen) <= 0.25 * len(chosen) * longest
    assert chosen == [0, 3]


def test_rounding_up_to_pad_to_counts_against_the_budget_not_the_padding_share():
    assert choose([10, 10, 10], padded=True, budget=48, pad_to=16) == [0, 1, 2]
    assert choose([10, 10, 10, 10], padded=True, budget=48, pad_to=16) == [0, 1, 2]


def test_the_head_always_goes_first_and_incompatible_jobs_wait():
    assert choose([50, 50, 50], padded=True, compatible=[True, False, True]) == [0, 2]
    assert choose([50, 50, 50], padded=False, compatible=[True, False, True]) == [0, 2]
    assert choose([5, 5, 5, 5], padded=True, max_jobs=2) == [0, 1]


def test_plan_batches_takes_every_job_once_in_the_order_the_engine_would():
    lengths = [40, 70, 30, 20, 10, 90]
    batches = plan_batches(lengths, padded=False, token_budget=100, max_jobs=256)
    assert batches == [[0, 2, 3, 4], [1], [5]]
    assert sorted(i for batch in batches for i in batch) == list(range(len(lengths)))


def test_a_policy_selects_and_plans_as_the_functions_do_with_its_fields():
    policy = BatchPolicy(padded=True, token_budget=48, max_jobs=3, pad_to=16, max_padding=0.5)
    lengths = [10, 12, 9, 11, 30]
    assert policy.select(lengths, [True] * 5) == select_batch(
        lengths, [True] * 5, padded=True, token_budget=48, max_jobs=3, pad_to=16, max_padding=0.5)
    assert policy.plan(lengths) == plan_batches(lengths, padded=True, token_budget=48, max_jobs=3, pad_to=16,
                                                max_padding=0.5)


def test_a_queue_is_full_at_the_token_budget_or_the_job_limit():
    policy = BatchPolicy(padded=False, token_budget=100, max_jobs=4)
    assert not policy.is_full(99, 3)
    assert policy.is_full(100, 1)
    assert policy.is_full(10, 4)
