"""FP8 block-scaled experts (Qwen3-MoE-FP8, DeepSeek-V3 style): per-expert e4m3 weights stay on the
device, stacked per projection; each layer's experts are dequantized just in time for its forward.

A checkpoint stores ``<experts>.<e>.{gate,up,down}_proj.weight`` (e4m3 ``[I, H]`` / ``[H, I]``) with
their scales; transformers' fused experts module takes ``gate_up_proj`` ``[E, 2I, H]`` (gate rows
then up rows) and ``down_proj`` ``[E, H, I]``. The module keeps ``{gate,up,down}_weight`` (e4m3,
``[E, rows, columns]``) and ``{gate,up,down}_scale`` buffers; a forward pre-hook puts the dequantized
``gate_up_proj`` and ``down_proj`` in place and a forward hook drops them, so the forward (and its
grouped kernel) is transformers' own on exactly the dequantized values.
"""

from __future__ import annotations

import math
import re

import torch
from torch import nn

from layertap.worker.model.quant.fp8 import dequantize_weight
from layertap.worker.model.quant.scheme import QuantScheme

EXPERT_KEY = re.compile(r"^(?P<module>.+\.experts)\.(?P<index>\d+)\.(?P<proj>gate|up|down)_proj\."
                        r"(?P<tensor>weight|weight_scale_inv|weight_scale)$")
PROJECTIONS = ("gate", "up", "down")


def dequantize_stack(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                     dtype: torch.dtype) -> torch.Tensor:
    """``[E, N, K]`` e4m3 with ``[E, ceil(N/bn), ceil(K/bk)]`` scales -> ``[E, N, K]`` in ``dtype``."""
    experts, rows, columns = weight.shape
    if rows % block[0] == 0:  # the experts' blocks tile one tall matrix
        flat = dequantize_weight(weight.view(experts * rows, columns), scale.reshape(-1, scale.shape[-1]), block, dtype)
        return flat.view(experts, rows, columns)
    return torch.stack([dequantize_weight(weight[e], scale[e], block, dtype) for e in range(experts)])


class Fp8Experts:
    """The e4m3 weights of one fused experts module, filled expert by expert from the checkpoint."""

    def __init__(self, name: str, module: nn.Module, scheme: QuantScheme, device: torch.device, dtype: torch.dtype):
        gate_up, down = module._parameters.get("gate_up_proj"), module._parameters.get("down_proj")
        if (gate_up is None or down is None or getattr(module, "is_transposed", False)
                or not getattr(module, "is_concatenated", True) or not getattr(module, "has_gate", True)):
            raise ValueError(f"{name} ({type(module).__name__}) is not a fused [gate; up] experts module with "
                             "gate_up_proj [E, 2I, H] and down_proj [E, H, I]")
        experts, hidden = gate_up.shape[0], gate_up.shape[2]
        inter = gate_up.shape[1] // 2
        self.name, self.module, self.dtype, self.experts = name, module, dtype, experts
        self.shapes = {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
        self.blocks = {proj: scheme.block_of(*shape) for proj, shape in self.shapes.items()}
        self.filled: set[tuple[int, str, str]] = set()
        for param in ("gate_up_proj", "down_proj"):
            module._parameters.pop(param)
        for proj, (rows, columns) in self.shapes.items():
            block = self.blocks[proj]
            module.register_buffer(f"{proj}_weight", torch.empty(experts, rows, columns, dtype=torch.float8_e4m3fn,
                                                                 device=device))
            module.register_buffer(f"{proj}_scale", torch.empty(experts, math.ceil(rows / block[0]),
                                                                math.ceil(columns / block[1]), device=device))
        module.register_forward_pre_hook(self._dequantize)
        module.register_forward_hook(self._release)

    def place(self, index: int, proj: str, tensor_kind: str, tensor: torch.Tensor) -> None:
        target = getattr(self.module, f"{proj}_weight" if tensor_kind == "weight" else f"{proj}_scale")
        if index >= self.experts or tuple(tensor.shape) != tuple(target.shape[1:]):
            raise ValueError(f"{self.name}.{index}.{proj}_proj.{tensor_kind}: shape {tuple(tensor.shape)} does not fit "
                             f"{self.experts} experts of {tuple(target.shape[1:])}")
        target[index].copy_(tensor)
        self.filled.add((index, proj, "weight" if tensor_kind == "weight" else "scale"))

    def missing(self) -> int:
        return self.experts * len(PROJECTIONS) * 2 - len(self.filled)

    def _stack(self, proj: str) -> torch.Tensor:
        return dequantize_stack(getattr(self.module, f"{proj}_weight"), getattr(self.module, f"{proj}_scale"),
                                self.blocks[proj], self.dtype)

    def _dequantize(self, module: nn.Module, args: tuple) -> None:
        module.__dict__["gate_up_proj"] = torch.cat((self._stack("gate"), self._stack("up")), dim=1)
        module.__dict__["down_proj"] = self._stack("down")

    def _release(self, module: nn.Module, args: tuple, output: object) -> None:
        module.__dict__.pop("gate_up_proj", None)
        module.__dict__.pop("down_proj", None)


def fp8_experts(model: nn.Module, keys: set[str], scheme: QuantScheme, device: torch.device,
                dtype: torch.dtype) -> dict[str, Fp8Experts]:
    """Experts module name -> :class:`Fp8Experts`, for every experts module the checkpoint quantizes."""
    names = {match["module"] for key in keys if (match := EXPERT_KEY.match(key)) and match["tensor"] != "weight"}
    out = {}
    for name in sorted(names):
        try:
            module = model.get_submodule(name)
        except AttributeError:
            raise ValueError(f"the checkpoint has quantized experts {name} that the model has no module for "
                             "(renamed experts are not served quantized)") from None
        out[name] = Fp8Experts(name, module, scheme, device, dtype)
    return out
