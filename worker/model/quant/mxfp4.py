"""MXFP4 experts (gpt-oss): weights stay 4-bit on the device, dequantized layer by layer just in time.

A checkpoint stores each expert projection ``P`` (``gate_up_proj``, ``down_proj``) as
``P_blocks`` uint8 ``[E, R, G, 16]`` (two e2m1 codes a byte, low nibble first: 32 values per
block) and ``P_scales`` uint8 ``[E, R, G]`` (e8m0: the block's scale is ``2 ** (s - 127)``).
transformers' experts take ``P`` as ``[E, G * 32, R]`` (the transpose). The experts module keeps
blocks and scales as buffers; a forward pre-hook puts the dequantized ``P`` in place for the
forward and a forward hook drops it, so one layer's experts exist dequantized at a time, and
the forward is transformers' own (its grouped kernel included) on exactly those values.
"""

from __future__ import annotations

import torch
from torch import nn

#: e2m1 values of the 16 codes (sign bit 3).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E8M0_BIAS = 127
BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[E, R, G, 16]`` codes and ``[E, R, G]`` exponents -> ``[E, G * 32, R]`` in ``dtype`` (exact: a code
    times a power of two)."""
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    experts, rows, groups, _ = blocks.shape
    values = torch.stack((lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]), dim=-1)  # [E, R, G, 16, 2]
    values = torch.ldexp(values.view(experts, rows, groups, 32),
                         (scales.to(torch.int32) - E8M0_BIAS).unsqueeze(-1).float())
    return values.view(experts, rows, groups * 32).transpose(1, 2).contiguous().to(dtype)


class QuantizedExperts:
    """Keeps an experts module's projections ``names`` as MXFP4 buffers and dequantizes them around each forward."""

    def __init__(self, module: nn.Module, names: list[str], dtype: torch.dtype):
        self.module, self.names, self.dtype = module, names, dtype
        for name in names:
            module._parameters.pop(name, None)
        module.register_forward_pre_hook(self._dequantize)
        module.register_forward_hook(self._release)

    def _dequantize(self, module: nn.Module, args: tuple) -> None:
        for name in self.names:
            module.__dict__[name] = dequantize_mxfp4(getattr(module, name + BLOCKS_SUFFIX),
                                                     getattr(module, name + SCALES_SUFFIX), self.dtype)

    def _release(self, module: nn.Module, args: tuple, output: object) -> None:
        for name in self.names:
            module.__dict__.pop(name, None)


def keep_experts_quantized(model: nn.Module, keys: set[str], dtype: torch.dtype) -> list[QuantizedExperts]:
    """For every ``<module>.<P>_blocks`` in the checkpoint ``keys``: replace the parameter ``P`` of
    that module by (meta) buffers ``P_blocks`` and ``P_scales`` the loader fills, dequantized per forward."""
    projections: dict[str, list[str]] = {}
    for key in sorted(keys):
        if key.endswith(BLOCKS_SUFFIX):
            owner, _, name = key.removesuffix(BLOCKS_SUFFIX).rpartition(".")
            projections.setdefault(owner, []).append(name)
    out = []
    for owner, names in projections.items():
        module = model.get_submodule(owner)
        for name in names:
            param = module._parameters.get(name)
            if param is None or param.dim() != 3 or param.shape[1] % 32:
                raise ValueError(f"the checkpoint has MXFP4 {owner}.{name}, which the model has no [E, 32 G, R] "
                                 "parameter for")
            experts, columns, rows = param.shape
            module.register_buffer(name + BLOCKS_SUFFIX, torch.empty(experts, rows, columns // 32, 16,
                                                                     dtype=torch.uint8, device="meta"))
            module.register_buffer(name + SCALES_SUFFIX, torch.empty(experts, rows, columns // 32,
                                                                     dtype=torch.uint8, device="meta"))
        out.append(QuantizedExperts(module, names, dtype))
    return out
