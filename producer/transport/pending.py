"""The pending ledger: one record per message, written by its sender before sending.

A record (``keys.PENDING_HASH``: JSON with the queue, the send time and, for a bundle, its
job ids; ``keys.pending_sent_zset``: the send time by queue) lets the reconciler
(``worker.queue.reconciler``) find a message lost between the queue and a worker: it puts
the message back from its queue's in-flight list, or, where the message is nowhere, gives
each of its jobs a final result. No copy of the message's body is kept. The Client writes one
record per message it sends (one job, or a bundle of jobs), a worker one per half of a bundle
it splits; the worker that publishes the message's last final result removes it in the same
transaction (``worker.queue.publisher``).
"""

from __future__ import annotations

import json
from typing import Any

from redis.client import Pipeline

from producer.protocol import keys


def record_pending(pipe: Pipeline, queue: str, task_id: str, now: float,
                   bundle_jobs: list[str] | None = None) -> None:
    """Queue on ``pipe`` the record of message ``task_id`` about to be sent to ``queue`` (a
    bundle's: with the ids of its jobs)."""
    record: dict[str, Any] = {"queue": queue, "submitted_at": now}
    if bundle_jobs is not None:
        record["jobs"] = bundle_jobs
    pipe.hset(keys.PENDING_HASH, task_id, json.dumps(record))
    pipe.zadd(keys.pending_sent_zset(queue), {task_id: now})
    pipe.sadd(keys.PENDING_QUEUES_SET, queue)


def clear_pending(pipe: Pipeline, queue: str | None, task_id: str) -> None:
    """Queue on ``pipe`` the removal of message ``task_id``'s record (its ``queue``'s member too, if known)."""
    for pending in (keys.PENDING_HASH, keys.SUSPECT_HASH):
        pipe.hdel(pending, task_id)
    if queue:
        pipe.zrem(keys.pending_sent_zset(queue), task_id)


def message_jobs(task_id: str, record: dict[str, Any]) -> tuple[str, list[str]] | None:
    """``(run, job ids)`` of the message ``task_id`` with pending ``record``; None if unknown."""
    if keys.is_bundle_task_id(task_id):
        run = task_id.partition(":")[0]
        jobs = record.get("jobs")
        return (run, [job for job in jobs if isinstance(job, str)]) if run and isinstance(jobs, list) else None
    parsed = keys.parse_task_id(task_id)
    return None if parsed is None else (parsed[0], [parsed[1]])
