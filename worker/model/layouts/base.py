"""The protocol every batching layout follows: one class per file in this package, named in
``layertap.worker.model.batching.LAYOUTS``.

A layout says, for one model, how jobs share a forward:

* :meth:`BatchLayout.admits`: whether the model's structure makes it exact (and why not);
* :meth:`BatchLayout.select`: which pending jobs form the next batch (its cost for the scheduler);
* :meth:`BatchLayout.build_inputs`: the batch's tensors, and the rows of real tokens to capture;
* :meth:`BatchLayout.forward_context` and :attr:`BatchLayout.attention`: what the forward needs
  (packed boundaries; the attention implementation the model is switched to);
* :attr:`BatchLayout.alternatives`: the layouts the load-time self-check falls back to.

Invariant of every layout: captured states are laid out as the jobs' real tokens concatenated
in batch order (``bounds[i]:bounds[i + 1]`` is job ``i``).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch
from torch import nn

from layertap.worker.model.attention import WholeRowKeys


class BatchLimits(Protocol):
    """What a layout's :meth:`~BatchLayout.select` may spend (``layertap.worker.engine.scheduler.BatchPolicy``)."""

    token_budget: int
    max_jobs: int
    pad_to: int
    max_padding: float


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` (on the host) on ``device``; to a GPU through pinned memory, without waiting for the copy."""
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def bounds_of(token_ids: Sequence[torch.Tensor]) -> list[int]:
    """``[0, n0, n0 + n1, ...]``: where each job's tokens start in the concatenated capture; the last is the total."""
    return [0, *itertools.accumulate(int(ids.shape[0]) for ids in token_ids)]


@dataclass
class BatchInputs:
    """One batch's tensors (:meth:`BatchLayout.build_inputs`) and where each job's real tokens are; :meth:`run` runs
    its forward."""

    layout: BatchLayout
    input_ids: torch.Tensor  # [1, total] packed, or [B, T]
    position_ids: torch.Tensor | None  # [1, total] restarting per job, or None (the model numbers them)
    rows: torch.Tensor | None  # int64 [total]: real tokens' flat positions in [B * T] (None: every position)
    bounds: list[int]  # job i's tokens are bounds[i]:bounds[i + 1] of the captured layout
    keys: WholeRowKeys | None = None  # packed rows computed over cached prefixes: their keys (``attention``)

    @property
    def total(self) -> int:
        return self.bounds[-1]

    def run(self, decoder: nn.Module) -> Any:
        """One forward of the decoder (no cache) inside the layout's forward context."""
        with self.layout.forward_context(self):
            if self.position_ids is None:
                return decoder(input_ids=self.input_ids, use_cache=False)
            return decoder(input_ids=self.input_ids, position_ids=self.position_ids, use_cache=False)


class BatchLayout:
    """One way for jobs to share a forward. Subclasses set :attr:`name` and implement the methods."""

    name: ClassVar[str]
    #: The attention implementation the model runs under this layout (None: the one transformers chose).
    attention: ClassVar[str | None] = None
    #: Logged as a warning when the layout is in use (a slow path says why it was taken).
    slow: ClassVar[bool] = False

    def __init__(self, reason: str, alternatives: tuple[str, ...] = ()):
        self.reason = reason  # one line: why this layout
        self.alternatives = alternatives  # names the self-check falls back to, in order

    def describe(self) -> str:
        return f"{self.name} ({self.reason})"

    @classmethod
    def admits(cls, model: nn.Module, layers: nn.ModuleList) -> str | None:
        """None when the model's structure makes this layout exact; else why it does not."""
        raise NotImplementedError

    def select(self, lengths: Sequence[int], compatible: Sequence[bool], limits: BatchLimits) -> list[int]:
        """Indices into the pending jobs (``lengths[0]`` is the head, always taken) for the next
        batch, ascending. ``compatible[i]``: job ``i`` may share a batch with the head."""
        raise NotImplementedError

    def build_inputs(self, token_ids: Sequence[torch.Tensor], device: torch.device, pad_to: int = 1,
                     pad_id: int = 0) -> BatchInputs:
        """The batch's tensors for the jobs' int64 token ids (CPU)."""
        raise NotImplementedError

    @contextlib.contextmanager
    def forward_context(self, inputs: BatchInputs) -> Iterator[None]:
        """What the forward runs inside (nothing, unless the layout needs it)."""
        yield
