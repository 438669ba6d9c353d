"""A run's lifecycle: list runs, see whether one is complete, cancel it, delete it.

This module orders a run's changes and reads through the run ledger (``layertap.transport.ledger``),
the one reader and writer of job and run state, from which :func:`cancel`, :func:`trim` and
:func:`run_names` come. Each function reads once (a command reports what Redis says), unless
given a :class:`~layertap.transport.ledger.Ledger` that waits.

A run exists once the Client has recorded a job in its submitted hash (or a worker has
published a result to its stream). Its progress is the length of that hash against the
length of its status hash (one entry per job with a final result).

**Cancel** sets ``layertap:run:<run>:cancelled``. From then on:

* a worker that takes one of the run's jobs, or holds one not yet handed to its engine (it checks
  just before), answers it with an error result of type ``cancelled`` without running it (so
  every message still ends with exactly one result); jobs already in the engine end as they
  would have, so the true counts are known only once every job has a result (:func:`outcomes`);
* the reconciler does not send a lost job of a cancelled run again: it publishes that
  ``cancelled`` result itself;
* ``Client.submit`` refuses new jobs for the run (:class:`RunCancelled`).

Jobs already running finish normally. **Delete** removes the run's keys (results stream,
status and submitted hashes, attempt counters, pending records, every ``layertap:run:<run>:*``
key) and, if asked, its files; it refuses while jobs have no result yet, unless ``force``,
which cancels the run, takes its messages out of the queues and waits for those workers
hold to end, so nothing publishes into the deleted run and no file is left behind.

**Trim** drops the run's results-stream entries (all, or those older than a time: the
``retention.results_s`` setting, applied by every worker's retention sweep) and their
result-id fields. What stays is the compact ledger: the status and submitted hashes (resume,
counts) and the storage roots of the dropped ok results (``keys.run_roots_set``), so a
trimmed ok job is found at ``naming.job_location`` and its file's header holds the rest
(the job's ``metadata`` included). :func:`ok_files` and :func:`ledger_result` read it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Container, Iterator
from dataclasses import dataclass
from pathlib import Path

import redis

from layertap.producer.client.results import stream_results
from layertap.protocol import fileformat as ff
from layertap.protocol import keys
from layertap.protocol.fileformat import MetaKey
from layertap.protocol.naming import job_location
from layertap.protocol.schema import Result, Status
from layertap.storage.base import Storage
from layertap.storage.registry import storage_at, storage_for
from layertap.transport.ledger import Ledger
from layertap.transport.ledger.attempts import cancel as cancel  # re-exported: the run's ledger changes
from layertap.transport.ledger.runs import run_names as run_names
from layertap.transport.ledger.runs import trim as trim

HELD_POLL_S = 1.0


class RunCancelled(RuntimeError):
    """A job for a cancelled run."""


@dataclass
class RunSummary:
    """One run now: jobs submitted, jobs with a final result, when it was cancelled, how many of
    its jobs ended ``cancelled`` (counted for a cancelled run by ``summary(count_cancelled=True)``
    and :func:`list_runs`; :attr:`state` needs it), and (from :func:`list_runs`) the bytes its keys
    take in Redis (``MEMORY USAGE``, sampled)."""

    run: str
    submitted: int
    finished: int
    cancelled_at: float | None
    cancelled_jobs: int = 0
    redis_bytes: int | None = None

    @property
    def state(self) -> str:
        """``running``, ``cancelling`` (cancelled, some jobs without a result yet), ``complete`` (every
        job has a result, none ``cancelled``: a run cancelled after all its jobs ended ok is complete),
        ``cancelled`` (complete, some jobs ``cancelled``) or ``empty``."""
        if self.submitted == 0:
            return "empty"
        if self.finished < self.submitted:
            return "running" if self.cancelled_at is None else "cancelling"
        return "cancelled" if self.cancelled_jobs else "complete"


def _ledger(client: redis.Redis | Ledger) -> Ledger:
    """The ledger these functions read: a given one with its wait, or ``client``'s, one attempt."""
    return client if isinstance(client, Ledger) else Ledger(client, give_up_s=0)


def cancelled_jobs(client: redis.Redis, run: str) -> int:
    """Jobs of ``run`` whose final result is ``cancelled`` (its cancelled set, less the jobs that
    ended otherwise since): O(cancelled jobs)."""
    return len(_ledger(client).cancelled_jobs(run))


