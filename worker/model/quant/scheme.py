"""The quantization a checkpoint declares in its ``config.json`` (``quantization_config``).

Served (weights stay e4m3 on the device, one float32 scale per block, channel or tensor):

* ``quant_method: fp8`` with ``weight_block_size`` (Qwen3-*-FP8, DeepSeek-V3): tensors
  ``<linear>.weight`` float8_e4m3fn and ``<linear>.weight_scale_inv`` float32
  ``[ceil(N/bn), ceil(K/bk)]``; the value is ``weight * scale`` (the name says "inverse" of
  the quantizer's scale: it multiplies).
* ``quant_method: compressed-tensors`` (llm-compressor, ``format: float-quantized``) with 8-bit
  float weights of strategy ``channel`` (scale ``[N, 1]``), ``block`` (``block_structure``)
  or ``tensor`` (one scale): tensors ``<linear>.weight`` and ``<linear>.weight_scale``.

* ``quant_method: mxfp4`` (gpt-oss): expert projections as ``<P>_blocks`` (e2m1, two a byte) and
  ``<P>_scales`` (e8m0, one per 32 values); attention, router and embeddings unquantized.

Anything else that declares a quantization is refused with the reason, never run wrong.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

FP8_METHOD = "fp8"
COMPRESSED_TENSORS_METHOD = "compressed-tensors"
MXFP4_METHOD = "mxfp4"
GRANULARITIES = ("block", "channel", "tensor")
SCALES_NAME = "scales"  # mxfp4: ``<P>_scales`` beside ``<P>_blocks``


class UnsupportedQuantization(ValueError):
    """A checkpoint whose quantization layertap cannot serve; the message says which and why."""


@dataclass(frozen=True)
class QuantScheme:
    """How a checkpoint's quantized Linear weights are stored.

    ``block`` is the scale's block ``(rows, columns)`` of the ``[N, K]`` weight for
    ``granularity == "block"``; channel and tensor scales cover a whole row or the whole weight.
    ``ignore`` lists module names or ``re:`` patterns kept unquantized (they are stored unquantized
    in the checkpoint too, so the loader goes by the scales present, and this is only recorded).
    """

    method: str
    granularity: str
    scale_name: str  # the tensor beside ``weight`` that holds its scales
    block: tuple[int, int] | None = None
    dynamic_activations: bool = True

    def block_of(self, rows: int, columns: int) -> tuple[int, int]:
        """The ``(rows, columns)`` one scale covers in a ``[rows, columns]`` weight."""
        if self.granularity == "block":
            assert self.block is not None
            return self.block
        if self.granularity == "channel":
            return 1, columns
        return rows, columns

    @property
    def weights(self) -> str:
        """The stored weights' number format."""
        return "mxfp4_e2m1" if self.method == MXFP4_METHOD else "float8_e4m3fn"

    def describe(self) -> str:
        """One line for logs and file headers, e.g. ``fp8 e4m3 weights, 128x128 blocks (quant_method fp8)``."""
        if self.method == MXFP4_METHOD:
            return f"mxfp4 e2m1 expert weights, e8m0 scales per 32 values (quant_method {self.method})"
        if self.granularity == "block":
            assert self.block is not None
            what = f"{self.block[0]}x{self.block[1]} blocks"
        else:
            what = f"per {self.granularity}"
        return f"fp8 e4m3 weights, {what} (quant_method {self.method})"


def _as_dict(config: Any) -> dict[str, Any]:
    quant = getattr(config, "quantization_config", None)
    if quant is None:
        return {}
    return quant if isinstance(quant, dict) else quant.to_dict()


def _fp8_scheme(quant: dict[str, Any]) -> QuantScheme:
    fmt = quant.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise UnsupportedQuantization(f"quant_method fp8 with fmt {fmt!r}: only e4m3 weights are served")
    block = quant.get("weight_block_size")
    if block is None:
        return QuantScheme(FP8_METHOD, "tensor", "weight_scale_inv",
                           dynamic_activations=quant.get("activation_scheme", "dynamic") == "dynamic")
    if len(block) != 2 or min(block) < 1:
        raise UnsupportedQuantization(f"quant_method fp8: weight_block_size {block!r} is not two positive sizes")
    return QuantScheme(FP8_METHOD, "block", "weight_scale_inv", (int(block[0]), int(block[1])),
                       dynamic_activations=quant.get("activation_scheme", "dynamic") == "dynamic")


def _compressed_tensors_scheme(quant: dict[str, Any]) -> QuantScheme:
    fmt = quant.get("format")
    groups = list((quant.get("config_groups") or {}).values())
    if fmt not in ("float-quantized", "naive-quantized") or len(groups) != 1:
        raise UnsupportedQuantization(f"compressed-tensors format {fmt!r} with {len(groups)} config groups: only "
                                      "one group of float-quantized 8-bit float weights is served")
    weights = groups[0].get("weights") or {}
    if weights.get("type") != "float" or weights.get("num_bits") != 8:
        raise UnsupportedQuantization(f"compressed-tensors weights {weights.get('type')}/{weights.get('num_bits')} "
                                      "bits: only 8-bit float (fp8 e4m3) weights are served")
    strategy = weights.get("strategy")
    if strategy not in GRANULARITIES:
        raise UnsupportedQuantization(f"compressed-tensors weight strategy {strategy!r}: served are "
                                      f"{', '.join(GRANULARITIES)}")
    activations = groups[0].get("input_activations") or {}
    dynamic = bool(activations.get("dynamic", True)) if activations else True
    block = None
    if strategy == "block":
        structure = weights.get("block_structure")
        if not structure or len(structure) != 2:
            raise UnsupportedQuantization("compressed-tensors block strategy without a block_structure "
                                          f"({structure!r})")
        block = (int(structure[0]), int(structure[1]))
    return QuantScheme(COMPRESSED_TENSORS_METHOD, strategy, "weight_scale", block, dynamic_activations=dynamic)


def scheme_of(config: Any) -> QuantScheme | None:
    """The checkpoint's scheme, None for an unquantized checkpoint. Raises
    :class:`UnsupportedQuantization` for a quantization that is declared but not served."""
    quant = _as_dict(config)
    if not quant:
        return None
    method = quant.get("quant_method")
    if method == FP8_METHOD:
        return _fp8_scheme(quant)
    if method == COMPRESSED_TENSORS_METHOD:
        return _compressed_tensors_scheme(quant)
    if method == MXFP4_METHOD:
        return QuantScheme(MXFP4_METHOD, "block", SCALES_NAME, (1, 32), dynamic_activations=True)
    raise UnsupportedQuantization(f"quant_method {method!r} is not served (served: {FP8_METHOD}, "
                                  f"{COMPRESSED_TENSORS_METHOD} fp8, {MXFP4_METHOD})")
