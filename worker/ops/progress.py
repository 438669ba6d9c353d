"""The worker's periodic progress line, as vLLM's engine logs one: every
``worker.progress_interval_s`` seconds, while anything happened or waits, one INFO line with
tokens/s and jobs/s since the last line, the model queue's depth, jobs in the engine, and the
process's host and device memory. Nothing is logged while the worker is idle.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import redis
import torch

from layertap.protocol import keys
from layertap.worker.engine.engine import Engine
from layertap.worker.queue.periodic import Periodic

log = logging.getLogger("layertap.worker")

GIB = 1024 ** 3


def host_rss_bytes() -> int:
    """This process's resident memory now (Linux ``/proc``; 0 where that is missing)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class ProgressLine:
    """Logs :meth:`line` every ``interval`` seconds from its own thread (0: off)."""

    def __init__(self, engine: Engine, client: redis.Redis, model: str, interval: float,
                 clock: Callable[[], float] = time.monotonic):
        self.engine = engine
        self.redis = client
        self.queue = keys.model_queue(model)
        self.interval = interval
        self.clock = clock
        self._last = (clock(), engine.stats.tokens, engine.stats.jobs)
        self._ticker = Periodic("progress line", interval, self.tick)

    def start(self) -> ProgressLine:
        if self.interval > 0:
            self._ticker.start()
        return self

    def stop(self) -> None:
        self._ticker.stop()

    def tick(self) -> None:
        text = self.line()
        if text is not None:
            log.info("%s", text)

    def line(self) -> str | None:
        """The line since the last call, or None when nothing ran and nothing waits."""
        now, tokens, jobs = self.clock(), self.engine.stats.tokens, self.engine.stats.jobs
        then, tokens_then, jobs_then = self._last
        self._last = (now, tokens, jobs)
        waiting = int(self.redis.llen(self.queue))
        in_engine = self.engine.pending()
        if tokens == tokens_then and not waiting and not in_engine:
            return None
        seconds = max(now - then, 1e-9)
        memory = f"host {host_rss_bytes() / GIB:.1f} GiB"
        device = self.engine.loaded.device
        if device.type == "cuda":
            total = torch.cuda.get_device_properties(device).total_memory
            memory += f", device {torch.cuda.memory_reserved(device) / GIB:.1f}/{total / GIB:.0f} GiB"
        return (f"progress: {(tokens - tokens_then) / seconds:,.0f} tokens/s, {(jobs - jobs_then) / seconds:,.1f} "
                f"jobs/s; queue {waiting} waiting, {in_engine} in the engine; {memory}; "
                f"{jobs} jobs, {tokens:,} tokens so far")
