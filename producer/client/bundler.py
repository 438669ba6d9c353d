"""Grouping jobs into bundles: several jobs of one model and run in one message.

A bundle is sent when the next job finds it full (``max_jobs`` jobs, or ``max_tokens``
estimated tokens: ``Job.estimated_tokens``; a full bundle of one job at once) or would take it
past ``max_tokens``, when its oldest job has waited ``max_wait_s`` (a background thread), on
:meth:`Bundler.flush` and on :meth:`Bundler.close`. A bundle of one job is sent as a plain job message. Each job keeps
its own id, file, result and attempt count; the worker runs a bundle's jobs together and
acknowledges the message once all have a final result (``layertap.worker.queue.handler``).

Rows of one conversation sent turn by turn stay together: where the next job extends the
bundle's last ones (``Job.extends``: a conversation's next per-turn row), those trailing rows
are kept back and start the next bundle with it, unless they are the whole bundle or would not
fit with it. So a conversation's rows reach one worker, which computes their shared prefix once.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import redis
from kombu.exceptions import OperationalError

from layertap.protocol.schema import Job
from layertap.settings import BundleSettings

if TYPE_CHECKING:
    from layertap.producer.client.client import Client

log = logging.getLogger(__name__)


@dataclass
class _Group:
    """Jobs of one model and run waiting to be sent together."""

    started: float
    jobs: list[tuple[Job, dict[str, Any]]] = field(default_factory=list)
    ids: set[str] = field(default_factory=set)
    tokens: int = 0
    sizes: list[int] = field(default_factory=list)  # each job's estimated tokens, in order
    reopen: dict[str, str] = field(default_factory=dict)  # job id -> group, of jobs sent again (Client.send)

    def add(self, job: Job, payload: dict[str, Any], tokens: int, reopen_group: str | None = None) -> None:
        """Take ``job``, whose estimated tokens are ``tokens`` (sent again for ``reopen_group``, if given)."""
        self.jobs.append((job, payload))
        self.ids.add(job.job_id or "")
        self.tokens += tokens
        self.sizes.append(tokens)
        if reopen_group is not None:
            self.reopen[job.job_id or ""] = reopen_group

    def split(self, keep: int, now: float) -> tuple[_Group, _Group]:
        """Its jobs but the last ``keep`` (started when it did), and those last ones (started ``now``)."""
        head, tail = _Group(self.started), _Group(now)
        for index, ((job, payload), size) in enumerate(zip(self.jobs, self.sizes)):
            (head if index < len(self.jobs) - keep else tail).add(job, payload, size,
                                                                   self.reopen.get(job.job_id or ""))
        return head, tail

    def joined(self, later: _Group) -> _Group:
        """Its jobs, then ``later``'s, as one group started when it did (a split undone)."""
        whole = _Group(self.started)
        for group in (self, later):
            for (job, payload), size in zip(group.jobs, group.sizes):
                whole.add(job, payload, size, group.reopen.get(job.job_id or ""))
        return whole


