"""Exponential backoff, the one helper for waiting and trying again: Redis calls on both
sides (``redis_conn.retrying``, the worker's publisher), task retries and worker restarts."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Backoff:
    """Delays ``first_s``, ``2 * first_s``, ``4 * first_s``, ... capped at ``max_s``."""

    first_s: float
    max_s: float

    def delay(self, retry: int) -> float:
        """Seconds to wait before retry number ``retry`` (0 for the first)."""
        return min(self.max_s, self.first_s * 2 ** min(retry, 64))


def retry_while(action: Callable[[], T], retryable: Callable[[Exception], bool], *, give_up_s: float,
                backoff: Backoff, on_retry: Callable[[Exception, float], None] | None = None) -> T:
    """``action()``, tried again after each delay of ``backoff`` while it raises an error that
    ``retryable`` accepts; any other error, and a retryable one after ``give_up_s`` seconds,
    is raised. ``on_retry(error, delay)`` is called before each wait."""
    deadline = time.monotonic() + give_up_s
    for retry in itertools.count():
        try:
            return action()
        except Exception as exc:
            if not retryable(exc) or time.monotonic() > deadline:
                raise
            delay = backoff.delay(retry)
            if on_retry is not None:
                on_retry(exc, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")  # itertools.count() never ends
