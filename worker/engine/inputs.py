"""The engine's batching policy for a loaded model: its layout (``layertap.worker.model.layouts``) and
its device's padded-row multiple. The layout builds each batch's tensors."""

from __future__ import annotations

import torch

from layertap.worker.engine.scheduler import MAX_PADDING, BatchPolicy
from layertap.worker.model.loading import LoadedModel

#: Padded batches on a GPU are rounded up to this many tokens per row, so kernels see few
#: distinct shapes (Triton autotuning and cuDNN plans are per shape).
PAD_TO_CUDA = 16


def pad_multiple(device: torch.device) -> int:
    """What padded rows are rounded up to on ``device`` (1 on the CPU: no shape caches there)."""
    return PAD_TO_CUDA if device.type == "cuda" else 1


def batch_policy(loaded: LoadedModel, *, token_budget: int, max_jobs: int,
                 max_padding: float = MAX_PADDING) -> BatchPolicy:
    """The batching policy for ``loaded``: its layout and its device's padded-row multiple."""
    return BatchPolicy(loaded.batching, token_budget=token_budget, max_jobs=max_jobs,
                       pad_to=pad_multiple(loaded.device), max_padding=max_padding)
