"""What was sent, and the pending ledger the reconciler reads.

Before sending, each job's latest send time goes to its run's submitted hash (:func:`record_sent`),
and again with the push where a failover dropped it; a job sent again (by any sender) loses its old
result's status and consumption with the push (the record's ``reopen``). Each message has one
pending record, written in the same step as the push that queues it (:func:`push_recorded`, from
the broker transport, for a message that carries its record in the ``keys.PENDING_HEADER``
header): a record never exists for a message that was not queued, however long Redis refuses the
push, so the reconciler never ends a message that is still on its way. A record
(``keys.PENDING_HASH``: JSON with the queue, the send time and, for a bundle, its job ids, with
the run of each job not of the task id's run, and the groups of each job it reopens;
``keys.pending_sent_zset``: the send time by queue) lets the reconciler
(``layertap.worker.queue.reconciler``) find a message lost between the queue and a worker: it puts
the message back from its queue's in-flight list (:func:`restore_inflight`), or, where the message
is nowhere, gives each of its jobs a final result (``results.end_lost_message``). No copy of the
message's body is kept. The Client's messages carry one record each (one job, or a bundle of jobs),
a worker's one per half of a bundle it splits; the worker that publishes the message's last final
result removes it in the same transaction (``results.publish``). A record covers a job only while
the job was not sent again after it: the record is written with each job's latest send time in the
run's submitted hash, so a record older than that time is stale for the job (the job's newer message
has its own record), and a record whose message is gone never ends a job that has a final result or
was sent again, nor a message that is still queued, in flight or held.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import redis
from redis.client import Pipeline

from layertap.protocol import keys
from layertap.transport.ledger.script import run_lua


class SentMessage(NamedTuple):
    """A message about to be sent: its queue, task id, ``(run, job id)`` of its jobs, and whether it is a bundle."""

    queue: str
    task_id: str
    jobs: list[tuple[str, str]]
    bundle: bool


def record_sent(client: redis.Redis, messages: Sequence[SentMessage], now: float) -> set[tuple[str, str]]:
    """Before sending: each job's latest send time (``keys.run_submitted_hash``), in one transaction.
    Returns the ``(run, job id)`` of the jobs sent before (a send time was there already: the hash
    keeps one per job sent, until the run is deleted), which the push must reopen
    (:func:`pending_record`). Each message's pending record goes with its push (:func:`push_recorded`)."""
    pipe = client.pipeline(transaction=True)
    pairs = [pair for message in messages for pair in message.jobs]
    for run, job_id in pairs:
        pipe.hset(keys.run_submitted_hash(run), job_id, now)
    return {pair for pair, added in zip(pairs, pipe.execute()) if not added}


def seal(client: redis.Redis, run: str, sealed: bool = True) -> None:
    """Mark ``run`` fed whole (a streaming consumer stops only on a sealed run), or still being fed."""
    key = keys.run_sealed_key(run)
    if sealed:
        client.set(key, time.time())
    else:
        client.delete(key)


def pending_record(queue: str, task_id: str, now: float, bundle_jobs: Sequence[tuple[str, str]] | None = None,
                   reopen: Mapping[str, Sequence[str]] | None = None) -> str:
    """The JSON record of message ``task_id`` sent to ``queue`` at ``now`` (a bundle's: with the
    ``(run, job id)`` of each of its jobs; runs other than the task id's are kept per job, so a
    lost bundle's results go to each job's own run). ``reopen``: job id -> consumer groups, for
    jobs sent again whose old result (status, and consumption by those groups) the push clears
    (:func:`push_recorded`)."""
    record: dict[str, Any] = {"queue": queue, "submitted_at": now}
    if bundle_jobs is not None:
        own_run = task_id.partition(":")[0]
        record["jobs"] = [job_id for _, job_id in bundle_jobs]
        other_runs = {job_id: run for run, job_id in bundle_jobs if run != own_run}
        if other_runs:
            record["runs"] = other_runs
    if reopen:
        record["reopen"] = {job_id: list(groups) for job_id, groups in reopen.items()}
    return json.dumps(record)