class Bundler:
    """Thread-safe; sends through its :class:`~layertap.producer.client.client.Client` (``Client.bundler()``).

    Invariant: every job :meth:`add` returned is sent by the time :meth:`flush` or
    :meth:`close` returns (a send that failed is kept and tried again, and its error raised
    there or by the next :meth:`add`)."""

    def __init__(self, client: Client, settings: BundleSettings, *, check: bool | None = None):
        self.client = client
        self.settings = settings
        self.check = check
        self._groups: dict[tuple[str, str], _Group] = {}
        self._lock = threading.RLock()
        self._closed = threading.Event()
        self._failure: BaseException | None = None
        self._thread: threading.Thread | None = None

    def add(self, job: Job | Mapping[str, Any], *, reopen_group: str | None = None, **fields: Any) -> Job:
        """Validate ``job`` (as ``Client.submit`` does) and put it in its bundle; returns it with its id.
        ``reopen_group``: the job was sent before, and its message's push clears its old status and
        its consumption by this consumer group (``Client.send``'s ``reopen``)."""
        job, payload = self.client.prepare(job, check=self.check, **fields)
        tokens = job.estimated_tokens()
        key = (job.model, job.run)
        with self._lock:
            if self._closed.is_set():
                raise RuntimeError("this bundler is closed; take a new one from Client.bundler()")
            self._raise_failure()
            group = self._groups.get(key)
            if group is not None and (self._full(group) or group.tokens + tokens > self.settings.max_tokens):
                kept = self._kept_back(group, job, tokens)
                self._send([key], keep=kept)
                self._raise_failure()  # this job is not taken; the bundle before it is kept
                group = self._groups.get(key)
            if group is None:
                group = self._groups[key] = _Group(time.monotonic())
            group.add(job, payload, tokens, reopen_group)
            if self._full(group) and len(group.jobs) == 1:  # nothing of it could be kept back: send it now
                self._send([key])
            elif self._thread is None:
                self._thread = threading.Thread(target=self._send_late, name="layertap-bundler", daemon=True)
                self._thread.start()
                atexit.register(self.close)
        return job

    def _full(self, group: _Group) -> bool:
        return len(group.jobs) >= self.settings.max_jobs or group.tokens >= self.settings.max_tokens

    def _kept_back(self, group: _Group, job: Job, tokens: int) -> int:
        """How many of ``group``'s last jobs start the next bundle with ``job``: the rows that
        ``job`` and each other extend (one conversation's), if they are not the whole bundle and
        fit in one with it; else 0."""
        run = 0
        later = job
        for earlier, _ in reversed(group.jobs):
            if not later.extends(earlier):
                break
            run, later = run + 1, earlier
        if run == 0 or run == len(group.jobs) or run + 1 > self.settings.max_jobs:
            return 0
        return run if sum(group.sizes[-run:]) + tokens <= self.settings.max_tokens else 0

    def holds(self, run: str, job_id: str) -> bool:
        """Whether a job of ``run`` with ``job_id`` waits here, not sent yet."""
        with self._lock:
            return any(key[1] == run and job_id in group.ids for key, group in self._groups.items())

    def flush(self) -> None:
        """Send every bundle now, full or not."""
        with self._lock:
            self._send(list(self._groups))
            self._raise_failure()

    def close(self) -> None:
        """Send what is left and stop the background thread."""
        self._closed.set()
        if self._thread is not None:
            self._thread.join()
            atexit.unregister(self.close)
        self.flush()

    def _send(self, group_keys: list[tuple[str, str]], keep: int = 0) -> None:
        """Send these bundles; with ``keep``, all but the last ``keep`` jobs of the one bundle named,
        those staying as a new bundle of that key."""
        taken = [(key, self._groups.pop(key)) for key in group_keys if key in self._groups]
        if not taken:
            return
        if keep:
            (key, whole), = taken
            sent, self._groups[key] = whole.split(keep, time.monotonic())
            taken = [(key, sent)]
        try:
            self.client.send([group.jobs for _, group in taken],
                             {(key[1], job_id): [reopened] for key, group in taken
                              for job_id, reopened in group.reopen.items()})
            self._failure = None
        except BaseException as exc:  # kept for the next try (a Ctrl-C too: close() still sends them)
            for key, group in taken:
                if keep:  # put the bundle back whole, as it was before the split
                    group = group.joined(self._groups.pop(key))
                self._groups.setdefault(key, group)
            if not isinstance(exc, (redis.exceptions.RedisError, OperationalError, OSError)):
                raise
            self._failure = exc  # raised later

    def _raise_failure(self) -> None:
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise failure

    def _send_late(self) -> None:
        """The latency cap: send bundles whose oldest job has waited ``max_wait_s``."""
        wait = self.settings.max_wait_s
        while not self._closed.wait(wait / 2):
            with self._lock:
                now = time.monotonic()
                self._send([key for key, group in self._groups.items() if now - group.started >= wait])
                if self._failure is not None:
                    log.warning("sending a bundle failed (%s); trying again", self._failure)

    def __enter__(self) -> Bundler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
