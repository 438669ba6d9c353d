"""A worker that stops making progress exits, so its jobs go to healthy workers.

A forward that never returns (a CUDA kernel, a deadlock) leaves the lease thread renewing
the held jobs forever, and a warm shutdown waiting on them forever. Two guards, both
reading the engine from outside (its batch count and ``Engine.thread_alive()``):

* :class:`EngineWatchdog` checks every ``interval`` seconds: when jobs wait on the engine
  (``JobProcessor.awaiting_engine()``) and no batch has finished for ``bound_s`` seconds
  (counted from when the wait began, so an idle engine is never suspected), or when the
  engine thread has died without a device fault, it calls ``on_stall(reason)``;
* :func:`start_deadline` calls ``on_stall(reason)`` once ``seconds`` have passed (a warm
  shutdown that did not end).

The worker's ``on_stall`` stops renewing leases, deregisters and exits non-zero without
waiting on the engine: the held messages are back in the queue within ``orphan_timeout``
plus kombu's restore interval, and the supervisor restarts the process.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from layertap.worker.engine.engine import Engine

log = logging.getLogger(__name__)


class EngineWatchdog:
    """Daemon thread; see the module docstring. ``stop()`` before stopping the engine."""

    def __init__(self, engine: Engine, awaiting: Callable[[], int], bound_s: float,
                 on_stall: Callable[[str], None], interval: float = 1.0):
        self.engine = engine
        self.awaiting = awaiting
        self.bound_s = bound_s
        self.on_stall = on_stall
        self.interval = min(interval, bound_s / 4)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="layertap-watchdog", daemon=True)

    def start(self) -> EngineWatchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(5)

    def check(self, batches: int, since: float, now: float) -> str | None:
        """Why the engine counts as hung now, or None (``since``: the last progress or idle moment)."""
        if not self.engine.thread_alive() and self.engine.fatal is None:
            return "the engine thread died"
        if now - since > self.bound_s:
            return (f"{self.awaiting()} job(s) waited {now - since:.0f}s on the engine with no batch finished "
                    f"(bound {self.bound_s:.0f}s, LAYERTAP_WORKER__HANG_TIMEOUT); {batches} batches so far")
        return None

    def _run(self) -> None:
        last_batches, since = -1, time.monotonic()
        while not self._stop.wait(self.interval):
            batches, now = self.engine.stats.batches, time.monotonic()
            if batches != last_batches or self.awaiting() == 0:
                last_batches, since = batches, now
            reason = self.check(batches, since, now)
            if reason is not None and not self._stop.is_set():
                self.on_stall(reason)
                return


def start_deadline(seconds: float, reason: str, on_stall: Callable[[str], None]) -> threading.Timer:
    """Call ``on_stall(reason)`` after ``seconds`` (a daemon timer; ``cancel()`` it when done)."""
    timer = threading.Timer(seconds, on_stall, (reason,))
    timer.daemon = True
    timer.start()
    return timer
