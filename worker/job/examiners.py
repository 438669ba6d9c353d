"""The files of one call examined side by side (``layertap.storage.examine.examine`` on each), as a
re-run's disk answers need: on threads, or, for a local storage and ``processes`` > 0, in that many
helper processes, so the checks' Python (header parsing, identity) runs outside this process's GIL.

The helper processes start lazily, from a ``forkserver`` that imports only the torch-free
``layertap.storage.examine`` (never a fork of the worker, its threads or its CUDA context); they get
and give JSON. If one dies, the call's files still missing a verdict are examined on threads and
the next call starts a new set."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool

from layertap.storage.base import Storage
from layertap.storage.examine import examine, examine_local_json, verdict_from_json
from layertap.storage.local import LocalStorage

log = logging.getLogger(__name__)

#: Threads that examine the files of one call side by side, shared by all calls: one per core, the
#: calling thread being one of them. Their reads and CRC-32s run outside the GIL.
EXAMINE_THREADS = max(1, (os.cpu_count() or 1) - 1)
_THREADS = ThreadPoolExecutor(max_workers=EXAMINE_THREADS, thread_name_prefix="layertap-examine")
#: Files one helper process is given at a time (a call's files are spread over the processes in
#: runs of at most this many, so a few slow files do not hold one process's whole share).
FILES_PER_TASK = 16

Request = tuple[str, str, str]  # (path, spec_hash, content_id)


class Examiners:
    """Examines many files at once; thread-safe. ``processes``: helper processes for a local storage
    (0: threads only)."""

    def __init__(self, processes: int = 0):
        self.processes = processes
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()

    def examine_many(self, requests: Sequence[Request], storage: Storage) -> list[Future]:
        """``examine`` of each ``(path, spec_hash, content_id)`` in ``storage``; returns when all are
        done. Each future holds its ``Existing``, or what its check raised for it alone."""
        verdicts: list[Future] = [Future() for _ in requests]
        left = range(len(requests))
        if self.processes > 0 and isinstance(storage, LocalStorage) and requests:
            left = self._in_processes(requests, verdicts, str(storage.root))
        if left:
            _on_threads([requests[index] for index in left], [verdicts[index] for index in left], storage)
        return verdicts

    def close(self) -> None:
        """Stop the helper processes (a later call starts new ones)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    def _in_processes(self, requests: Sequence[Request], verdicts: list[Future], root: str) -> list[int]:
        """Examine ``requests`` in the helper processes; the indices of those left without a verdict
        (the pool broke)."""
        pool = self._started()
        starts = range(0, len(requests), FILES_PER_TASK)
        tasks = {}
        try:
            for start in starts:
                payload = json.dumps({"root": root, "files": list(requests[start:start + FILES_PER_TASK])})
                tasks[start] = pool.submit(examine_local_json, payload)
        except BrokenProcessPool:
            pass
        wait(tasks.values())
        left: list[int] = []
        for start in starts:
            indices = range(start, min(start + FILES_PER_TASK, len(requests)))
            task = tasks.get(start)
            if task is None or isinstance(task.exception(), BrokenProcessPool):
                left.extend(indices)
                continue
            for index, verdict in zip(indices, json.loads(task.result())):
                try:
                    verdicts[index].set_result(verdict_from_json(verdict))
                except Exception as exc:
                    verdicts[index].set_exception(exc)
        if left:
            log.warning("a helper process examining files stopped; %d files examined on threads instead", len(left))
            self._discard(pool)
        return left

    def _started(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                context = multiprocessing.get_context("forkserver")
                context.set_forkserver_preload(["layertap.storage.examine"])
                self._pool = ProcessPoolExecutor(max_workers=self.processes, mp_context=context)
            return self._pool

    def _discard(self, pool: ProcessPoolExecutor) -> None:
        with self._lock:
            if self._pool is pool:
                self._pool = None
        pool.shutdown(wait=False, cancel_futures=True)


def _on_threads(requests: Sequence[Request], verdicts: list[Future], storage: Storage) -> None:
    """Examine ``requests`` in runs of consecutive ones side by side on the examiner threads and this one."""
    runs = max(1, min(len(requests), EXAMINE_THREADS + 1))
    bounds = [len(requests) * run // runs for run in range(runs + 1)]
    spread = [_THREADS.submit(_examine_run, requests, verdicts, storage, start, end)
              for start, end in zip(bounds[1:-1], bounds[2:])]
    _examine_run(requests, verdicts, storage, bounds[0], bounds[1])
    wait(spread)


def _examine_run(requests: Sequence[Request], verdicts: list[Future], storage: Storage, start: int, end: int) -> None:
    for index in range(start, end):
        try:
            verdicts[index].set_result(examine(*requests[index], storage))
        except Exception as exc:  # a fault of this file's check alone: its job's error
            verdicts[index].set_exception(exc)
