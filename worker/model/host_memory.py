"""This process's peak host memory so far: the kernel's own high-water mark of its resident set.

``getrusage(RUSAGE_SELF).ru_maxrss`` counts every byte the process ever had resident, so read
after loading it is the peak while loading (a worker holds little before: read it then too).
"""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass

GIB = 2**30


def peak_rss_bytes() -> int:
    """The process's peak resident set so far (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


@dataclass(frozen=True)
class LoadReport:
    """What loading the model cost: seconds, host memory before and at its peak, and the weights' size."""

    seconds: float
    rss_before_bytes: int  # the peak before loading began
    peak_rss_bytes: int
    weights_bytes: int

    def describe(self) -> str:
        share = self.peak_rss_bytes / self.weights_bytes if self.weights_bytes else 0.0
        return (f"loaded in {self.seconds:.1f}s; host memory peak {self.peak_rss_bytes / GIB:.2f} GiB while loading "
                f"({self.rss_before_bytes / GIB:.2f} GiB before; weights {self.weights_bytes / GIB:.2f} GiB, "
                f"peak/weights {share:.2f})")

    def as_json(self) -> dict[str, float]:
        return {"seconds": round(self.seconds, 2), "rss_before_gib": round(self.rss_before_bytes / GIB, 3),
                "peak_rss_gib": round(self.peak_rss_bytes / GIB, 3), "weights_gib": round(self.weights_bytes / GIB, 3)}
