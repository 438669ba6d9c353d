"""Linear layers whose weights stay float8 e4m3 on the device, with one of two compute paths.

* ``dequant``: each forward dequantizes the layer's weight just in time (``weight * scale``
  in float32, then the compute dtype) and runs ``F.linear``; only one layer's dequantized
  weight exists at a time. In float32 this is bit-for-bit plain transformers on the
  dequantized weights.
* ``fp8``: activations are quantized on the fly to e4m3 (per token for channel/tensor
  weight scales, per 1x128 group for 128x128 block scales, as serving engines do) and the
  matmul is ``torch._scaled_mm`` (rowwise scales) or ``torch.nn.functional.scaled_mm``
  (blockwise 1x128 x 128x128, CUDA sm90). Its error against the dequant path is the error
  that e4m3 activations bring.

:func:`choose_compute` picks the path at load time and says why; ``fp8`` is chosen only after a
probe matmul on the device agrees with the dequant path within that error.
"""

from __future__ import annotations

import enum
import logging
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from layertap.worker.model.quant.scheme import QuantScheme

log = logging.getLogger(__name__)
E4M3_MAX = 448.0
#: A probe's relative Frobenius error above this means the fp8 kernel is not doing what the dequant path does.
PROBE_TOLERANCE = 2.0**-4
#: Rows and scale columns the blockwise kernel wants in multiples of (cuBLAS, measured by others on sm90).
BLOCKWISE_ALIGN = 4


class ComputePath(str, enum.Enum):
    """How a :class:`QuantLinear` multiplies (module doc); the ``quant_compute`` setting names one, or ``auto``."""

    dequant = "dequant"
    fp8 = "fp8"


def expand_scale(scale: torch.Tensor, rows: int, columns: int, block: tuple[int, int]) -> torch.Tensor:
    """``[rows, columns]`` float32: each weight element's scale (``scale`` holds one per block)."""
    scale = scale.float().reshape(math.ceil(rows / block[0]), math.ceil(columns / block[1]))
    return scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :columns]


