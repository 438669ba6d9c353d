"""Waiting for jobs' results inside an asyncio server: one thread follows the run's results stream
and hands each result to the request waiting for its job.

Invariants: the stream is read from its last entry when the waiter starts (what came before is
no request's of this front), so a request that registers its job (:meth:`ResultWaiter.expect`)
before sending it cannot miss its result; the first result of a job is its final one (a worker
publishes exactly one per job), later ones (a job run twice) are dropped; a Redis that restarts
is waited for, not given up on.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import redis

from layertap.producer.client.results import read_after
from layertap.protocol.schema import Result
from layertap.transport.ledger import Ledger

log = logging.getLogger(__name__)

#: Milliseconds one stream read blocks for new entries (the thread checks for a stop between reads).
BLOCK_MS = 500


class ResultWaiter:
    """Follows ``run``'s results on a thread; requests await their job's result on ``loop``."""

    def __init__(self, connection: redis.Redis, run: str, loop: asyncio.AbstractEventLoop):
        self.connection = connection  # decodes responses
        self.run = run
        self.loop = loop
        self._waiting: dict[str, asyncio.Future[Result]] = {}  # touched on the loop's thread only
        self._stop = threading.Event()
        self._after = Ledger(connection, give_up_s=0).last_entry_id(run) or "0"
        self._thread = threading.Thread(target=self._follow, name=f"serve-results-{run}", daemon=True)

    def start(self) -> ResultWaiter:
        self._thread.start()
        return self

    def expect(self, job_id: str) -> asyncio.Future[Result]:
        """The future of ``job_id``'s result; call before sending the job, on the loop's thread."""
        future = self._waiting[job_id] = self.loop.create_future()
        return future

    def forget(self, job_id: str) -> None:
        """Stop waiting for ``job_id`` (answered, timed out or abandoned)."""
        self._waiting.pop(job_id, None)

    def _deliver(self, result: Result) -> None:
        future = self._waiting.pop(result.job_id, None)
        if future is not None and not future.done():
            future.set_result(result)

    def _follow(self) -> None:
        while not self._stop.is_set():
            try:
                entries = read_after(self.connection, self.run, self._after, block_ms=BLOCK_MS)
            except redis.exceptions.ConnectionError as exc:
                log.warning("reading run %s's results: %s; trying again", self.run, exc)
                time.sleep(0.5)
                continue
            for entry_id, result in entries:
                self._after = entry_id
                self.loop.call_soon_threadsafe(self._deliver, result)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * BLOCK_MS / 1000 + 5)
