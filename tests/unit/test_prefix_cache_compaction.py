"""The prefix cache's room (``layertap.worker.engine.prefix_cache``): a cached batch most of whose rows
later kept rows hold whole keeps only its other rows (their keys, values and states, unchanged),
which are still found; a batch all of whose rows are held whole goes; a later row that is not kept
frees nothing. Bookkeeping on CPU tensors: the forward is tested in tests/integration/test_prefix_cache.py."""

from __future__ import annotations

import torch

from layertap.worker.engine.prefix_cache import BatchNeeds, CachedBatch, PrefixCache, PrefixUse
from layertap.worker.engine.records import EngineRequest

LAYERS = (1, 2)
NEEDS = BatchNeeds(LAYERS, final=False, layers_run=2)
#: bytes a cached token takes here: two layers' keys and values ([2, 4] each) and two states of 8, float32
TOKEN_BYTES = 4 * (2 * 2 * 2 * 4 + 2 * 8)


def cached(rows: list[list[int]], seed: int) -> CachedBatch:
    """A batch of ``rows`` laid end to end, with random keys, values and states."""
    generator = torch.Generator().manual_seed(seed)
    total = sum(map(len, rows))
    starts = [sum(map(len, rows[:index])) for index in range(len(rows))]
    keys = {layer: torch.randn(total, 2, 4, generator=generator) for layer in range(2)}
    values = {layer: torch.randn(total, 2, 4, generator=generator) for layer in range(2)}
    return CachedBatch(keys, values, torch.randn(total, 2, 8, generator=generator), LAYERS, None, 2,
                       [(torch.tensor(row).numpy(), start) for row, start in zip(rows, starts)])


def row(first: int, length: int) -> list[int]:
    return list(range(first, first + length))


def request(tokens: list[int]) -> EngineRequest:
    return EngineRequest(torch.tensor(tokens, dtype=torch.long), list(LAYERS))


def test_a_batch_left_with_half_its_tokens_or_fewer_keeps_only_those_and_they_are_still_found():
    short, middle, kept = row(1000, 32), row(2000, 48), row(3000, 64)
    cache = PrefixCache(1 << 20)
    first = cached([short, middle, kept], seed=0)
    kept_keys = [first.keys[layer][80:].clone() for layer in range(2)]
    kept_values, kept_states = first.values[1][80:].clone(), first.states[80:].clone()
    cache.add(first, [None, None, None])
    assert cache.held_bytes == 144 * TOKEN_BYTES

    # a later batch holds the first two rows whole: 80 of 144 tokens, so the first batch keeps its third row
    longer = cached([short + row(5000, 16), middle + row(6000, 16)], seed=1)
    cache.add(longer, [PrefixUse(first, 0, 32, 32), PrefixUse(first, 1, 48, 48)])
    assert first.tokens == 64 and [start for _, start in first.rows] == [0]
    assert cache.held_bytes == (64 + 112) * TOKEN_BYTES
    assert all(torch.equal(first.keys[layer], kept_keys[layer]) for layer in range(2))
    assert torch.equal(first.values[1], kept_values) and torch.equal(first.states, kept_states)

    (use,) = cache.plan([request(kept + [7, 7])], NEEDS)
    assert use is not None and use.source is first and (use.row, use.start, use.length) == (0, 0, 64)
    (use,) = cache.plan([request(middle + [9])], NEEDS)
    assert use is not None and use.source is longer and (use.row, use.length) == (1, 48)


def test_a_batch_left_with_over_half_its_tokens_keeps_them_all_and_one_left_with_none_goes():
    short, kept = row(1000, 32), row(3000, 64)
    cache = PrefixCache(1 << 20)
    first = cached([short, kept], seed=0)
    cache.add(first, [None, None])
    cache.add(cached([short + row(5000, 16)], seed=1), [PrefixUse(first, 0, 32, 32)])
    assert first.tokens == 96 and first.live == {1}  # 64 of 96 tokens left found: not copied
    assert cache.held_bytes == (96 + 48) * TOKEN_BYTES
    cache.add(cached([kept + row(7000, 16)], seed=2), [PrefixUse(first, 1, 64, 64)])
    assert len(cache) == 2 and cache.held_bytes == (48 + 80) * TOKEN_BYTES


def test_a_later_row_that_is_not_kept_leaves_the_rows_it_holds_found():
    short, middle = row(1000, 32), row(2000, 48)
    cache = PrefixCache(100 * TOKEN_BYTES)
    first = cached([short, middle], seed=0)
    cache.add(first, [None, None])
    too_big = cached([short + row(5000, 100)], seed=1)  # over the budget: not kept
    cache.add(too_big, [PrefixUse(first, 0, 32, 32)])
    assert first.live == {0, 1} and first.tokens == 80
    (use,) = cache.plan([request(short + [4])], NEEDS)
    assert use is not None and use.source is first


def test_a_system_prompt_many_batches_hold_is_found_while_any_of_them_is_cached():
    """Rows of two conversations sharing a system prompt, each in its own batch: when the budget
    evicts the batch that indexed the prompt last, the other still holds it, and a third
    conversation's row takes the prompt from it."""
    system = row(5000, 40)  # two whole blocks and 8 tokens
    cache = PrefixCache(130 * TOKEN_BYTES, lambda tokens, layers: tokens * TOKEN_BYTES)
    first = cached([system + row(1000, 20)], seed=0)
    cache.add(first, [None])
    cache.add(cached([system + row(2000, 20)], seed=1), [None])  # the prompt's newest holder
    (use,) = cache.plan([request(system + row(1000, 20) + [3])], NEEDS)  # first is used: second is least recent
    assert use is not None and use.source is first
    cache.add(cached([row(6000, 60)], seed=2), [None])  # over the budget: second goes
    assert len(cache) == 2
    (use,) = cache.plan([request(system + row(7000, 20))], NEEDS)
    assert use is not None and use.source is first and use.length == len(system)
