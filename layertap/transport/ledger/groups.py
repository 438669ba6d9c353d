"""A run's consumer groups (a streaming trainer's): reading the run's results stream and the
group's recovery stream through the group, holding and finishing entries, and what the group
consumed; the recovery stream is filled from the ledger with the jobs the group missed (their
entries trimmed before it read them: ``layertap.producer.client.recovery``).

Finishing an entry acknowledges it and records its job as consumed with its status, in one step
(``finish.lua``): an error only while it is still the job's status.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import redis
from redis.client import Pipeline

from layertap.protocol import keys
from layertap.protocol.schema import Status
from layertap.transport.ledger.script import run_lua

#: Entries read per round trip of the recovery stream.
PAGE = 1000


def group_streams(run: str, group: str) -> tuple[str, str]:
    """The streams ``group`` reads of ``run``: its results stream and the group's recovery stream."""
    return keys.results_stream(run), keys.run_recovery_stream(run, group)


def group_names(client: redis.Redis, run: str) -> list[str]:
    """The consumer groups of ``run``'s results stream (none while it has no stream)."""
    try:
        return [keys.as_text(group["name"]) for group in client.xinfo_groups(keys.results_stream(run))]
    except redis.exceptions.ResponseError:  # no such stream
        return []


def create_group(client: redis.Redis, stream: str, group: str) -> None:
    """Create consumer group ``group`` on ``stream`` (and the stream) from its start, unless it exists."""
    try:
        client.xgroup_create(stream, group, id="0", mkstream=True)
    except redis.exceptions.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


def read_group(client: redis.Redis, group: str, consumer: str, streams: Mapping[str, str], count: int,
               block_ms: int | None = None) -> list[Any]:
    """``XREADGROUP``: entries of ``streams`` (stream -> after id; ``>``: new ones) now held by ``consumer``."""
    return client.xreadgroup(group, consumer, dict(streams), count=count, block=block_ms)


def claim_idle(client: redis.Redis, stream: str, group: str, consumer: str, idle_ms: int, start: str,
               count: int) -> list[Any]:
    """``XAUTOCLAIM``: ``consumer`` takes over entries idle ``idle_ms`` (a dead consumer's), from cursor ``start``."""
    return client.xautoclaim(stream, group, consumer, min_idle_time=idle_ms, start_id=start, count=count)


def keep_held(client: redis.Redis, stream: str, group: str, consumer: str, entry_ids: Sequence[str]) -> list[Any]:
    """Reset the idle time of entries ``consumer`` holds (``XCLAIM ... JUSTID``); the ids it still holds."""
    return client.xclaim(stream, group, consumer, min_idle_time=0, message_ids=list(entry_ids), justid=True)


def held_outside(client: redis.Redis, streams: Sequence[str], group: str, consumers: set[str]) -> bool:
    """Whether a consumer of ``group`` other than ``consumers`` holds an entry of ``streams``."""
    for stream in streams:
        for consumer in client.xpending(stream, group)["consumers"]:
            if consumer["pending"] and keys.as_text(consumer["name"]) not in consumers:
                return True
    return False


def finish(client: redis.Redis | Pipeline, stream: str, run: str, group: str, entry_id: str, job_id: str,
           status: Status) -> None:
    """Acknowledge ``group``'s entry and record its job as consumed with ``status`` (an error only
    while it is still the job's status), in one step (``finish.lua``); on a pipeline, queued."""
    run_lua(client, "finish", [stream, keys.run_consumed_hash(run, group), keys.run_status_hash(run)],
            [group, entry_id, job_id, status.value])


def finish_many(client: redis.Redis, run: str, group: str, entries: Sequence[tuple[str, str, str]],
                status: Status) -> None:
    """:func:`finish` each ``(stream, entry id, job id)`` of ``entries``, in one round trip."""
    pipe = client.pipeline(transaction=False)
    for stream, entry_id, job_id in entries:
        finish(pipe, stream, run, group, entry_id, job_id, status)
    pipe.execute()


def mark_consumed(client: redis.Redis, run: str, group: str, job_id: str, status: Status) -> None:
    """Record ``job_id`` as consumed by ``group`` with ``status``, for a consumer that takes jobs by
    id rather than through the group's streams (a trainer reading rows of a run)."""
    client.hset(keys.run_consumed_hash(run, group), job_id, status.value)


