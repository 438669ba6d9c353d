"""A run's lifecycle: list runs, see whether one is complete, cancel it, delete it.

A run exists once the Client has recorded a job in its submitted hash (or a worker has
published a result to its stream). Its progress is the length of that hash against the
length of its status hash (one entry per job with a final result).

**Cancel** sets ``layertap:run:<run>:cancelled``. From then on:

* a worker that takes one of the run's jobs answers it with an error result of type
  ``cancelled`` without running it (so every message still ends with exactly one result);
* the reconciler does not send a lost job of a cancelled run again: it publishes that
  ``cancelled`` result itself;
* ``Client.submit`` refuses new jobs for the run (:class:`RunCancelled`).

Jobs already running finish normally. **Delete** removes the run's keys (results stream,
status and submitted hashes, attempt counters, pending records, the cancel flag) and, if
asked, its files; it refuses while jobs have no result yet, unless ``force``, which also
takes the run's messages out of the queues.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass

import redis

from producer.client.results import stream_results
from producer.protocol import keys
from producer.protocol.schema import ErrorType, Result, Status


class RunCancelled(RuntimeError):
    """A job for a cancelled run."""


@dataclass
class RunSummary:
    """One run now: jobs submitted, jobs with a final result, and whether it was cancelled."""

    run: str
    submitted: int
    finished: int
    cancelled_at: float | None

    @property
    def state(self) -> str:
        """``cancelled``, ``complete`` (every job has a result), ``running`` or ``empty``."""
        if self.cancelled_at is not None:
            return "cancelled"
        if self.submitted == 0:
            return "empty"
        return "complete" if self.finished >= self.submitted else "running"


def summary(client: redis.Redis, run: str) -> RunSummary:
    pipe = client.pipeline(transaction=False)
    pipe.hlen(keys.run_submitted_hash(run))
    pipe.hlen(keys.run_status_hash(run))
    pipe.get(keys.run_cancelled_key(run))
    submitted, finished, cancelled = pipe.execute()
    return RunSummary(run, int(submitted), int(finished), None if cancelled is None else float(cancelled))


def exists(client: redis.Redis, run: str) -> bool:
    """Jobs were submitted to ``run`` or results were published to it."""
    return bool(client.exists(keys.run_submitted_hash(run), keys.results_stream(run)))


def is_complete(client: redis.Redis, run: str) -> bool:
    """At least one job was submitted and every submitted job has a final result."""
    found = summary(client, run)
    return found.submitted > 0 and found.finished >= found.submitted


def list_runs(client: redis.Redis) -> list[RunSummary]:
    """Every run the Client has submitted to, by name."""
    names = {keys.run_of_submitted_hash(_text(key))
             for key in client.scan_iter(match=keys.RUN_SUBMITTED_PATTERN, count=1000)}
    return [summary(client, run) for run in sorted(names)]


def waiting_models(client: redis.Redis, run: str, sample: int = 100) -> set[str]:
    """Models that (up to ``sample``) unfinished jobs of ``run`` were sent to (their pending records)."""
    models: set[str] = set()
    for seen, (_, record) in enumerate(client.hscan_iter(keys.PENDING_HASH, match=f"{keys.task_id(run, '')}*",
                                                          count=1000)):
        model = keys.queue_model(json.loads(record)["queue"])
        if model is not None:
            models.add(model)
        if seen + 1 >= sample:
            break
    return models


def is_cancelled(client: redis.Redis, run: str) -> bool:
    return bool(client.exists(keys.run_cancelled_key(run)))


def cancel(client: redis.Redis, run: str) -> RunSummary:
    """Mark ``run`` cancelled (idempotent: the first cancel time stays); returns it as it is now."""
    client.set(keys.run_cancelled_key(run), time.time(), nx=True)
    return summary(client, run)


def cancelled_result(run: str, job_id: str, *, worker: str | None, model: str | None = None,
                     metadata: str | None = None) -> Result:
    """The final result of a job of a cancelled run that was not run."""
    return Result(job_id=job_id, run=run, status=Status.error, error_type=ErrorType.cancelled,
                  error=f"run {run} was cancelled (layertap run cancel); this job was not run",
                  model=model, worker=worker, metadata=metadata)


def delete(client: redis.Redis, run: str, *, force: bool = False) -> list[str]:
    """Remove the run's keys; returns the ok results' file paths (for the caller to remove).

    Raises ``RuntimeError`` while some submitted job has no result, unless ``force``: then
    the run's messages still in a queue are removed first (a job a worker holds at that
    moment may still finish and publish into the deleted run)."""
    found = summary(client, run)
    if found.finished < found.submitted and not force:
        raise RuntimeError(f"run {run} has {found.submitted - found.finished} job(s) without a result; "
                           f"`layertap run cancel {run}` and wait for their `cancelled` results, "
                           "or delete with --force")
    paths = list(dict.fromkeys(result.path for result in _results(client, run) if result.ok and result.path))
    prefix = keys.task_id(run, "")
    if force:
        queues = {json.loads(record)["queue"] for _, record in client.hscan_iter(keys.PENDING_HASH, match=f"{prefix}*")}
        for queue in sorted(queues):
            _remove_queued(client, queue, prefix)
    pipe = client.pipeline(transaction=False)
    for pending in (keys.PENDING_HASH, keys.PENDING_PAYLOAD_HASH, keys.SUSPECT_HASH):
        task_ids = [_text(task_id) for task_id, _ in client.hscan_iter(pending, match=f"{prefix}*")]
        if task_ids:
            pipe.hdel(pending, *task_ids)
    for queue in map(_text, client.smembers(keys.PENDING_QUEUES_SET)):
        sent = keys.pending_sent_zset(queue)
        task_ids = [_text(task_id) for task_id, _ in client.zscan_iter(sent, match=f"{prefix}*")]
        if task_ids:
            pipe.zrem(sent, *task_ids)
    for key in client.scan_iter(match=keys.attempts_pattern(run), count=1000):
        pipe.delete(key)
    pipe.delete(keys.results_stream(run), keys.run_status_hash(run), keys.run_result_ids_hash(run),
                keys.run_submitted_hash(run), keys.run_cancelled_key(run))
    pipe.execute()
    return paths


def _results(client: redis.Redis, run: str) -> Iterator[Result]:
    for _, result in stream_results(client, run):
        yield result


def _remove_queued(client: redis.Redis, queue: str, task_prefix: str) -> None:
    """Remove the messages of tasks ``<run>:...`` from ``queue`` (a Celery queue: a Redis list)."""
    for raw in client.lrange(queue, 0, -1):
        try:
            task_id = json.loads(raw)["headers"]["id"]
        except (ValueError, KeyError, TypeError):
            continue
        if isinstance(task_id, str) and task_id.startswith(task_prefix):
            client.lrem(queue, 1, raw)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
