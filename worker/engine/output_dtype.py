"""A job's output dtype: casting captured states on the device, before the copy to the host.

``float8`` is e4m3 (``torch.float8_e4m3fn``) with one float32 scale per row (each ``[H]``
vector of each token and layer), laid out as ``layertap.protocol.fp8`` decodes it:
``scale = max|row| / 448`` (1 for an all-zero row), ``codes = e4m3(row / scale)``.
"""

from __future__ import annotations

import torch

from layertap.protocol.dtypes import AUTO, RECORDED_NAMES
from layertap.protocol.fp8 import E4M3_MAX
from layertap.worker.model.devices import TORCH_DTYPES

FLOAT8 = TORCH_DTYPES["float8"]


def recorded_name(dtype: torch.dtype) -> str:
    """The name a header and a result give ``dtype`` (``layertap.protocol.dtypes.RECORDED_NAMES``)."""
    name = next(name for name, value in TORCH_DTYPES.items() if value == dtype)
    return RECORDED_NAMES[name]


def resolve_output_dtype(name: str, compute_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype a job's ``dtype`` field names; ``auto`` is the model's compute dtype."""
    return compute_dtype if name == AUTO else TORCH_DTYPES[name]


def quantize_rows(states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scale)``: float8 codes of ``[T, H]`` or ``[T, U, H]`` states and one float32
    scale per row. 3-D states go one layer slot at a time (the float32 temporary is ``[T, H]``)."""
    codes = torch.empty(states.shape, dtype=FLOAT8, device=states.device)
    scale = torch.empty(states.shape[:-1], dtype=torch.float32, device=states.device)
    slices = [(states, codes, scale)] if states.dim() == 2 else zip(states.unbind(1), codes.unbind(1), scale.unbind(1))
    for source, target, target_scale in slices:
        wide = source.float()
        amax = wide.abs().amax(dim=-1)
        target_scale.copy_(torch.where(amax > 0, amax / E4M3_MAX, 1.0))
        target.copy_((wide / target_scale.unsqueeze(-1)).clamp_(-E4M3_MAX, E4M3_MAX))
    return codes, scale


def to_output(states: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(states in dtype, per-row scale or None)``; float8 is quantized per row."""
    if dtype == FLOAT8:
        return quantize_rows(states)
    return states.to(dtype), None


def non_finite_rows(source: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    """bool over all but the last dim (``[T, U]`` for states ``[T, U, H]``, ``[T]`` for ``[T, H]``):
    a row with NaN/Inf in any value, as captured or after the cast (float16 overflows)."""
    checked = source if output.dtype == FLOAT8 else output
    return ~torch.isfinite(checked).all(dim=-1)
