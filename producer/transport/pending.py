"""The pending ledger: one record per message, written by its sender before sending.

A record (``keys.PENDING_HASH``: queue and send time; ``keys.pending_sent_zset``: the send
time by queue; ``keys.PENDING_PAYLOAD_HASH``: what to send again) lets the reconciler
(``worker.queue.reconciler``) resend a message lost between the queue and a worker. The
Client writes one per message it sends (one job, or a bundle of jobs), a worker one per
half of a bundle it splits; the worker that publishes the message's last final result
removes it in the same transaction (``worker.queue.publisher``).
"""

from __future__ import annotations

import json
from typing import Any

from redis.client import Pipeline

from producer.protocol import keys


def record_pending(pipe: Pipeline, queue: str, task_id: str, task: str, args: list[Any], kwargs: dict[str, Any],
                   now: float) -> None:
    """Queue on ``pipe`` the record of message ``task_id`` (task ``task``) about to be sent to ``queue``."""
    payload: dict[str, Any] = {"args": args, "kwargs": kwargs, "queue": queue}
    if task != keys.EXTRACT_TASK:
        payload["task"] = task
    pipe.hset(keys.PENDING_HASH, task_id, json.dumps({"queue": queue, "submitted_at": now}))
    pipe.zadd(keys.pending_sent_zset(queue), {task_id: now})
    pipe.sadd(keys.PENDING_QUEUES_SET, queue)
    pipe.hset(keys.PENDING_PAYLOAD_HASH, task_id, json.dumps(payload))


def clear_pending(pipe: Pipeline, queue: str | None, task_id: str) -> None:
    """Queue on ``pipe`` the removal of message ``task_id``'s record (its ``queue``'s member too, if known)."""
    for pending in (keys.PENDING_HASH, keys.PENDING_PAYLOAD_HASH, keys.SUSPECT_HASH):
        pipe.hdel(pending, task_id)
    if queue:
        pipe.zrem(keys.pending_sent_zset(queue), task_id)
