"""A rate over a sliding time window, from samples of an ever-growing total (tokens, jobs).

Invariant: the window keeps every sample of the last ``window_s`` seconds plus the one
just before them, so :meth:`RateWindow.rate` always spans at least ``window_s`` once that
much history exists, and drops to 0 when the total stops moving for ``window_s``.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Iterable

from layertap.protocol.schema import Result


class RateWindow:
    """Thread-safe. ``add(total)`` records a sample; ``rate()`` is units per second over the window."""

    def __init__(self, window_s: float = 30.0):
        if window_s <= 0:
            raise ValueError("window_s must be positive")
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque()
        self._lock = threading.Lock()

    def add(self, total: float, now: float | None = None) -> None:
        """Record that the total was ``total`` at ``now`` (default: ``time.monotonic()``)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            self._samples.append((now, total))
            start = now - self.window_s
            while len(self._samples) > 2 and self._samples[1][0] <= start:
                self._samples.popleft()

    def rate(self) -> float:
        """Growth per second between the oldest and newest kept samples (0 with fewer than two)."""
        with self._lock:
            if len(self._samples) < 2:
                return 0.0
            (t0, v0), (t1, v1) = self._samples[0], self._samples[-1]
        return (v1 - v0) / (t1 - t0) if t1 > t0 else 0.0


def overall_tokens_per_s(results: Iterable[Result]) -> float:
    """A finished run's rate: the tokens of its ok results over the time from the earliest start
    (``finished_at`` less the compute and write times) to the last finish; 0 without ok results."""
    tokens, first, last = 0, math.inf, -math.inf
    for result in results:
        if result.ok and not result.cached:
            tokens += result.num_tokens or 0
            first = min(first, result.finished_at - (result.timings.compute or 0.0) - (result.timings.write or 0.0))
            last = max(last, result.finished_at)
    return tokens / (last - first) if last > first else 0.0