def record_pending(pipe: Pipeline, queue: str, task_id: str, now: float,
                   bundle_jobs: Sequence[tuple[str, str]] | None = None) -> None:
    """Queue on ``pipe`` the record of message ``task_id`` (:func:`pending_record`) without its
    push: what an older client wrote before sending (the tests' stand-in for a message whose push
    was lost)."""
    record = pending_record(queue, task_id, now, bundle_jobs)
    pipe.hset(keys.PENDING_HASH, task_id, record)
    pipe.zadd(keys.pending_sent_zset(queue), {task_id: now})
    pipe.sadd(keys.PENDING_QUEUES_SET, queue)


def push_recorded(client: redis.Redis, queue_key: str, body: str, task_id: str, record: str) -> None:
    """Queue a message (``LPUSH body`` onto ``queue_key``) with its pending ``record``, in one step
    (``push_recorded.lua``): both or neither, so a record never outlives a push that Redis
    refused. The record's send-time member is the push time on the server's clock. Each job's
    send time goes to its run's submitted hash in the same step where the hash has none
    (:func:`record_sent` wrote it first, maybe on a primary a failover dropped since): a queued
    job always counts in its run's total. On the message's first push (no record of it yet), each
    job the record reopens (a job sent again) loses its old
    status, its latest-entry index (``keys.run_result_ids_hash``: ``Client.wait`` waits for the new
    result) and its consumption by the groups the record names, in the same step: a job whose new
    message is queued is never final with its old result, whichever primary took the message; a
    later push of it (a retry) clears nothing."""
    parsed = json.loads(record)
    jobs = message_jobs(task_id, parsed) or []
    reopen = parsed.get("reopen") or {}
    reopened = [(run, job_id, list(reopen[job_id])) for run, job_id in jobs if job_id in reopen]
    cleared = [key for run, _, groups in reopened
               for key in (keys.run_status_hash(run), keys.run_result_ids_hash(run),
                           *(keys.run_consumed_hash(run, group) for group in groups))]
    run_lua(client, "push_recorded",
            [queue_key, keys.PENDING_HASH, keys.pending_sent_zset(parsed["queue"]), keys.PENDING_QUEUES_SET,
             *(keys.run_submitted_hash(run) for run, _ in jobs), *cleared],
            [task_id, record, body, parsed["queue"], parsed["submitted_at"], len(jobs), *(job_id for _, job_id in jobs),
             *(arg for _, job_id, groups in reopened for arg in (job_id, len(groups)))])


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


# -- reading records ----------------------------------------------------------------------
def is_pending(client: redis.Redis, task_id: str) -> bool:
    """Whether message ``task_id`` has a pending record (it has not ended)."""
    return bool(client.hexists(keys.PENDING_HASH, task_id))


def record_of(client: redis.Redis, task_id: str) -> dict[str, Any] | None:
    """Message ``task_id``'s pending record (None: it has ended)."""
    record = client.hget(keys.PENDING_HASH, task_id)
    return None if record is None else json.loads(record)


def records_of(client: redis.Redis, task_ids: Sequence[str]) -> list[dict[str, Any] | None]:
    """The pending record of each of ``task_ids`` (None: ended), one round trip."""
    return [None if record is None else json.loads(record)
            for record in (client.hmget(keys.PENDING_HASH, list(task_ids)) if task_ids else [])]


def run_records(client: redis.Redis, run: str, most: int | None = None) -> list[dict[str, Any]]:
    """The pending records of ``run``'s messages (up to ``most``)."""
    found: list[dict[str, Any]] = []
    for _, record in client.hscan_iter(keys.PENDING_HASH, match=f"{keys.task_id(run, '')}*", count=1000):
        found.append(json.loads(record))
        if most is not None and len(found) >= most:
            break
    return found


# -- the reconciler -----------------------------------------------------------------------
def suspects(client: redis.Redis) -> dict[str, float]:
    """Task id -> when the reconciler first found its message neither queued, held nor finished."""
    return {keys.as_text(task_id): float(seen) for task_id, seen in client.hgetall(keys.SUSPECT_HASH).items()}


