"""The pending ledger: one record per message, written by its sender before sending.

A record (``keys.PENDING_HASH``: JSON with the queue, the send time and, for a bundle, its
job ids, with the run of each job not of the task id's run; ``keys.pending_sent_zset``: the
send time by queue) lets the reconciler
(``worker.queue.reconciler``) find a message lost between the queue and a worker: it puts
the message back from its queue's in-flight list, or, where the message is nowhere, gives
each of its jobs a final result. No copy of the message's body is kept. The Client writes one
record per message it sends (one job, or a bundle of jobs), a worker one per half of a bundle
it splits; the worker that publishes the message's last final result removes it in the same
transaction (``worker.queue.publisher``).

A record covers a job only while the job was not sent again after it: the Client writes each
job's latest send time in the run's submitted hash (``keys.run_submitted_hash``) with the
record, so a record older than that time is stale for the job ; the job's
newer message has its own record. A record whose message is gone never ends a job that has a
final result or was sent again (``worker.queue.reconciler``).
"""

from __future__ import annotations

import json
from typing import Any

from redis.client import Pipeline

from producer.protocol import keys


def record_pending(pipe: Pipeline, queue: str, task_id: str, now: float,
                   bundle_jobs: list[tuple[str, str]] | None = None) -> None:
    """Queue on ``pipe`` the record of message ``task_id`` about to be sent to ``queue`` (a
    bundle's: with the ``(run, job id)`` of each of its jobs; runs other than the task id's are
    kept per job, so a lost bundle's results go to each job's own run)."""
    record: dict[str, Any] = {"queue": queue, "submitted_at": now}
    if bundle_jobs is not None:
        own_run = task_id.partition(":")[0]
        record["jobs"] = [job_id for _, job_id in bundle_jobs]
        other_runs = {job_id: run for run, job_id in bundle_jobs if run != own_run}
        if other_runs:
            record["runs"] = other_runs
    pipe.hset(keys.PENDING_HASH, task_id, json.dumps(record))
    pipe.zadd(keys.pending_sent_zset(queue), {task_id: now})
    pipe.sadd(keys.PENDING_QUEUES_SET, queue)


def clear_pending(pipe: Pipeline, queue: str | None, task_id: str) -> None:
    """Queue on ``pipe`` the removal of message ``task_id``'s record (its ``queue``'s member too, if known)."""
    for pending in (keys.PENDING_HASH, keys.SUSPECT_HASH):
        pipe.hdel(pending, task_id)
    if queue:
        pipe.zrem(keys.pending_sent_zset(queue), task_id)


def message_jobs(task_id: str, record: dict[str, Any]) -> list[tuple[str, str]] | None:
    """``(run, job id)`` of each job of the message ``task_id`` with pending ``record``; None if unknown."""
    if keys.is_bundle_task_id(task_id):
        run = task_id.partition(":")[0]
        jobs, runs = record.get("jobs"), record.get("runs")
        runs = runs if isinstance(runs, dict) else {}
        if not run or not isinstance(jobs, list):
            return None
        return [(str(runs.get(job, run)), job) for job in jobs if isinstance(job, str)]
    parsed = keys.parse_task_id(task_id)
    return None if parsed is None else [parsed]

