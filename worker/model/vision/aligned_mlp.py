"""Gated MLPs of a vision tower whose hidden width is not a multiple of 8 (Qwen2.5-VL's 3,420 in
every size), widened with zero channels so its matmuls run on the GPU's fast kernels.

A bf16 row of 3,420 values is not 16-byte aligned, so cuBLAS cannot use the Hopper kernels
that load tiles by TMA and falls back to Ampere's: on an H200 the tower's MLP matmuls ran at
about 230 TFLOP/s, 114 ms of a 611 ms batch of eight 1,000-token images (``vlm_profile.py``).

Invariant: the widened MLP computes the same function. ``down(act(gate(x)) * up(x))`` with
``gate`` and ``up`` given zero rows (bias 0) and ``down`` zero columns: each new channel is
``act(0) * 0 = 0`` (finite for every activation these towers use) and meets a zero weight, so
it adds exact zeros; only the kernels' order of summation, and so the last bits, change, as
with any other choice of kernel. The checkpoint on disk and the weights fingerprint are not
touched.
"""

from __future__ import annotations

import torch
from torch import nn

#: Widths are rounded up to a multiple of this many channels (16-byte aligned in any dtype).
MULTIPLE = 64
GATED = ("gate_proj", "up_proj", "down_proj")
#: Where alignment decides the kernel (cuBLAS's TMA kernels take 16-byte aligned rows).
HALF_DTYPES = (torch.float16, torch.bfloat16)


def _grow(linear: nn.Linear, rows: int, columns: int) -> None:
    weight = linear.weight.data
    grown = weight.new_zeros((weight.shape[0] + rows, weight.shape[1] + columns))
    grown[:weight.shape[0], :weight.shape[1]] = weight
    linear.weight = nn.Parameter(grown, requires_grad=False)
    if linear.bias is not None and rows:
        linear.bias = nn.Parameter(torch.cat([linear.bias.data, linear.bias.data.new_zeros(rows)]),
                                   requires_grad=False)
    linear.out_features, linear.in_features = grown.shape


def align_gated_mlps(blocks: nn.ModuleList | list[nn.Module]) -> int:
    """Widen each block's ``mlp`` (``gate_proj``, ``up_proj``, ``down_proj`` linears) whose hidden
    width is not a multiple of 8 to the next multiple of :data:`MULTIPLE`; returns how many were."""
    widened = 0
    for block in blocks:
        mlp = getattr(block, "mlp", None)
        if not all(isinstance(getattr(mlp, name, None), nn.Linear) for name in GATED):
            continue
        width = mlp.gate_proj.out_features
        if width % 8 == 0 or mlp.up_proj.out_features != width or mlp.down_proj.in_features != width:
            continue
        extra = -(-width // MULTIPLE) * MULTIPLE - width
        _grow(mlp.gate_proj, extra, 0)
        _grow(mlp.up_proj, extra, 0)
        _grow(mlp.down_proj, 0, extra)
        widened += 1
    return widened


def align_tower_mlps(tower: nn.Module | None, device: torch.device, dtype: torch.dtype) -> int:
    """:func:`align_gated_mlps` on the blocks of a grid ``tower``
    (``layertap.worker.model.vision.towers.grid_tower``) on a GPU in bf16 or fp16; 0 elsewhere."""
    if tower is None or device.type != "cuda" or dtype not in HALF_DTYPES:
        return 0
    return align_gated_mlps(getattr(tower, "blocks", []))