def note_suspects(client: redis.Redis, cleared: Sequence[str], found: Mapping[str, float]) -> None:
    """Forget the suspects ``cleared`` and note ``found`` (task id -> first seen), in one round trip."""
    pipe = client.pipeline(transaction=False)
    if cleared:
        pipe.hdel(keys.SUSPECT_HASH, *cleared)
    if found:
        pipe.hset(keys.SUSPECT_HASH, mapping=dict(found))
    pipe.execute()


def pending_queues(client: redis.Redis) -> tuple[set[str], int]:
    """The queues with pending messages, and how many records lack their send-time member (a
    client older than the sorted sets wrote records without: :func:`adopt_records`)."""
    queues = set(map(keys.as_text, client.smembers(keys.PENDING_QUEUES_SET)))
    pipe = client.pipeline(transaction=False)
    pipe.hlen(keys.PENDING_HASH)
    for queue in queues:
        pipe.zcard(keys.pending_sent_zset(queue))
    records, *members = pipe.execute()
    return queues, max(0, records - sum(members))


def adopt_records(client: redis.Redis) -> set[str]:
    """Give every pending record its send-time member (records of a client older than the sorted
    sets have none); the queues they name."""
    pipe = client.pipeline(transaction=False)
    queues: set[str] = set()
    for task_id, info in client.hscan_iter(keys.PENDING_HASH, count=1000):
        record = json.loads(info)
        pipe.zadd(keys.pending_sent_zset(record["queue"]), {keys.as_text(task_id): float(record["submitted_at"])},
                  nx=True)
        pipe.sadd(keys.PENDING_QUEUES_SET, record["queue"])
        queues.add(record["queue"])
    pipe.execute()
    return queues


def sent_before(client: redis.Redis, queue: str, before: float) -> dict[str, float]:
    """Task id -> send time of ``queue``'s pending messages sent before ``before`` (a member whose
    record has ended may be among them: :func:`ended_of`)."""
    sent = client.zrangebyscore(keys.pending_sent_zset(queue), "-inf", f"({before!r}", withscores=True)
    return {keys.as_text(task_id): float(at) for task_id, at in sent}


def ended_of(client: redis.Redis, task_ids: Sequence[str]) -> set[str]:
    """Which of ``task_ids`` have no pending record any more (one round trip)."""
    pipe = client.pipeline(transaction=False)
    for task_id in task_ids:
        pipe.hexists(keys.PENDING_HASH, task_id)
    return {task_id for task_id, exists in zip(task_ids, pipe.execute() if task_ids else []) if not exists}


def forget_sent(client: redis.Redis, queue: str, task_ids: Sequence[str]) -> None:
    """Drop ended messages (no pending record any more) from ``queue``'s send times."""
    if task_ids:
        client.zrem(keys.pending_sent_zset(queue), *task_ids)


def sent_at(client: redis.Redis, queue: str, task_id: str) -> float | None:
    """When pending message ``task_id`` of ``queue`` was pushed (None: no such member)."""
    found = client.zscore(keys.pending_sent_zset(queue), task_id)
    return None if found is None else float(found)


def head_delivery_tag(client: redis.Redis, queue: str) -> str | None:
    """The delivery tag of the message next in line in ``queue``: None if the queue is empty, ""
    if the message has none (``head_delivery_tag.lua``: only the tag leaves Redis)."""
    tag = run_lua(client, "head_delivery_tag", [queue])
    return None if tag is None else keys.as_text(tag)


def restore_inflight(client: redis.Redis, task_id: str, queue: str) -> bool:
    """Move task ``task_id``'s message from ``queue``'s in-flight list back to the head of the queue
    (``restore_inflight.lua``); if it was there, clear its suspicion and count the recovery."""
    restored = run_lua(client, "restore_inflight", [keys.inflight_list(queue), queue],
                       [task_id, keys.DELIVERY_TAG_SEPARATOR])
    if restored:
        client.hdel(keys.SUSPECT_HASH, task_id)
        client.incr(keys.RECOVERED_COUNTER)
    return bool(restored)
