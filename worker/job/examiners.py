"""The files of one call examined side by side (``layertap.storage.examine.examine`` on each), as a
re-run's disk answers need: on threads, or, for the files that exist on a local storage, in helper
processes, so the checks' Python (header parsing, identity) runs outside this process's GIL (on an
H100 host's 16 cores, 2.7-3.0x the threads' rate for 2.35 MB files in memory, BENCHMARKS.md).

A helper process is ``python -m layertap.storage.examine`` (torch-free; never a fork of the worker,
its threads or its CUDA context), given the files of a task as a JSON line and answering a JSON
line. The helpers start with the first call that needs them. A helper that dies fails only its
task: those files are examined on threads, and the next task starts a new helper; helpers that
cannot start at all leave every call to threads (logged once). Files not there (a first run's jobs)
never reach a helper: no helper starts until a call finds files to check."""

from __future__ import annotations

import json
import logging
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait

from layertap.storage.base import Storage
from layertap.storage.examine import Existing, OnDisk, examine, verdict_from_json
from layertap.storage.local import LocalStorage

log = logging.getLogger(__name__)

#: Threads that examine the files of one call side by side, shared by all calls: one per core, the
#: calling thread being one of them. Their reads and CRC-32s run outside the GIL.
EXAMINE_THREADS = max(1, (os.cpu_count() or 1) - 1)


def helpers_per_worker(workers: int) -> int:
    """The default helper processes of each of ``workers`` workers on this host: the cores but one,
    shared out (at least one each)."""
    return max(1, EXAMINE_THREADS // workers)


_THREADS = ThreadPoolExecutor(max_workers=EXAMINE_THREADS, thread_name_prefix="layertap-examine")
#: Files one helper process is given at a time (a call's files are spread over the helpers in runs
#: of at most this many, so a few slow files do not hold one helper's whole share).
FILES_PER_TASK = 16
HELPER = [sys.executable, "-m", "layertap.storage.examine"]

Request = tuple[str, str, str]  # (path, spec_hash, content_id)


class HelperGone(RuntimeError):
    """A helper process ended before it answered a task."""


class Examiners:
    """Examines many files at once; thread-safe. ``processes``: helper processes for a local storage
    (0: threads only; None: one per core but one)."""

    def __init__(self, processes: int | None = None):
        self.processes = helpers_per_worker(1) if processes is None else processes
        self._tasks: queue.Queue[tuple[str, Future] | None] = queue.Queue()
        self._feeders: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._unavailable = False

    def examine_many(self, requests: Sequence[Request], storage: Storage) -> list[Future]:
        """``examine`` of each ``(path, spec_hash, content_id)`` in ``storage``; returns when all are
        done. Each future holds its ``Existing``, or what its check raised for it alone."""
        verdicts: list[Future] = [Future() for _ in requests]
        left: list[int] = list(range(len(requests)))
        if isinstance(storage, LocalStorage) and self.processes > 0 and self._started():
            there = [index for index in left if storage.exists(requests[index][0])]
            for index in sorted(set(left) - set(there)):  # a file that appears later is examined again under its lock
                verdicts[index].set_result(Existing(OnDisk.missing))
            left = self._in_helpers([requests[index] for index in there], [verdicts[index] for index in there],
                                    str(storage.root), there) if there else []
        if left:
            _on_threads([requests[index] for index in left], [verdicts[index] for index in left], storage)
        return verdicts

    def close(self) -> None:
        """Stop the helper processes (each ends its task first); call it with no call in flight. A
        later call starts new ones."""
        with self._lock:
            feeders, self._feeders = self._feeders, []
        for _ in feeders:
            self._tasks.put(None)
        for feeder in feeders:
            feeder.join()

    def _started(self) -> bool:
        """Whether helper processes examine files (started now if not yet)."""
        with self._lock:
            if self._unavailable:
                return False
            if not self._feeders:
                self._feeders = [threading.Thread(target=self._feed, name=f"layertap-examine-helper-{index}",
                                                  daemon=True) for index in range(self.processes)]
                for feeder in self._feeders:
                    feeder.start()
            return True

    def _in_helpers(self, requests: Sequence[Request], verdicts: list[Future], root: str,
                    numbers: list[int]) -> list[int]:
        """Examine ``requests`` in the helper processes; of ``numbers`` (the requests' own), those a
        helper did not answer."""
        tasks = []
        for start in range(0, len(requests), FILES_PER_TASK):
            task: Future = Future()
            self._tasks.put((json.dumps({"root": root, "files": list(requests[start:start + FILES_PER_TASK])}), task))
            tasks.append((range(start, min(start + FILES_PER_TASK, len(requests))), task))
        wait([task for _, task in tasks])
        left: list[int] = []
        for indices, task in tasks:
            if task.exception() is not None:
                left.extend(numbers[index] for index in indices)
                continue
            for index, verdict in zip(indices, json.loads(task.result())):
                try:
                    verdicts[index].set_result(verdict_from_json(verdict))
                except Exception as exc:
                    verdicts[index].set_exception(exc)
        if left:
            log.warning("helper processes did not answer for %d files (%s); they were examined on threads",
                        len(left), next(task.exception() for _, task in tasks if task.exception() is not None))
        return left

    def _feed(self) -> None:
        """One helper's thread: hand it tasks in turn, a new helper after one ended; once helpers are
        found unable to run, every task it takes fails at once (its files go to threads)."""
        helper: subprocess.Popen | None = None
        answered = False
        try:
            while (item := self._tasks.get()) is not None:
                payload, task = item
                if self._unavailable:
                    task.set_exception(HelperGone("helper processes cannot run here"))
                    continue
                try:
                    if helper is None:
                        helper = _start_helper()
                    task.set_result(_ask(helper, payload))
                    answered = True
                except Exception as exc:  # never leave a task unanswered: its files go to threads
                    task.set_exception(HelperGone(f"a helper process failed: {type(exc).__name__}: {exc}"))
                    if helper is not None:
                        _stop(helper)
                    helper = None
                    if not answered:  # none of this thread's helpers ever answered: they cannot run here
                        self._give_up(exc)
        finally:
            if helper is not None:
                _stop(helper)

    def _give_up(self, exc: BaseException) -> None:
        with self._lock:
            if self._unavailable:
                return
            self._unavailable = True
        log.warning("helper processes to examine files cannot run here (%s: %s); files are examined on threads",
                    type(exc).__name__, exc)


def _start_helper() -> subprocess.Popen:
    """A helper process importing what this process imports (its ``sys.path``)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path for path in sys.path if path)}
    return subprocess.Popen(HELPER, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True,
                            encoding="utf-8")


def _ask(helper: subprocess.Popen, payload: str) -> str:
    """``payload``'s answer from ``helper``; raises :class:`HelperGone` if it ended."""
    helper.stdin.write(payload + "\n")  # type: ignore[union-attr]
    helper.stdin.flush()  # type: ignore[union-attr]
    answer = helper.stdout.readline()  # type: ignore[union-attr]
    if not answer:
        raise HelperGone(f"exit code {helper.wait()}")
    return answer


def _stop(helper: subprocess.Popen) -> None:
    try:
        helper.stdin.close()  # type: ignore[union-attr]
        helper.wait(timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        helper.kill()
        helper.wait()


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
