"""Padded: prompts of similar length right-padded into a ``[B, T]`` batch through the model's
own attention implementation. Exact for any causal model whose batch rows do not interact: a
real token never sees the padding after it, so linear attention, SSM, convolution and
recurrent mixers (which carry state along a row) are exact too, and so are sinks, softcapping
and ALiBi. Not admitted: a lightning indexer (:func:`key_selection`, DeepSeek-V3.2's sparse
attention and its kin), whose ReLU scores tie at exactly 0 for many keys and whose top-k breaks
those ties by the width of the score row and the batch's shape, both of which padding changes:
a padded prompt picks other keys than the prompt alone (DeepSeek-V4's compressed-sparse layers
did, by 6% in float32). A model that mixes rows otherwise fails the load-time self-check and
falls back to one prompt per batch.

The scheduler's cost is ``jobs x longest`` (the longest rounded up to ``pad_to``): the jobs
closest in length to the head join while the cost stays within the budget and padding stays
under ``max_padding`` of ``jobs x longest``, so a backlog sorts itself into length groups.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from layertap.worker.model.layouts.base import BatchInputs, BatchLayout, BatchLimits, bounds_of, to_device

#: The config field of a lightning indexer (DeepSeek-V3.2's sparse attention): its top-k over keys.
INDEXER_TOPK_FIELD = "index_topk"


def key_selection(model: nn.Module) -> str | None:
    """Why a batch changes which keys the model attends to, or None."""
    if not getattr(model.config.get_text_config(), INDEXER_TOPK_FIELD, None):
        return None
    return (f"a lightning indexer ({INDEXER_TOPK_FIELD}): its ReLU scores tie at 0 and its top-k breaks ties by "
            "the width of the score row, which a batch changes, so batched prompts pick other keys than alone")


def padded_length(longest: int, pad_to: int) -> int:
    """``longest`` rounded up to a multiple of ``pad_to``."""
    return -(-longest // pad_to) * pad_to


def right_padded(layout: BatchLayout, token_ids: Sequence[torch.Tensor], device: torch.device, pad_to: int,
                 pad_id: int) -> BatchInputs:
    """``[B, T]`` right-padded with ``pad_id`` to the longest job rounded up to ``pad_to``; no
    attention mask is needed, as no real token of a causal model sees the padding after it."""
    lengths = [int(ids.shape[0]) for ids in token_ids]
    width = padded_length(max(lengths), pad_to)
    ids = torch.full((len(lengths), width), pad_id, dtype=torch.long)
    for row, job_ids in enumerate(token_ids):
        ids[row, :job_ids.shape[0]] = job_ids
    rows = torch.cat([torch.arange(n, dtype=torch.long) + row * width for row, n in enumerate(lengths)])
    return BatchInputs(layout, to_device(ids, device), None, to_device(rows, device), bounds_of(token_ids))


class Padded(BatchLayout):
    """The padded layout (module doc): ``[B, T]`` right-padded; the jobs nearest the head's length join while the
    batch fits ``token_budget`` and ``max_padding``."""

    name = "padded"

    @classmethod
    def admits(cls, model: nn.Module, layers: nn.ModuleList) -> str | None:
        return key_selection(model)

    def select(self, lengths: Sequence[int], compatible: Sequence[bool], limits: BatchLimits) -> list[int]:
        head = lengths[0]
        chosen, longest, real = [0], head, head
        candidates = sorted((i for i in range(1, len(lengths)) if compatible[i]),
                            key=lambda i: (abs(lengths[i] - head), i))
        for index in candidates:
            if len(chosen) >= limits.max_jobs:
                break
            new_longest = max(longest, lengths[index])
            jobs = len(chosen) + 1
            padding = jobs * new_longest - (real + lengths[index])  # rounding up to pad_to is not counted here
            if (jobs * padded_length(new_longest, limits.pad_to) <= limits.token_budget
                    and padding <= limits.max_padding * jobs * new_longest):
                chosen.append(index)
                longest, real = new_longest, real + lengths[index]
        return sorted(chosen)

    def build_inputs(self, token_ids: Sequence[torch.Tensor], device: torch.device, pad_to: int = 1,
                     pad_id: int = 0) -> BatchInputs:
        return right_padded(self, token_ids, device, pad_to, pad_id)
