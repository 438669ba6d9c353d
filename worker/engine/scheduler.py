"""Which pending jobs form the next batch: the model's layout prices a batch
(``BatchLayout.select``: a packed row costs the sum of its lengths, a padded batch
``jobs x longest``), this module holds the engine's limits and plans a backlog.

The head of the queue always goes first, so every job is served in bounded time whatever
its length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from layertap.worker.model.layouts.base import BatchLayout

#: Padded batches: the largest share of a batch's cost that may be padding.
MAX_PADDING = 0.25


@dataclass(frozen=True)
class BatchPolicy:
    """How one engine forms batches; the bench's ceiling takes the same one, so both batch alike."""

    layout: BatchLayout
    token_budget: int
    max_jobs: int
    pad_to: int = 1
    max_padding: float = MAX_PADDING

    def select(self, lengths: Sequence[int], compatible: Sequence[bool]) -> list[int]:
        """Indices into the pending jobs (``lengths[0]`` is the head) for the next batch, ascending.
        ``compatible[i]``: job ``i`` may share a batch with the head (same output dtype)."""
        return self.layout.select(lengths, compatible, self)

    def plan(self, lengths: Sequence[int]) -> list[list[int]]:
        """Every job of a full queue (indices into ``lengths``, in arrival order) grouped into
        batches the way the engine would take them from a backlog."""
        pending = list(range(len(lengths)))
        batches = []
        while pending:
            chosen = self.select([lengths[i] for i in pending], [True] * len(pending))
            batches.append([pending[i] for i in chosen])
            taken = set(chosen)
            pending = [job for i, job in enumerate(pending) if i not in taken]
        return batches

    def is_full(self, pending_tokens: int, pending_jobs: int) -> bool:
        """Whether what is queued already fills a batch, so the engine need not wait for more."""
        return pending_tokens >= self.token_budget or pending_jobs >= self.max_jobs
