"""Where each job's outputs sit in its batch's outputs: a pure function of the jobs (no torch).

A batch captures the union of its jobs' layers, ascending, for its tokens laid out as the
jobs' real tokens concatenated in batch order (``layertap.worker.model.layouts``). The top-k outputs
hold the asked rows of the batch's top-k jobs only, in batch order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class JobPlace:
    """One job's share of a batch's outputs."""

    start: int  # its tokens are start:end of the captured layout
    end: int
    slots: list[int]  # its layers' positions in the batch's layer union, in the job's order
    topk_rows: slice | None  # its rows in the batch's top-k outputs; None when it asked for no top-k


def layer_union(layer_ids: Sequence[Sequence[int]]) -> list[int]:
    """Every layer some job of the batch wants, ascending, each once."""
    return sorted(set().union(*layer_ids))


def place_jobs(lengths: Sequence[int], layer_ids: Sequence[Sequence[int]],
               topk_row_counts: Sequence[int | None]) -> list[JobPlace]:
    """Each job's place, in batch order. ``topk_row_counts[i]``: how many top-k rows job ``i``
    asked for (None: no top-k)."""
    union = layer_union(layer_ids)
    places, start, topk_start = [], 0, 0
    for length, layers, topk_rows in zip(lengths, layer_ids, topk_row_counts):
        rows = None
        if topk_rows is not None:
            rows, topk_start = slice(topk_start, topk_start + topk_rows), topk_start + topk_rows
        places.append(JobPlace(start, start + length, [union.index(layer) for layer in layers], rows))
        start += length
    return places
