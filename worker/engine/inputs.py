"""The tensors of one batch for the decoder, for either batching path.

Invariant: captured states are laid out as the jobs' real tokens concatenated in batch
order (``bounds[i]:bounds[i + 1]`` is job ``i``), whatever the path. ``rows`` maps that
layout into the flattened ``[B * T]`` positions of a padded batch (None when packed:
the row *is* that layout).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from worker.engine.scheduler import MAX_PADDING, BatchPolicy, padded_length
from worker.model.attention import packed_sequences
from worker.model.batching import BatchingPath
from worker.model.loading import LoadedModel

#: Padded batches on a GPU are rounded up to this many tokens per row, so kernels see few
#: distinct shapes (Triton autotuning and cuDNN plans are per shape).
PAD_TO_CUDA = 16


def pad_multiple(device: torch.device) -> int:
    """What padded rows are rounded up to on ``device`` (1 on the CPU: no shape caches there)."""
    return PAD_TO_CUDA if device.type == "cuda" else 1


def batch_policy(loaded: LoadedModel, *, token_budget: int, max_jobs: int,
                 max_padding: float = MAX_PADDING) -> BatchPolicy:
    """The batching policy for ``loaded``: its batching path and its device's padded-row multiple."""
    return BatchPolicy(padded=loaded.batching.path is BatchingPath.padded, token_budget=token_budget,
                       max_jobs=max_jobs, pad_to=pad_multiple(loaded.device), max_padding=max_padding)


@dataclass
class BatchInputs:
    path: BatchingPath
    input_ids: torch.Tensor  # [1, total] packed, or [B, T] right-padded
    position_ids: torch.Tensor | None  # [1, total], restarting per job (packed only)
    rows: torch.Tensor | None  # int64 [total]: real tokens' flat positions in [B * T] (padded only)
    bounds: list[int]  # job i's tokens are bounds[i]:bounds[i + 1] of the captured layout

    @property
    def total(self) -> int:
        return self.bounds[-1]

    def run(self, decoder: nn.Module) -> Any:
        """One forward of the decoder (no cache); packed rows declare their boundaries."""
        context = packed_sequences(self.bounds) if self.path is BatchingPath.packed else contextlib.nullcontext()
        with context:
            if self.position_ids is None:
                return decoder(input_ids=self.input_ids, use_cache=False)
            return decoder(input_ids=self.input_ids, position_ids=self.position_ids, use_cache=False)


def _to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def build_inputs(token_ids: Sequence[torch.Tensor], path: BatchingPath, device: torch.device,
                 pad_to: int = 1, pad_id: int = 0) -> BatchInputs:
    """Batch the jobs' int64 token ids (CPU) for ``path``. Padded batches are right-padded
    with ``pad_id`` to the longest job rounded up to ``pad_to``; no attention mask is needed,
    as no real token of a causal model sees the padding after it."""
    lengths = [int(ids.shape[0]) for ids in token_ids]
    bounds = [0, *itertools.accumulate(lengths)]
    if path is BatchingPath.packed:
        ids = torch.cat(list(token_ids))[None]
        positions = torch.cat([torch.arange(n, dtype=torch.long) for n in lengths])[None]
        return BatchInputs(path, _to_device(ids, device), _to_device(positions, device), None, bounds)
    width = padded_length(max(lengths), pad_to)
    ids = torch.full((len(lengths), width), pad_id, dtype=torch.long)
    for row, job_ids in enumerate(token_ids):
        ids[row, :job_ids.shape[0]] = job_ids
    rows = torch.cat([torch.arange(n, dtype=torch.long) + row * width for row, n in enumerate(lengths)])
    return BatchInputs(path, _to_device(ids, device), None, _to_device(rows, device), bounds)
