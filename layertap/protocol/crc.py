"""The CRC-32 of files' checksums (zlib's polynomial, ``fileformat.crc32_hex``): from ISA-L's
``isal`` when it is installed (the ``worker`` extra installs it; about 3x zlib's rate, the same
values), else from zlib. Both release the GIL on large buffers, so threads check files side by side."""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

try:
    from isal.isal_zlib import crc32 as _isal_crc32
except ImportError:  # optional: zlib gives the same values, slower
    _isal_crc32 = None

#: ``crc32(data, value=0)``: the running CRC-32 of a bytes-like object.
crc32: Callable[..., int] = _isal_crc32 if _isal_crc32 is not None else zlib.crc32
#: Which library computes it ("isal" or "zlib"), for reports.
CRC_LIBRARY = "isal" if _isal_crc32 is not None else "zlib"


def crc32_of(data: Any, value: int = 0) -> int:
    """The CRC-32 of ``data`` continuing from ``value``, as zlib computes it."""
    return crc32(data, value) & 0xFFFFFFFF
