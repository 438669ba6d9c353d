"""Where and in which dtype a model runs: the device and compute dtype its settings name, and the
torch dtype of each protocol dtype name (the worker's one table)."""

from __future__ import annotations

from typing import Any

import torch

from layertap.protocol.dtypes import AUTO, COMPUTE_DTYPES, normalize_dtype

#: The torch dtype of each protocol dtype name (``layertap.protocol.dtypes``).
TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
                "float8": torch.float8_e4m3fn}


def resolve_device(spec: str) -> torch.device:
    """``auto`` -> ``cuda`` when available, else ``cpu``."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {spec!r} asked for but CUDA is not available on this machine")
    return device


def resolve_dtype(spec: str, device: torch.device, config: Any | None = None) -> torch.dtype:
    """``auto`` -> float32 on the CPU; on a GPU the checkpoint's half dtype, else bfloat16."""
    if spec != AUTO:
        name = normalize_dtype(spec)
        if name not in COMPUTE_DTYPES:
            raise ValueError(f"dtype {spec!r} is not one of {sorted(COMPUTE_DTYPES)} or auto")
        return TORCH_DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    stored = getattr(config, "dtype", None)
    return stored if stored in (torch.bfloat16, torch.float16) else torch.bfloat16
