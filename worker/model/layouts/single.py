"""One prompt per batch: each job alone in its forward, through the model's own attention.
Slow (a GPU fed one prompt at a time runs at a fraction of its speed) and exact for any causal
model: it is the reference run itself. The fallback for models whose batch rows interact (a
sparse-attention indexer that ranks keys over the whole padded batch, say), taken only when the
load-time self-check finds that padding changes the states, and logged as a warning that says why.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from layertap.worker.model.layouts.base import BatchInputs, BatchLayout, BatchLimits
from layertap.worker.model.layouts.padded import right_padded


class OnePerBatch(BatchLayout):
    """The one-prompt-per-batch layout (``single``): admits any model; the self-check's last fallback."""

    name = "single"
    slow = True

    @classmethod
    def admits(cls, model: nn.Module, layers: nn.ModuleList) -> str | None:
        return None

    def select(self, lengths: Sequence[int], compatible: Sequence[bool], limits: BatchLimits) -> list[int]:
        return [0]

    def build_inputs(self, token_ids: Sequence[torch.Tensor], device: torch.device, pad_to: int = 1,
                     pad_id: int = 0) -> BatchInputs:
        return right_padded(self, token_ids, device, 1, pad_id)  # one job: no padding at all
