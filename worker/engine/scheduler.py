"""Which pending jobs form the next batch: a pure function of their lengths (no torch).

The head of the queue always goes first, so every job is served in bounded time whatever
its length. The rest fill the batch:

* packed rows cost the sum of the lengths: later jobs fill the gaps, first fit, in order;
* padded batches cost ``jobs x longest`` (the longest rounded up to ``pad_to``): the jobs
  closest in length to the head join while the cost stays within the budget and padding
  stays under ``max_padding`` of ``jobs x longest``, so a backlog sorts itself into
  length groups.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: Padded batches: the largest share of a batch's cost that may be padding.
MAX_PADDING = 0.25


def padded_length(longest: int, pad_to: int) -> int:
    return -(-longest // pad_to) * pad_to


def select_batch(lengths: Sequence[int], compatible: Sequence[bool], *, padded: bool, token_budget: int,
                 max_jobs: int, pad_to: int = 1, max_padding: float = MAX_PADDING) -> list[int]:
    """Indices into the pending jobs (``lengths[0]`` is the head) for the next batch, ascending.
    ``compatible[i]``: job ``i`` may share a batch with the head (same output dtype)."""
    if not padded:
        chosen, tokens = [0], lengths[0]
        for index in range(1, len(lengths)):
            if len(chosen) >= max_jobs or tokens >= token_budget:
                break
            if compatible[index] and tokens + lengths[index] <= token_budget:
                chosen.append(index)
                tokens += lengths[index]
        return chosen
    head = lengths[0]
    chosen, longest, real = [0], head, head
    candidates = sorted((i for i in range(1, len(lengths)) if compatible[i]), key=lambda i: (abs(lengths[i] - head), i))
    for index in candidates:
        if len(chosen) >= max_jobs:
            break
        new_longest = max(longest, lengths[index])
        jobs = len(chosen) + 1
        padding = jobs * new_longest - (real + lengths[index])  # rounding up to pad_to is not counted here
        if jobs * padded_length(new_longest, pad_to) <= token_budget and padding <= max_padding * jobs * new_longest:
            chosen.append(index)
            longest, real = new_longest, real + lengths[index]
    return sorted(chosen)


def plan_batches(lengths: Sequence[int], *, padded: bool, token_budget: int, max_jobs: int,
                 pad_to: int = 1, max_padding: float = MAX_PADDING) -> list[list[int]]:
    """Every job of a full queue (indices into ``lengths``, in arrival order) grouped into
    batches the way the engine would take them from a backlog."""
    pending = list(range(len(lengths)))
    batches = []
    while pending:
        chosen = select_batch([lengths[i] for i in pending], [True] * len(pending), padded=padded,
                              token_budget=token_budget, max_jobs=max_jobs, pad_to=pad_to, max_padding=max_padding)
        batches.append([pending[i] for i in chosen])
        taken = set(chosen)
        pending = [job for i, job in enumerate(pending) if i not in taken]
    return batches


@dataclass(frozen=True)
class BatchPolicy:
    """How one engine forms batches; the bench's ceiling takes the same one, so both batch alike."""

    padded: bool
    token_budget: int
    max_jobs: int
    pad_to: int = 1
    max_padding: float = MAX_PADDING

    def select(self, lengths: Sequence[int], compatible: Sequence[bool]) -> list[int]:
        """:func:`select_batch` under this policy."""
        return select_batch(lengths, compatible, padded=self.padded, token_budget=self.token_budget,
                            max_jobs=self.max_jobs, pad_to=self.pad_to, max_padding=self.max_padding)

    def plan(self, lengths: Sequence[int]) -> list[list[int]]:
        """:func:`plan_batches` under this policy."""
        return plan_batches(lengths, padded=self.padded, token_budget=self.token_budget, max_jobs=self.max_jobs,
                            pad_to=self.pad_to, max_padding=self.max_padding)

    def is_full(self, pending_tokens: int, pending_jobs: int) -> bool:
        """Whether what is queued already fills a batch, so the engine need not wait for more."""
        return pending_tokens >= self.token_budget or pending_jobs >= self.max_jobs
