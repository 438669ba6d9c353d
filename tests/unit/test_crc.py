"""File checksums are zlib's CRC-32 whichever library computes them (``layertap.protocol.crc``):
whole, continued over blocks, on bytes, memoryviews and numpy arrays."""

from __future__ import annotations

import random
import zlib

import numpy as np

from layertap.protocol.crc import crc32_of
from layertap.protocol.fileformat import crc32_hex


def test_the_crc_is_zlibs_on_every_buffer_and_block_split():
    rng = random.Random(46)
    for size in (0, 1, 7, 4096, 5 * 1024 + 1, 3 << 20):
        data = rng.randbytes(size)
        assert crc32_of(data) == zlib.crc32(data)
        assert crc32_hex(np.frombuffer(data, dtype=np.uint8)) == f"{zlib.crc32(data):08x}"
        view, crc, at = memoryview(data), 0, 0
        while at < size:
            step = rng.randrange(1, 1 << 20)
            crc = crc32_of(view[at:at + step], crc)
            at += step
        assert crc == zlib.crc32(data)
