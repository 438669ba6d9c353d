"""Putting back jobs whose message was left between the queue and a worker.

A worker fetches a message atomically into its queue's in-flight list and moves it from
there into kombu's ``unacked`` record in one transaction (``producer.transport.broker_transport``),
so a message is always queued, in flight, or held. A fetcher that dies (or loses its
connection) between the two leaves the message in the in-flight list. To find it, the Client
records every message it sends (one job, or a bundle: ``producer.transport.pending``) as
*pending* and the worker that publishes the message's last final result removes the record
in the same transaction. Below, a "job" is a message: a bundle's task id stands for all its jobs.
Every ``interval`` seconds one worker (``SET NX`` lock) sweeps the pending records: a job is
*missing* when it is older than the oldest message still in its queue (queues are FIFO: it
cannot be behind it), is not held by any worker (no ``unacked`` entry carries its task id)
and is not finished. A job found missing on two sweeps at least ``grace`` seconds apart
(covering a delivery in progress) has its in-flight message put back at the head of its
queue (a server-side script: the body never leaves Redis). A false alarm only costs a
duplicate delivery, which the worker answers from disk (jobs are idempotent). A missing job
whose message is nowhere (the client died between recording and sending, the queue was
purged by hand, Redis lost writes) gets an error result of type ``lost`` (``layertap
enqueue`` sends it again), or ``cancelled`` if its run is cancelled (``producer.client.runs``):
every job still ends with exactly one result. A job of that message that already has a final
result, or was sent again after it (its submitted-hash time is later than the record's:
``producer.transport.pending``; the resend has its own record), gets none: the check and the
publishing are one server-side step (:data:`PUBLISH_UNLESS_ENDED`), so a job that ended ok is
never turned ``lost``.

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
import time
from typing import Any

import redis
from celery import Celery

from producer.client import runs
from producer.protocol import keys
from producer.protocol.schema import ErrorType, Result
from producer.transport.pending import clear_pending, message_jobs
from worker.queue.periodic import Periodic, take_turn
from worker.queue.publisher import PUBLISH_GIVE_UP_S, wait_out_redis

log = logging.getLogger(__name__)

#: The delivery tag of the message next in line in KEYS[1] (false if the queue is empty, "" if
#: it has none): the only part of the message that leaves Redis. A tag is a property of the
#: message (kombu's JSON); the body is base64 and the headers' reprs escape quotes, so the
#: first match is the tag.
HEAD_DELIVERY_TAG = """
local message = redis.call('LINDEX', KEYS[1], -1)
if not message then return false end
return string.match(message, '"delivery_tag": *"([^"]*)"') or ''
"""


#: Move the message of task ARGV[1] (delivery tag ``<task id>ARGV[2]<uuid>``) from the in-flight
#: list KEYS[1] back to the head of its queue KEYS[2]; 1 if it was there, else 0. Only the
#: answer leaves Redis.
RESTORE_INFLIGHT = """
local prefix = ARGV[1] .. ARGV[2]
for _, message in ipairs(redis.call('LRANGE', KEYS[1], 0, -1)) do
  local tag = string.match(message, '"delivery_tag": *"([^"]*)"')
  if tag and string.sub(tag, 1, #prefix) == prefix and not string.find(tag, ARGV[2], #prefix + 1, true) then
    if redis.call('LREM', KEYS[1], 1, message) == 1 then
      redis.call('RPUSH', KEYS[2], message)
      return 1
    end
  end
end
return 0
"""


#: Publish a reconciler's result (ARGV[2], under field ARGV[1]) of job ARGV[3] to its run's stream
#: KEYS[1] (indexed in KEYS[2], status ARGV[5] in KEYS[3], in the cancelled set KEYS[5] if ARGV[6]
#: is 1), unless the job has a final result in KEYS[3] or was sent again after ARGV[4] (its time
#: in the submitted hash KEYS[4]); 1 if published.
PUBLISH_UNLESS_ENDED = """
if redis.call('HEXISTS', KEYS[3], ARGV[3]) == 1 then return 0 end
local sent = redis.call('HGET', KEYS[4], ARGV[3])
if sent and tonumber(sent) > tonumber(ARGV[4]) then return 0 end
local id = redis.call('XADD', KEYS[1], '*', ARGV[1], ARGV[2])
redis.call('HSET', KEYS[2], ARGV[3], id)
redis.call('HSET', KEYS[3], ARGV[3], ARGV[5])
if ARGV[6] == '1' then redis.call('SADD', KEYS[5], ARGV[3]) end
redis.call('PUBLISH', KEYS[1], ARGV[2])
return 1
"""


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
        self._head_tag = client.register_script(HEAD_DELIVERY_TAG)
        self._restore_inflight = client.register_script(RESTORE_INFLIGHT)
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
        now = time.time()
        held = self._held_task_ids()
        suspects = {keys.as_text(task_id): float(seen)
                    for task_id, seen in self.redis.hgetall(keys.SUSPECT_HASH).items()}
        queues = self._adopt_unsorted_records()
        missing: set[str] = set()
        for queue in sorted(queues):
            missing.update(self._missing_from(queue, held, now))
        pipe = self.redis.pipeline(transaction=False)
        cleared = [task_id for task_id in suspects if task_id not in missing]
        if cleared:
            pipe.hdel(keys.SUSPECT_HASH, *cleared)
        found = {task_id: now for task_id in missing if task_id not in suspects}
        if found:
            pipe.hset(keys.SUSPECT_HASH, mapping=found)
        pipe.execute()
        due = sorted(task_id for task_id in missing if task_id in suspects and now - suspects[task_id] >= self.grace)
        return sum(self._resend(task_id) for task_id in due)

    def _adopt_unsorted_records(self) -> set[str]:
        """The queues with pending jobs; first, if some pending record has no send-time member
        (the client writes both in one transaction, so only an older client's), add the members."""
        queues = set(map(keys.as_text, self.redis.smembers(keys.PENDING_QUEUES_SET)))
        pipe = self.redis.pipeline(transaction=False)
        pipe.hlen(keys.PENDING_HASH)
        for queue in queues:
            pipe.zcard(keys.pending_sent_zset(queue))
        records, *members = pipe.execute()
        if records <= sum(members):
            return queues
        for task_id, info in self.redis.hscan_iter(keys.PENDING_HASH, count=1000):
            record = json.loads(info)
            pipe.zadd(keys.pending_sent_zset(record["queue"]), {keys.as_text(task_id): float(record["submitted_at"])},
                      nx=True)
            pipe.sadd(keys.PENDING_QUEUES_SET, record["queue"])
            queues.add(record["queue"])
        pipe.execute()
        log.info("gave %d pending record(s) of an older client their send-time entries", records - sum(members))
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

    def _missing_from(self, queue: str, held: set[str | None], now: float) -> list[str]:
        """Pending jobs of ``queue`` sent before its head and over ``grace`` ago that no worker holds."""
        cutoff = self._oldest_queued(queue)
        if cutoff is None:
            return []
        sent = keys.pending_sent_zset(queue)
        before = self.redis.zrangebyscore(sent, "-inf", f"({min(cutoff, now - self.grace)!r}")
        candidates = [task_id for task_id in map(keys.as_text, before) if task_id not in held]
        pipe = self.redis.pipeline(transaction=False)
        for task_id in candidates:
            pipe.hexists(keys.PENDING_HASH, task_id)
        recorded = pipe.execute() if candidates else []
        finished = [task_id for task_id, exists in zip(candidates, recorded) if not exists]
        if finished:
            self.redis.zrem(sent, *finished)
        return [task_id for task_id, exists in zip(candidates, recorded) if exists]

    def _oldest_queued(self, queue: str) -> float | None:
        """Send time of the message next in line in ``queue``: +inf if empty, None if unknown."""
        tag = self._head_tag(keys=[queue])
        if tag is None:
            return float("inf")
        task_id = keys.task_id_of_delivery_tag(keys.as_text(tag))
        sent_at = self.redis.zscore(keys.pending_sent_zset(queue), task_id) if task_id else None
        if sent_at is not None:
            return sent_at
        head = self.redis.lindex(queue, -1)  # a tag without a task id, or a finished job's duplicate
        return float("inf") if head is None else _submitted_at_of(head)

    def _resend(self, task_id: str) -> bool:
        """Put a missing job's in-flight message back in its queue; else give it its final result."""
        record: Any = self.redis.hget(keys.PENDING_HASH, task_id)
        if record is None:  # finished meanwhile
            return False
        pending = json.loads(record)
        queue = pending["queue"]
        if self._restore_inflight(keys=[keys.inflight_list(queue), queue], args=[task_id, keys.DELIVERY_TAG_SEPARATOR]):
            self.redis.hdel(keys.SUSPECT_HASH, task_id)
            self.redis.incr(keys.RECOVERED_COUNTER)
            log.warning("message %s was fetched by a worker that died before holding it; put it back in its queue",
                        task_id)
            return True
        found = message_jobs(task_id, pending)
        if found is None:
            return False
        model = keys.queue_model(queue)
        cancelled = {run for run in {run for run, _ in found} if runs.is_cancelled(self.redis, run)}
        results = [runs.cancelled_result(run, job_id, worker=self.node, model=model) if run in cancelled
                   else runs.lost_result(run, job_id, worker=self.node, model=model) for run, job_id in found]
        published = self._end_nowhere(task_id, queue, float(pending["submitted_at"]), results)
        log.log(logging.INFO if cancelled or not published else logging.ERROR,
                "message %s (%d job(s)) is nowhere (not queued, in flight or held): published %d `lost` or "
                "`cancelled` error result(s); the other jobs have a final result or were sent again",
                task_id, len(found), published)
        return False

    def _end_nowhere(self, task_id: str, queue: str, sent_at: float, results: list[Result]) -> int:
        """Publish ``results`` of the jobs of message ``task_id`` (sent at ``sent_at``) that have no
        final result and were not sent again (:data:`PUBLISH_UNLESS_ENDED`), and end its pending
        record, in one transaction; returns how many were published."""
        def send() -> list[Any]:
            pipe = self.redis.pipeline(transaction=True)
            for result in results:
                stream = keys.results_stream(result.run)
                pipe.eval(PUBLISH_UNLESS_ENDED, 5, stream, keys.run_result_ids_hash(result.run),
                          keys.run_status_hash(result.run), keys.run_submitted_hash(result.run),
                          keys.run_cancelled_jobs_set(result.run), keys.RESULT_FIELD, result.model_dump_json(),
                          result.job_id, repr(sent_at), result.status.value,
                          int(result.error_type is ErrorType.cancelled))
            clear_pending(pipe, queue, task_id)
            return pipe.execute()

        replies = wait_out_redis(send, f"ending the jobs of lost message {task_id}", PUBLISH_GIVE_UP_S)
        return sum(int(reply) for reply in replies[:len(results)])
