"""The reading that refuses a text over the limit (``worker/job/token_budget.py``) with a real
trained byte-level BPE tokenizer: it never refuses a text the tokenizer counts at or under the
limit, its lower bound never passes the tokens the whole text has in what it read, and it stops
reading a text over the limit within a few times the limit in characters."""

from __future__ import annotations

import itertools
import random

import pytest

from layertap.worker.job.token_budget import PROBE_CHARS_PER_TOKEN, first_overflow, longest_token_chars
from layertap.worker.model.tiny_model import build_tokenizer, corpus


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer("qwen3")


def count(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def starting_before(tokenizer, text: str, chars: int) -> int:
    """How many of ``text``'s tokens start in its first ``chars`` characters."""
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    return sum(start < chars for start, _ in offsets)


def pieces_of(text: str, rng: random.Random) -> list[str]:
    """``text`` cut at random places, as a template streams it."""
    cuts = sorted(rng.sample(range(1, len(text)), k=min(20, len(text) - 1)))
    return [text[start:end] for start, end in zip([0, *cuts], [*cuts, len(text)])]


def test_no_text_at_or_under_the_limit_is_refused_and_the_bound_never_passes_the_count(tokenizer):
    rng = random.Random(0)
    lines = list(corpus())
    refused = 0
    for trial in range(60):
        text = " ".join(rng.choice(lines) for _ in range(rng.randint(20, 400)))
        if trial % 3 == 0:  # a long word with no space, cut anywhere
            text += "".join(rng.choice("abcdefghij0123456789") for _ in range(rng.randint(100, 3000)))
        true = count(tokenizer, text)
        for limit, probe in itertools.product((true // 4, true - 200, true - 70, true - 1, true, true + 1, true * 2),
                                              (1, PROBE_CHARS_PER_TOKEN)):  # 1: prefixes cut at every size
            if limit < 1:
                continue
            found = first_overflow(pieces_of(text, rng), limit, longest_token_chars(tokenizer),
                                   lambda part: count(tokenizer, part), probe_chars_per_token=probe)
            if true <= limit:
                assert found is None, (true, limit, found)
            elif found is not None:  # the whole text's tokens that start in what was read: never fewer
                assert limit < found.fewest <= starting_before(tokenizer, text, found.chars), (true, limit, found)
                refused += found.by_prefix
    assert refused > 50  # the prefix bound was exercised, not only the characters bound


def test_a_long_token_vocabulary_is_refused_by_a_prefix_within_a_few_times_the_limit(tokenizer):
    limit = 500
    text = " ".join(corpus()) * 10  # under 500 * 2 * 4096 characters: the characters bound cannot refuse it
    read = []

    def counted(part: str) -> int:
        read.append(len(part))
        return count(tokenizer, part)

    found = first_overflow([text], limit, longest_token_chars=4096, count_tokens=counted)
    assert (found is not None and found.by_prefix
            and limit < found.fewest <= starting_before(tokenizer, text, found.chars))
    assert found.chars == max(read) <= 2 * PROBE_CHARS_PER_TOKEN * (limit + 64) < len(text) // 10
