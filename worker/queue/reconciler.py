"""Putting back jobs whose message was left between the queue and a worker.

A worker fetches a message atomically into its queue's in-flight list and moves it from
there into kombu's ``unacked`` record in one transaction (``layertap.transport.broker_transport``),
so a message is always queued, in flight, or held. A fetcher that dies (or loses its
connection) between the two leaves the message in the in-flight list. To find it, every message
the Client sends (one job, or a bundle: ``layertap.transport.ledger``) is recorded as
*pending* in the step that queues it, with its push time on the server's clock (so a queue is in
send order, and a record never exists for a message still on its way), and the worker that
publishes the message's last final result removes the record in the same transaction. Below, a
"job" is a message: a bundle's task id stands for all its jobs.
Every ``interval`` seconds one worker (``SET NX`` lock) sweeps the pending records: a job is
*missing* when it is older than the oldest message still in its queue (queues are FIFO: it
cannot be behind it), is not held by any worker (no ``unacked`` entry carries its task id)
and is not finished. A job found missing on two sweeps at least ``grace`` seconds apart
(covering a delivery in progress) has its in-flight message put back at the head of its
queue (a server-side script: the body never leaves Redis). A false alarm only costs a
duplicate delivery, which the worker answers from disk (jobs are idempotent). A missing job
whose message is nowhere (the queue was purged by hand, Redis lost writes, an older client
died between recording and sending) gets an error result of type ``lost`` (``layertap
enqueue`` sends it again), or ``cancelled`` if its run is cancelled (``layertap.producer.client.runs``):
every job still ends with exactly one result. A job of that message that already has a final
result, or was sent again after it (its submitted-hash time is later than the record's:
``layertap.transport.ledger``; the resend has its own record), gets none: the check and the
publishing are one server-side step (the ledger's ``end_lost_message.lua``), so a job that
ended ok is never turned ``lost``, and that step first looks for the message in the queue's
head region, its in-flight list and ``unacked`` once more and changes nothing where it is
found: a message still queued or held is never called lost; those results go out through the worker's one publisher, so
the result sinks see them too. Every state change of a sweep is the ledger's.

A sweep reads ids and times, never a message body, and never the backlog: the held task
ids are the keys of ``unacked`` (delivery tags carry the task id, ``keys.delivery_tag``),
a queue's head is known by its delivery tag (a server-side script returns only the tag)
and its send time by the queue's sorted set of pending send times
(``keys.pending_sent_zset``), from which only the jobs sent before the head are read (the
held, the lost and the just finished: O(in-flight)); the suspects' first-seen times come
in one ``HGETALL`` and go back in one pipeline. A body is read only for a held message
whose tag carries no task id, and for a queue head whose job has no pending send time
(sent by an older client, or a finished job's duplicate). Pending records without a
sorted-set member (written by a client older than the sorted sets: the records outnumber
the members) are given one, in one full pass.
"""

from __future__ import annotations

import base64
import json
import logging

import redis
from celery import Celery

from layertap.protocol import keys
from layertap.transport.ledger import Ledger, cancelled_result, lost_result, message_jobs
from layertap.worker.queue.periodic import Periodic, take_turn
from layertap.worker.queue.publisher import ResultPublisher

