"""Float8 states: e4m3 (``float8_e4m3fn``, max 448) with one float32 scale per row.

A row is one ``[H]`` vector: one token of one layer. The writer stores
``codes = round_e4m3(x / scale)`` with ``scale = max|x| / 448`` (1 for an all-zero row),
so the value is ``codes * scale``. Rounding to 3 mantissa bits bounds the error of each
element by ``2**-4 * |x| + 2**-10 * scale`` (the second term only for values in e4m3's
subnormal range, below ``2**-6 * scale``).

Decoding works on torch tensors and on numpy arrays of raw codes (numpy has no float8),
so a reader without torch can use it. Imports no torch.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from layertap.protocol.fileformat import SCALE_SUFFIX, STATE_TENSORS

E4M3_MAX = 448.0


def _e4m3_table() -> np.ndarray:
    """float32 value of each of the 256 e4m3fn codes (sign, 4 exponent bits with bias 7,
    3 mantissa bits; exponent 0 is subnormal; S.1111.111 is NaN; no infinities)."""
    codes = np.arange(256, dtype=np.int64)
    exponent = (codes >> 3) & 0xF
    mantissa = (codes & 0x7).astype(np.float64)
    magnitude = np.where(exponent == 0, mantissa / 8 * 2.0**-6, (1 + mantissa / 8) * 2.0 ** (exponent - 7))
    values = np.where(codes & 0x80, -magnitude, magnitude)
    values[(codes & 0x7F) == 0x7F] = np.nan
    return values.astype(np.float32)


_E4M3_VALUES = _e4m3_table()


def dequantize_array(codes: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """float32 values of raw e4m3 ``codes`` (uint8) with per-row ``scale`` (``codes``' shape minus the last dim)."""
    return _E4M3_VALUES[codes] * scale[..., None]


def dequantize(tensors: dict[str, Any]) -> dict[str, Any]:
    """Replace each float8 state tensor that has a ``<name>_scale`` by its float32 values and
    drop the scale. Tensors are torch tensors, or numpy arrays of raw codes."""
    out = dict(tensors)
    for name in STATE_TENSORS:
        scale = out.pop(name + SCALE_SUFFIX, None)
        if scale is None:
            continue
        values = out[name]
        if isinstance(values, np.ndarray):
            out[name] = dequantize_array(values, scale)
        else:
            out[name] = values.float() * scale.unsqueeze(-1)
    return out