def summary(client: redis.Redis, run: str, *, count_cancelled: bool = False) -> RunSummary:
    """The run's counts (O(1)); with ``count_cancelled``, a cancelled run's ``cancelled`` jobs too
    (:func:`cancelled_jobs`), which :attr:`RunSummary.state` needs."""
    submitted, finished, cancelled = _ledger(client).counts(run)
    if cancelled is None or not count_cancelled:
        return RunSummary(run, submitted, finished, cancelled)
    return RunSummary(run, submitted, finished, cancelled, cancelled_jobs(client, run))


def outcomes(client: redis.Redis, run: str) -> dict[str, int]:
    """How the run's jobs ended so far: ``ok``, ``failed`` (errors other than ``cancelled``),
    ``cancelled``, and ``pending`` (submitted, no result yet). Reads the status hash: O(run)."""
    ok = sum(status == Status.ok.value for _, status in _ledger(client).statuses(run))
    found = summary(client, run)
    cancelled = cancelled_jobs(client, run)
    return {"ok": ok, "failed": found.finished - ok - cancelled, "cancelled": cancelled,
            "pending": max(0, found.submitted - found.finished)}


def exists(client: redis.Redis, run: str) -> bool:
    """Jobs were submitted to ``run`` or results were published to it."""
    return _ledger(client).exists(run)


def is_complete(client: redis.Redis, run: str) -> bool:
    """At least one job was submitted and every submitted job has a final result."""
    found = summary(client, run)
    return found.submitted > 0 and found.finished >= found.submitted


def list_runs(client: redis.Redis) -> list[RunSummary]:
    """Every run the Client has submitted to, by name, with its bytes in Redis."""
    found = []
    for run in run_names(client):
        listed = summary(client, run, count_cancelled=True)
        listed.redis_bytes = redis_bytes(client, run)
        found.append(listed)
    return found


def redis_bytes(client: redis.Redis, run: str) -> int:
    """Bytes the run's keys take in Redis (``MEMORY USAGE``: large hashes and streams are sampled)."""
    return _ledger(client).memory_bytes(run)


def waiting_models(client: redis.Redis, run: str, sample: int = 100) -> set[str]:
    """Models that (up to ``sample``) unfinished jobs of ``run`` were sent to (their pending records)."""
    models = {keys.queue_model(record["queue"]) for record in _ledger(client).run_records(run, most=sample)}
    return {model for model in models if model is not None}


def is_cancelled(client: redis.Redis, run: str) -> bool:
    """``run`` is cancelled (:func:`cancel`), until it is deleted (:func:`delete`); ``Client.submit`` refuses its
    jobs (a Client checks once per run)."""
    return _ledger(client).is_cancelled(run)


def held_messages(client: redis.Redis, run: str) -> int:
    """Messages of ``run`` that workers hold now (their ``unacked`` records): O(messages in flight)."""
    prefix = keys.task_id(run, "")
    return sum(1 for tag in client.hkeys(keys.UNACKED_HASH) if keys.as_text(tag).startswith(prefix))


def delete(client: redis.Redis, run: str, *, force: bool = False, files_under: str | Path | Storage | None = None,
           held_wait_s: float = 120.0, on_wait: Callable[[int], None] = lambda held: None) -> list[str]:
    """Remove the run's keys; returns the ok results' file paths (for the caller to remove).

    Raises ``RuntimeError`` while some submitted job has no result, unless ``force``: then the
    run is cancelled, its messages still in a queue are removed, and the messages workers hold
    are waited for (``on_wait(held)`` each second; their jobs not yet computing end
    ``cancelled``), so that none publishes into the deleted run and every file is known before
    the keys go; ``RuntimeError`` if some are still held after ``held_wait_s``. With ``files_under``
    (the storage root, or its Storage) the paths are returned as it acts on them (``Storage.owned``), and a path
    that is not its job's file under that root raises ``ValueError`` before any key is removed."""
    found = summary(client, run)
    if found.finished < found.submitted and not force:
        raise RuntimeError(f"run {run} has {found.submitted - found.finished} job(s) without a result; "
                           f"`layertap runs cancel {run}` and wait for their `cancelled` results, "
                           "or delete with --force")
    book = _ledger(client)
    if force:
        book.cancel(run)
        for queue in sorted({record["queue"] for record in book.run_records(run)}):
            book.remove_queued(queue, run)
        deadline = time.monotonic() + held_wait_s
        while held := held_messages(client, run):
            if time.monotonic() > deadline:
                raise RuntimeError(f"run {run}: {held} message(s) still held by workers after {held_wait_s:.0f}s "
                                   "(a dead worker's come back after its visibility timeout); nothing was deleted, "
                                   "try again later")
            on_wait(held)
            time.sleep(HELD_POLL_S)
    paths = [path if files_under is None else str(_file_under(files_under, run, job_id, path))
             for job_id, (path, _) in ok_files(client, run).items()]
    book.forget_run(run)
    return paths