def ack(client: redis.Redis, stream: str, group: str, entry_id: str) -> None:
    """Acknowledge an entry that is not a job's result to consume."""
    client.xack(stream, group, entry_id)


def consumed(client: redis.Redis, run: str, group: str, job_id: str) -> str | None:
    """How ``group`` consumed ``job_id`` so far (``ok``, ``error``), or None."""
    found = client.hget(keys.run_consumed_hash(run, group), job_id)
    return None if found is None else keys.as_text(found)


def group_state(client: redis.Redis, run: str, group: str) -> tuple[bool, int, int, int]:
    """``run`` as ``group`` sees it, in one round trip: sealed, jobs submitted, jobs final, jobs
    the group consumed."""
    pipe = client.pipeline(transaction=False)
    pipe.exists(keys.run_sealed_key(run))
    pipe.hlen(keys.run_submitted_hash(run))
    pipe.hlen(keys.run_status_hash(run))
    pipe.hlen(keys.run_consumed_hash(run, group))
    sealed, submitted, final, taken = pipe.execute()
    return bool(sealed), int(submitted), int(final), int(taken)


# -- the recovery stream ------------------------------------------------------------------
def recovered_marker(client: redis.Redis, run: str, group: str) -> str | None:
    """The trim marker (``keys.run_trimmed_key``) through which ``group``'s recovery stream was filled."""
    marker = client.get(keys.run_recovered_key(run, group))
    return None if marker is None else keys.as_text(marker)


def recovery_page(client: redis.Redis, run: str, group: str, after: str = "-") -> tuple[list[str], str | None]:
    """One page of the job ids queued on ``group``'s recovery stream from stream id bound ``after``,
    and the bound of the next page (None: this was the last)."""
    entries = client.xrange(keys.run_recovery_stream(run, group), min=after, count=PAGE)
    jobs = [keys.as_text(fields[keys.RECOVERY_JOB_FIELD]) for _, fields in entries]
    return jobs, f"({keys.as_text(entries[-1][0])}" if len(entries) == PAGE else None


def missed_of(client: redis.Redis, run: str, group: str, job_ids: Sequence[str]) -> list[bool]:
    """For each of ``job_ids`` (jobs with a final status), whether ``group`` missed it: its latest
    entry is trimmed (no field in ``keys.run_result_ids_hash``) and the group has not consumed it
    (one moment: ``MULTI``)."""
    pipe = client.pipeline(transaction=True)
    pipe.hmget(keys.run_result_ids_hash(run), list(job_ids))
    pipe.hmget(keys.run_consumed_hash(run, group), list(job_ids))
    indexed, taken = pipe.execute() if job_ids else ([], [])
    return [entry_id is None and was is None for entry_id, was in zip(indexed, taken, strict=True)]


def queue_recovered(client: redis.Redis, run: str, group: str, job_ids: Sequence[str]) -> None:
    """Queue jobs ``group`` missed on its recovery stream (``keys.run_recovery_stream``), one round trip."""
    pipe = client.pipeline(transaction=False)
    for job_id in job_ids:
        pipe.xadd(keys.run_recovery_stream(run, group), {keys.RECOVERY_JOB_FIELD: job_id})
    pipe.execute()


def mark_recovered(client: redis.Redis, run: str, group: str, marker: str) -> None:
    """``group`` has its missed jobs queued up to the trim ``marker`` (``keys.run_trimmed_key``)."""
    client.set(keys.run_recovered_key(run, group), marker)


def take_recovery_lock(client: redis.Redis, run: str, group: str, token: str, ttl_ms: int) -> bool:
    """Take the lock under which one consumer of ``group`` fills its recovery stream."""
    return bool(client.set(keys.run_recovery_lock(run, group), token, nx=True, px=ttl_ms))


def release_recovery_lock(client: redis.Redis, run: str, group: str, token: str) -> None:
    """Release that lock only while ``token`` holds it (``release_lock.lua``)."""
    run_lua(client, "release_lock", [keys.run_recovery_lock(run, group)], [token])