def dequantize_weight(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                      dtype: torch.dtype) -> torch.Tensor:
    """``weight * scale`` computed in float32, returned in ``dtype``."""
    rows, columns = weight.shape
    if rows % block[0] == 0 and columns % block[1] == 0:  # no expanded copy of the scale
        blocks = weight.float().view(rows // block[0], block[0], columns // block[1], block[1])
        scale = scale.float().reshape(rows // block[0], 1, columns // block[1], 1)
        return (blocks * scale).view(rows, columns).to(dtype)
    return (weight.float() * expand_scale(scale, rows, columns, block)).to(dtype)


def quantize_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[M, K]`` -> e4m3 codes ``[M, K]`` and float32 scales ``[M, K // group]`` (max|x| / 448 per group)."""
    rows, columns = x.shape
    grouped = x.float().view(rows, columns // group, group)
    scale = grouped.abs().amax(-1).clamp_min(torch.finfo(torch.float32).tiny) / E4M3_MAX
    codes = (grouped / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return codes.view(rows, columns), scale


#: The activation quantizer the fp8 path calls: :func:`quantize_groups`, or its ``torch.compile``d form
#: (one fused kernel instead of five) once :func:`compile_quantizer` found it working on the device.
_quantizer = quantize_groups


def compile_quantizer(device: torch.device, dtype: torch.dtype) -> None:
    """Use a ``torch.compile``d activation quantizer when it compiles and quantizes within e4m3's
    rounding on ``device`` (each value within ``2**-4 |x| + 2**-10 s`` of its group's scale ``s``; the
    compiled form may round a division differently from eager); otherwise keep the eager one (logged)."""
    global _quantizer
    try:
        compiled = torch.compile(quantize_groups, dynamic=True)
        x = torch.randn(37, 512, device=device, dtype=dtype).float()
        for group in (128, 512):
            codes, scale = compiled(x, group)
            scale = scale.repeat_interleave(group, dim=1)
            if not ((codes.float() * scale - x).abs() <= 2.0**-4 * x.abs() + 2.0**-10 * scale).all():
                raise ValueError("the compiled quantizer's values are off by more than e4m3 rounding")
    except Exception as exc:  # noqa: BLE001 - any compile failure leaves the eager quantizer in place
        log.warning("fp8 activations are quantized eagerly (torch.compile: %s: %s)", type(exc).__name__,
                    str(exc).splitlines()[0] if str(exc) else "")
        return
    _quantizer = compiled


class QuantLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` stored as e4m3 ``weight`` ``[N, K]`` and float32 scales
    (buffer named as in the checkpoint, e.g. ``weight_scale_inv``), so the model's dtype stays
    the compute dtype and the state dict keeps the checkpoint's names."""

    def __init__(self, in_features: int, out_features: int, scheme: QuantScheme, *, bias: bool,
                 device: torch.device | str | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.scheme = scheme
        self.block = scheme.block_of(out_features, in_features)
        self.scale_name = scheme.scale_name
        self.path = ComputePath.dequant
        scale_shape = (math.ceil(out_features / self.block[0]), math.ceil(in_features / self.block[1]))
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn,
                                                   device=device))
        self.register_buffer(self.scale_name, torch.empty(scale_shape, dtype=torch.float32, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, device=device), requires_grad=False) if bias else None

    @property
    def scale(self) -> torch.Tensor:
        return getattr(self, self.scale_name)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"block={self.block}, path={self.path.value}")

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_weight(self.weight, self.scale, self.block, dtype)

    def fp8_kind(self) -> str | None:
        """``rowwise`` or ``blockwise`` where an fp8 matmul computes this layer as served, else None
        (the kernels take sizes in multiples of 16, blockwise ones whole 128x128 blocks)."""
        if self.in_features % 16 or self.out_features % 16:
            return None
        if self.scheme.granularity in ("channel", "tensor"):
            return "rowwise"
        if self.block == (128, 128) and self.in_features % 128 == 0 and self.out_features % 128 == 0:
            return "blockwise"
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.path is ComputePath.fp8:
            return self._fp8_forward(x)
        return F.linear(x, self.dequantized(x.dtype), self.bias)

    def _fp8_forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        rows = flat.shape[0]
        if self.fp8_kind() == "rowwise":
            codes, scale_a = _quantizer(flat, self.in_features)
            out = torch._scaled_mm(codes, self.weight.t(), scale_a, self._rowwise_scale_b, out_dtype=x.dtype)
        else:
            padded = F.pad(flat, (0, 0, 0, -rows % BLOCKWISE_ALIGN))
            codes, scale_a = _quantizer(padded, 128)
            out = F.scaled_mm(codes, self.weight.t(), scale_a.t().contiguous().t(), F.ScalingType.BlockWise1x128,
                              self._blockwise_scale_b, F.ScalingType.BlockWise128x128, output_dtype=x.dtype)[:rows]
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.view(*x.shape[:-1], self.out_features)

    def use_path(self, path: ComputePath) -> None:
        """Switch compute path; ``fp8`` prepares the scale layout its kernel takes (small tensors)."""
        if path is ComputePath.fp8:
            kind = self.fp8_kind()
            if kind is None:
                raise ValueError(f"no fp8 matmul for block {self.block} with {self.in_features} inputs")
            if kind == "rowwise":
                self._rowwise_scale_b = expand_scale(self.scale, self.out_features, 1, (self.block[0], 1)).reshape(
                    1, self.out_features).contiguous()
            else:
                scale = self.scale.float()
                self._blockwise_scale_b = F.pad(scale, (0, -scale.shape[1] % BLOCKWISE_ALIGN)).t()
        self.path = path


@dataclass(frozen=True)
class ComputeChoice:
    """The path :func:`choose_compute` took and why; the loader logs :meth:`describe` and records the path
    (``quant_compute``)."""

    path: ComputePath
    reason: str

    def describe(self) -> str:
        return f"{self.path.value} ({self.reason})"


def _probe(scheme: QuantScheme, device: torch.device, dtype: torch.dtype) -> float:
    """Relative Frobenius error of one fp8 matmul against the dequant path, on ``device`` (raises if the
    kernel does)."""
    generator = torch.Generator(device="cpu").manual_seed(0)
    layer = QuantLinear(512, 256, scheme, bias=False, device=device)
    layer.weight.copy_((torch.randn(256, 512, generator=generator) * 100).clamp(-E4M3_MAX, E4M3_MAX)
                       .to(torch.float8_e4m3fn))
    layer.scale.copy_(torch.rand(layer.scale.shape, generator=generator) * 1e-3 + 1e-4)
    x = torch.randn(37, 512, generator=generator).to(device=device, dtype=dtype)
    reference = layer(x).float()
    layer.use_path(ComputePath.fp8)
    got = layer(x).float()
    return float((got - reference).norm() / reference.norm())


def choose_compute(scheme: QuantScheme, layers: list[QuantLinear], device: torch.device, dtype: torch.dtype,
                   requested: str = "auto") -> ComputeChoice:
    """Pick the compute path (``requested``: auto | dequant | fp8) and switch ``layers`` to it.

    auto takes fp8 on a GPU in bfloat16/float16 when every layer has an fp8 matmul and a probe
    on this device agrees with the dequant path within :data:`PROBE_TOLERANCE`; otherwise dequant,
    with the reason. ``fp8`` asked for skips the device and dtype preferences (the CPU runs rowwise
    ``_scaled_mm``) but not the probe; not possible, it raises ``ValueError``."""
    if requested == ComputePath.dequant.value:
        return ComputeChoice(ComputePath.dequant, "asked for")
    if not layers:  # mxfp4 experts: no fp4 matmul is used
        if requested == ComputePath.fp8.value:
            raise ValueError(f"fp8 compute asked for, but {scheme.describe()} has no fp8 layers")
        return ComputeChoice(ComputePath.dequant, "expert weights dequantized layer by layer just in time")
    blocker = None
    kinds = {layer.fp8_kind() for layer in layers}
    if None in kinds:
        blocker = "some layers have blocks no fp8 kernel takes"
    elif requested == "auto" and device.type != "cuda":
        blocker = f"no fp8 matmul is used on {device.type}"
    elif requested == "auto" and dtype not in (torch.bfloat16, torch.float16):
        blocker = f"compute dtype {str(dtype).removeprefix('torch.')} (fp8 matmuls output bfloat16/float16)"
    else:
        try:
            error = _probe(scheme, device, dtype)
            if not error <= PROBE_TOLERANCE:
                blocker = f"the fp8 kernel's probe differs from the dequant path by {error:.3g} (relative)"
        except (RuntimeError, ValueError, NotImplementedError, AttributeError, TypeError) as exc:
            blocker = f"no fp8 kernel here: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    if blocker is not None:
        if requested == ComputePath.fp8.value:
            raise ValueError(f"fp8 compute asked for but not possible: {blocker}")
        return ComputeChoice(ComputePath.dequant, f"weights dequantized layer by layer just in time: {blocker}")
    for layer in layers:
        layer.use_path(ComputePath.fp8)
    if device.type == "cuda":
        compile_quantizer(device, dtype)
    kind = "torch._scaled_mm rowwise" if kinds == {"rowwise"} else "scaled_mm blockwise 1x128 x 128x128"
    return ComputeChoice(ComputePath.fp8, f"{kind}, e4m3 activations quantized on the fly")