def _file_under(root: str | Path | Storage, run: str, job_id: str, path: str) -> str:
    storage = storage_for(root)
    found = storage.owned(path, run, job_id)
    if found is None:
        raise ValueError(f"job {job_id}'s result names {path!r}, which is not its file under the storage root "
                         f"{storage.root} (setting storage_root, --storage): nothing was deleted")
    return found


def was_trimmed(client: redis.Redis | Ledger, run: str) -> bool:
    """Some of ``run``'s stream entries were trimmed (:func:`trim`): its trimmed ok jobs are found in the ledger."""
    return _ledger(client).was_trimmed(run)


def storage_roots(client: redis.Redis | Ledger, run: str) -> list[str]:
    """The storage roots of the run's trimmed ok results, sorted."""
    return _ledger(client).storage_roots(run)


def ledger_path(roots: list[str], run: str, job_id: str) -> str | None:
    """Where a trimmed ok job's file is: under the one storage root, or the first of several that
    holds it here (the first if this machine sees none); None without roots."""
    paths = [job_location(root, run, job_id) for root in roots]
    if len(paths) > 1:
        paths.sort(key=lambda path: not storage_at(path).exists(path))
    return paths[0] if paths else None


def ok_files(client: redis.Redis, run: str) -> dict[str, tuple[str, str | None]]:
    """job id -> (path, metadata) of every job of ``run`` whose final result is ok: the trimmed ones
    first, by job id (from the ledger; metadata None: it is in the file's header), then the stream's
    in the order jobs first finished ok (each job's last ok result)."""
    streamed: dict[str, tuple[str, str | None]] = {}
    for _, result in stream_results(client, run):
        if result.ok and result.path:
            streamed[result.job_id] = (result.path, result.metadata)
    trimmed: dict[str, tuple[str, str | None]] = {}
    if was_trimmed(client, run):
        done = sorted(job_id for job_id, status in _ledger(client).statuses(run)
                      if status == Status.ok.value and job_id not in streamed)
        roots = storage_roots(client, run)
        for job_id in done:
            path = ledger_path(roots, run, job_id)
            if path is not None:
                trimmed[job_id] = (path, None)
    return {**trimmed, **streamed}


def trimmed_results(client: redis.Redis, run: str, shown: Container[str] = ()) -> Iterator[Result]:
    """From the ledger (:func:`ledger_result`), by job id: the final result of each job of ``run``
    whose stream entry was trimmed (a status, and no latest entry), but those in ``shown``.
    Nothing for a run never trimmed."""
    if not was_trimmed(client, run):
        return
    trimmed = _ledger(client).trimmed_statuses(run, shown)
    for job_id in sorted(trimmed):
        yield ledger_result(client, run, job_id, trimmed[job_id])


def ledger_result(client: redis.Redis | Ledger, run: str, job_id: str, status: str) -> Result:
    """The final result of a job whose stream entry was trimmed, from the ledger: ok with its
    file's path (and, when this machine can read the file, its model, layers, tokens, dtype and
    metadata from the header); an error result without its error type and message."""
    if status != Status.ok.value:
        return Result(job_id=job_id, run=run, status=Status.error,
                      error=f"job {job_id} ended with an error; its result was trimmed from the run's stream "
                            "(retention): `layertap enqueue` sends it again")
    path = ledger_path(storage_roots(client, run), run, job_id)
    try:
        header = storage_at(path).read_header(path) if path else None
        meta = header.metadata if header is not None else {}
        if header is None or meta.get(MetaKey.JOB_ID) != job_id:
            return Result(job_id=job_id, run=run, status=Status.ok, path=path)
        return Result(job_id=job_id, run=run, status=Status.ok, path=path,
                      num_tokens=header.tensors[ff.TOKEN_IDS]["shape"][0], layers=json.loads(meta[MetaKey.LAYERS]),
                      dtype=meta.get(MetaKey.DTYPE), model=meta.get(MetaKey.MODEL),
                      metadata=meta.get(MetaKey.JOB_METADATA))
    except (ff.FileFormatError, OSError, KeyError, ValueError):
        return Result(job_id=job_id, run=run, status=Status.ok, path=path)
