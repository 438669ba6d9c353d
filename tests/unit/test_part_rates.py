"""A bench part's rates come from its counts in one place, whichever benchmark measured it (``vlm.py``'s
queue parts once reported 0 GB/s for 21.5 GB written)."""

from __future__ import annotations

from layertap.worker.bench.config import PartResult


def test_rates_follow_the_counts():
    part = PartResult("d: queue end to end", seconds=4.0, tokens=1000, jobs=3, bytes_written=8_000_000_000)
    part.fill_rates()
    assert (part.tokens_per_s, part.gb_per_s, part.mfu) == (250.0, 2.0, None)
    part.fill_rates(flops=2e12, matmul_rate=1e12)
    assert part.mfu == 0.5
    part.fill_rates(flops=2e12, matmul_rate=0.0)  # no measured rate: no MFU
    assert part.mfu is None
