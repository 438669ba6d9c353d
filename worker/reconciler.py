"""Resending jobs whose message was lost between the queue and a worker.

kombu's Redis transport pops a message with ``BRPOP`` and only then records it in its
``unacked`` hash: a worker killed between the two loses that message. To keep the
promise that nothing is lost, the Client records every job it sends as *pending*
(``layertap:pending``: queue and send time; ``layertap:pending:payload``: what to send
again) and the worker that publishes the job's final result removes the record in the
same transaction. Every ``interval`` seconds one worker (``SET NX`` lock) sweeps the
pending records: a job is *missing* when it is older than the oldest message still in
its queue (queues are FIFO: it cannot be behind it), is not held by any worker (no
``unacked`` entry carries its task id) and is not finished. A job found missing on two
sweeps at least ``grace`` seconds apart (covering a delivery in progress) is sent again
with the same task id and payload. A false alarm only costs a duplicate delivery, which
the worker answers from disk (jobs are idempotent). A missing job of a cancelled run
(``producer.runs``) is not sent again: its ``cancelled`` result is published instead.
"""

from __future__ import annotations

import base64
import json
import logging
import time
from typing import Any

import redis
from celery import Celery

from producer import keys, runs
from producer.celery_app import send_extract
from worker.periodic import Periodic
from worker.publisher import ResultPublisher

log = logging.getLogger(__name__)
UNACKED_KEY = "unacked"  # kombu's default ``unacked_key``


def _held_task_id(unacked_entry: bytes | str) -> str | None:
    """Task id of an ``unacked`` hash value (kombu stores ``[message, exchange, routing_key]``)."""
    try:
        return json.loads(unacked_entry)[0]["headers"]["id"]
    except (ValueError, KeyError, TypeError, IndexError):
        return None


def _submitted_at_of(raw_message: bytes | str) -> float | None:
    """The ``submitted_at`` keyword of a queued Celery message, if it has one."""
    try:
        message = json.loads(raw_message)
        body = message["body"]
        if message.get("properties", {}).get("body_encoding") == "base64":
            body = base64.b64decode(body)
        _args, kwargs, _embed = json.loads(body)
        value = kwargs.get("submitted_at")
        return float(value) if value is not None else None
    except (ValueError, KeyError, TypeError):
        return None


class Reconciler:
    """A background thread in every worker; at most one sweeps at a time."""

    def __init__(self, client: redis.Redis, app: Celery, node: str, interval: float, grace: float):
        self.redis = client
        self.app = app
        self.node = node
        self.interval = interval
        self.grace = grace
        self.publisher = ResultPublisher(client)
        self._ticker = Periodic("reconcile sweep", interval, self.sweep)

    def start(self) -> Reconciler:
        self._ticker.start()
        return self

    def stop(self) -> None:
        self._ticker.stop()

    def sweep(self) -> int:
        """One pass; returns how many jobs were sent again."""
        if not self.redis.set(keys.RECONCILE_LOCK, self.node, nx=True, ex=max(1, int(self.interval))):
            return 0
        now = time.time()
        held = {_held_task_id(raw) for _, raw in self.redis.hscan_iter(UNACKED_KEY)}
        oldest: dict[str, float | None] = {}
        resent = 0
        for task_id, info in self.redis.hscan_iter(keys.PENDING_HASH, count=1000):
            task_id = task_id.decode() if isinstance(task_id, bytes) else task_id
            record = json.loads(info)
            queue, submitted_at = record["queue"], float(record["submitted_at"])
            if queue not in oldest:
                oldest[queue] = self._oldest_queued(queue)
            cutoff = oldest[queue]
            missing = (task_id not in held and cutoff is not None and submitted_at < cutoff
                       and now - submitted_at > self.grace)
            if not missing:
                self.redis.hdel(keys.SUSPECT_HASH, task_id)
                continue
            first_seen = self.redis.hget(keys.SUSPECT_HASH, task_id)
            if first_seen is None:
                self.redis.hset(keys.SUSPECT_HASH, task_id, now)
            elif now - float(first_seen) >= self.grace and self._resend(task_id):
                resent += 1
        return resent

    def _oldest_queued(self, queue: str) -> float | None:
        """Send time of the message next in line in ``queue``: +inf if empty, None if unknown."""
        head = self.redis.lindex(queue, -1)
        if head is None:
            return float("inf")
        return _submitted_at_of(head)

    def _resend(self, task_id: str) -> bool:
        payload: Any = self.redis.hget(keys.PENDING_PAYLOAD_HASH, task_id)
        if payload is None:
            return False
        parsed = keys.parse_task_id(task_id)
        if parsed is not None and runs.is_cancelled(self.redis, parsed[0]):
            run, job_id = parsed
            self.publisher.publish(runs.cancelled_result(run, job_id, worker=self.node))
            log.info("job %s was lost and its run is cancelled: published its cancelled result", task_id)
            return False
        data = json.loads(payload)
        send_extract(self.app, data["args"], data["kwargs"], data["queue"], task_id)
        self.redis.hdel(keys.SUSPECT_HASH, task_id)
        self.redis.incr(keys.RECOVERED_COUNTER)
        log.warning("job %s was lost between the queue and a worker; sent it again", task_id)
        return True