log = logging.getLogger(__name__)

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

    def __init__(self, client: redis.Redis, app: Celery, node: str, interval: float, grace: float,
                 publisher: ResultPublisher | None = None):
        self.redis = client
        self.ledger = Ledger(client, give_up_s=0)  # one attempt: a sweep that fails runs again at the next tick
        self.app = app
        self.node = node
        self.interval = interval
        self.grace = grace
        self.publisher = publisher or ResultPublisher(client)  # the worker's own, sinks and all
        self._ticker = Periodic("reconcile sweep", interval, self.sweep)

    def start(self) -> Reconciler:
        self._ticker.start()
        return self

    def stop(self) -> None:
        self._ticker.stop()

    def sweep(self) -> int:
        """One pass; returns how many jobs were put back in their queue."""
        if not take_turn(self.redis, keys.RECONCILE_LOCK, self.node, self.interval):
            return 0
        seconds, micros = self.redis.time()
        now = seconds + micros / 1e6  # the server's clock: the send times it compares with are the server's
        held = self._held_task_ids()
        suspects = self.ledger.suspects()
        queues = self._adopt_unsorted_records()
        missing: dict[str, float] = {}
        for queue in sorted(queues):
            missing.update(self._missing_from(queue, held, now))
        cleared = [task_id for task_id in suspects if task_id not in missing]
        self.ledger.note_suspects(cleared, {task_id: now for task_id in missing if task_id not in suspects})
        due = [task_id for task_id in missing if task_id in suspects and now - suspects[task_id] >= self.grace]
        # newest first: each goes back to the head, so the oldest ends first in line (the queue stays in send order)
        return sum(self._resend(task_id) for task_id in sorted(due, key=lambda task_id: -missing[task_id]))

    def _adopt_unsorted_records(self) -> set[str]:
        """The queues with pending jobs; first, if some pending record has no send-time member
        (the client writes both in one transaction, so only an older client's), add the members."""
        queues, unsorted = self.ledger.pending_queues()
        if not unsorted:
            return queues
        queues |= self.ledger.adopt_records()
        log.info("gave %d pending record(s) of an older client their send-time entries", unsorted)
        return queues

    def _held_task_ids(self) -> set[str | None]:
        """Task ids of every message a worker holds, from the ``unacked`` hash's keys (delivery tags)."""
        held: set[str | None] = set()
        untagged = []
        for tag in map(keys.as_text, self.redis.hkeys(keys.UNACKED_HASH)):
            task_id = keys.task_id_of_delivery_tag(tag)
            if task_id is None:
                untagged.append(tag)
            held.add(task_id)
        if untagged:  # sent without a task id in its tag: read those messages
            held.update(_held_task_id(raw) for raw in self.redis.hmget(keys.UNACKED_HASH, untagged) if raw)
        return held

    def _missing_from(self, queue: str, held: set[str | None], now: float) -> dict[str, float]:
        """Pending jobs of ``queue`` sent before its head and over ``grace`` ago that no worker holds,
        with their send times."""
        cutoff = self._oldest_queued(queue)
        if cutoff is None:
            return {}
        sent = self.ledger.sent_before(queue, min(cutoff, now - self.grace))
        candidates = {task_id: at for task_id, at in sent.items() if task_id not in held}
        ended = self.ledger.ended_of(list(candidates))
        self.ledger.forget_sent(queue, sorted(ended))
        return {task_id: at for task_id, at in candidates.items() if task_id not in ended}

    def _oldest_queued(self, queue: str) -> float | None:
        """Send time of the message next in line in ``queue``: +inf if empty, None if unknown."""
        tag = self.ledger.head_delivery_tag(queue)
        if tag is None:
            return float("inf")
        task_id = keys.task_id_of_delivery_tag(tag)
        sent_at = self.ledger.sent_at(queue, task_id) if task_id else None
        if sent_at is not None:
            return sent_at
        head = self.redis.lindex(queue, -1)  # a tag without a task id, or a finished job's duplicate
        return float("inf") if head is None else _submitted_at_of(head)

    def _resend(self, task_id: str) -> bool:
        """Put a missing job's in-flight message back in its queue; else give it its final result."""
        pending = self.ledger.record_of(task_id)
        if pending is None:  # finished meanwhile
            return False
        queue = pending["queue"]
        if self.ledger.restore_inflight(task_id, queue):
            log.warning("message %s was fetched by a worker that died before holding it; put it back in its queue",
                        task_id)
            return True
        found = message_jobs(task_id, pending)
        if found is None:
            return False
        model = keys.queue_model(queue)
        cancelled = self.ledger.cancelled_runs(sorted({run for run, _ in found}))
        results = [cancelled_result(run, job_id, worker=self.node, model=model) if run in cancelled
                   else lost_result(run, job_id, worker=self.node, model=model) for run, job_id in found]
        published = self.publisher.end_lost_message(results, task_id, queue, float(pending["submitted_at"]))
        if published is None:
            log.info("message %s was found queued or held after all (a restore put it behind newer messages); "
                     "not ended", task_id)
            return False
        log.log(logging.INFO if cancelled or not published else logging.ERROR,
                "message %s (%d job(s)) is nowhere (not queued, in flight or held): published %d `lost` or "
                "`cancelled` error result(s); the other jobs have a final result or were sent again",
                task_id, len(found), published)
        return False
