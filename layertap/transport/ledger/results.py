"""Final results: the one parser of a results-stream entry, the results the ledger itself gives
(cancelled, lost), the final publish, and reading a run's results.

The final publish (:func:`publish`) is one ``MULTI``: each result's stream entry and its id in
``keys.run_result_ids_hash`` (``xadd_and_index.lua``), pub/sub, status, a ``cancelled`` one's
job in ``keys.run_cancelled_jobs_set``, the attempt counters of the jobs it ends, and the end of
the message's pending record. The reconciler's :func:`end_lost_message` (``end_lost_message.lua``)
publishes only what is still lost, in one script.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import redis

from layertap.protocol import keys
from layertap.protocol.schema import ErrorType, Result, Status
from layertap.transport.ledger.pending import clear_pending
from layertap.transport.ledger.script import run_lua

#: How many messages from a queue's head :func:`end_lost_message` searches: restores put messages
#: back at the head, and a queue is in push order (``pending.push_recorded``), so a message sent
#: before the head that is still queued sits among the restored ones there (at most as many as
#: workers held at once).
RESTORED_SCAN = 10000


def entry_result(fields: Mapping[str, str]) -> Result:
    """The result of one results-stream entry. Raises ``KeyError`` (no result field) or ``ValidationError``."""
    return Result.model_validate_json(fields[keys.RESULT_FIELD])


def cancelled_error(run: str) -> str:
    """The error message of a job of ``run`` not run because the run was cancelled."""
    return f"run {run} was cancelled (layertap runs cancel); this job was not run"


def cancelled_result(run: str, job_id: str, *, worker: str | None, model: str | None = None,
                     metadata: str | None = None) -> Result:
    """The final result of a job of a cancelled run that was not run."""
    return Result(job_id=job_id, run=run, status=Status.error, error_type=ErrorType.cancelled,
                  error=cancelled_error(run), model=model, worker=worker, metadata=metadata)


def lost_result(run: str, job_id: str, *, worker: str | None, model: str | None = None) -> Result:
    """The final result of a job whose message is gone before any worker held it (the reconciler's)."""
    return Result(job_id=job_id, run=run, status=Status.error, error_type=ErrorType.lost,
                  error=f"job {job_id}'s message was lost before a worker took it (the queue was purged, or the "
                        "client died before sending it); this job was not run: `layertap enqueue` sends it again",
                  model=model, worker=worker)


def publish(client: redis.Redis, results: Sequence[Result], message: str | None, queue: str | None,
            ended: Sequence[tuple[str, str]] = ()) -> None:
    """Publish final ``results`` in one transaction: each one's stream entry and its id in
    ``keys.run_result_ids_hash``, pub/sub, status, and a ``cancelled`` one's job in
    ``keys.run_cancelled_jobs_set``; the attempt counters of the ``(run, job id)`` in ``ended``
    deleted; with ``message``, the task id whose last results these are, its pending record
    ended (its member of ``queue``'s sorted set too)."""
    pipe = client.pipeline(transaction=True)
    for result in results:
        data, stream = result.model_dump_json(), keys.results_stream(result.run)
        run_lua(pipe, "xadd_and_index", [stream, keys.run_result_ids_hash(result.run)],
                [keys.RESULT_FIELD, data, result.job_id])
        pipe.publish(stream, data)
        pipe.hset(keys.run_status_hash(result.run), result.job_id, result.status.value)
        if result.error_type is ErrorType.cancelled:
            pipe.sadd(keys.run_cancelled_jobs_set(result.run), result.job_id)
    if message is not None:
        clear_pending(pipe, queue, message)
    if ended:
        pipe.delete(*(keys.attempts_key(run, job_id) for run, job_id in ended))
    pipe.execute()


def end_lost_message(client: redis.Redis, results: Sequence[Result], message: str, queue: str,
                     sent_at: float) -> list[bool] | None:
    """The reconciler's end of message ``message`` of ``queue`` (sent at ``sent_at``), found nowhere:
    one script (``end_lost_message.lua``) that first looks for it in the queue's head region, its
    in-flight list and kombu's ``unacked`` keys, and changes nothing if it is there (None); else
    publishes each of ``results`` unless its job has a final result or was sent again, and ends the
    message's record. Returns whether each was published."""
    script_keys = [queue, keys.inflight_list(queue), keys.UNACKED_HASH, keys.PENDING_HASH, keys.SUSPECT_HASH,
                   keys.pending_sent_zset(queue)]
    args: list[Any] = [message, keys.DELIVERY_TAG_SEPARATOR, repr(sent_at), RESTORED_SCAN]
    for result in results:
        script_keys += [keys.results_stream(result.run), keys.run_result_ids_hash(result.run),
                        keys.run_status_hash(result.run), keys.run_submitted_hash(result.run),
                        keys.run_cancelled_jobs_set(result.run)]
        args += [keys.RESULT_FIELD, result.model_dump_json(), result.job_id, result.status.value,
                 int(result.error_type is ErrorType.cancelled)]
    reply = run_lua(client, "end_lost_message", script_keys, args)
    if isinstance(reply, int):
        return None
    return [bool(int(flag)) for flag in reply]


# -- reading ------------------------------------------------------------------------------
def read_results(client: redis.Redis, run: str, after: str = "0", *, count: int = 1000,
                 block_ms: int | None = None) -> list[tuple[str, Result]]:
    """Up to ``count`` ``(entry id, result)`` of ``run``'s stream after stream id ``after``; with
    ``block_ms``, wait that long for one to come when there are none. ``client`` decodes responses."""
    batches = client.xread({keys.results_stream(run): after}, count=count, block=block_ms)
    return [(entry_id, entry_result(fields)) for entry_id, fields in (batches[0][1] if batches else [])]


def last_entry_id(client: redis.Redis, run: str) -> str | None:
    """The id of the last entry of ``run``'s results stream (None: empty)."""
    last = client.xrevrange(keys.results_stream(run), count=1)
    return keys.as_text(last[0][0]) if last else None


def results_at(client: redis.Redis, run: str, entry_ids: Sequence[str | None]) -> list[Result | None]:
    """The result of each of ``run``'s stream entries ``entry_ids`` (None: none given, or trimmed
    since), one round trip."""
    stream = keys.results_stream(run)
    pipe = client.pipeline(transaction=False)
    for entry_id in entry_ids:
        if entry_id is not None:
            pipe.xrange(stream, entry_id, entry_id)
    replies = iter(pipe.execute() if any(entry_id is not None for entry_id in entry_ids) else [])
    found: list[Result | None] = []
    for entry_id in entry_ids:
        entries = next(replies) if entry_id is not None else []
        found.append(entry_result({keys.as_text(name): value for name, value in entries[0][1].items()})
                     if entries else None)
    return found


def latest_entry_ids(client: redis.Redis, run: str, job_ids: Sequence[str]) -> list[str | None]:
    """The stream id of each job's latest entry in ``run``'s stream (``keys.run_result_ids_hash``;
    None: none, or trimmed)."""
    return [None if value is None else keys.as_text(value)
            for value in client.hmget(keys.run_result_ids_hash(run), list(job_ids))]


def published_snapshot(client: redis.Redis, run: str, job_ids: Sequence[str]
                       ) -> tuple[str | None, list[str | None], list[str | None]]:
    """One moment (``MULTI``) of ``run``: its stream's last entry id, and for each of ``job_ids``
    its latest entry id (``keys.run_result_ids_hash``) and its status."""
    pipe = client.pipeline(transaction=True)
    pipe.xrevrange(keys.results_stream(run), count=1)
    pipe.hmget(keys.run_result_ids_hash(run), list(job_ids))
    pipe.hmget(keys.run_status_hash(run), list(job_ids))
    last, entry_ids, statuses = pipe.execute()
    text = [None if value is None else keys.as_text(value) for value in entry_ids]
    return (keys.as_text(last[0][0]) if last else None), text, [
        None if value is None else keys.as_text(value) for value in statuses]


def follow_published(client: redis.Redis, run: str) -> Iterator[Result]:
    """``run``'s results as they are published (pub/sub: at-most-once), until closed."""
    pubsub = client.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(keys.results_stream(run))
    try:
        for message in pubsub.listen():
            yield Result.model_validate_json(message["data"])
    finally:
        pubsub.close()
