"""The run ledger: every Redis state change of a job and a run, and nothing else, lives here.

Its Lua sits beside it, one ``.lua`` file per server-side step (read with ``importlib.resources``,
run as redis-py's ``Script``: ``EVALSHA``, loaded again after a Redis restart; queued on a
pipeline, as ``EVAL`` with the text). The
operations, by the step of a job's life they record:

* **submitted**: :func:`record_sent` (each job's latest send time in ``keys.run_submitted_hash``,
  one ``MULTI``), :func:`reopen`, :func:`seal`;
* **pending**: :func:`pending_record`, :func:`push_recorded` (a message and its record, one
  script), :func:`record_pending`, :func:`clear_pending`, :func:`message_jobs` (module doc below);
* **attempts**: :func:`count_starts`, :func:`split_message`, :func:`clear_attempts`;
* **dead letters**: :func:`dead_letter`, :func:`dead_letters`, :func:`remove_dead_letters`;
* **the final publish**: :func:`publish` (``xadd_and_index.lua``: stream entry and its index,
  pub/sub, status, cancelled set, pending record ended, one ``MULTI``) and, for the reconciler,
  :func:`end_lost_message` (``end_lost_message.lua``);
* **cancel**: :func:`cancel` (``cancel.lua``, works at ``maxmemory`` on Redis 7+), :func:`cancelled_runs`;
* **lost**: the reconciler's :func:`head_delivery_tag`, :func:`restore_inflight`,
  :func:`note_suspects`, :func:`adopt_records`, :func:`forget_sent`;
* **trim**: :func:`trim` (``trim_page.lua``, works at ``maxmemory`` on Redis 7+), :func:`forget_run` (delete);
* **certificate**: :func:`record_sample` (a sampled row and its worker, one ``MULTI``), :func:`run_samples`,
  :func:`run_workers`; **captures**: :func:`record_capture`, :func:`captures`, :func:`forget_capture`;
* **consume**: :func:`create_group`, :func:`read_group`, :func:`claim_idle`, :func:`keep_held`,
  :func:`finish` (``finish.lua``), :func:`ack`, :func:`queue_recovered`, :func:`mark_recovered`,
  :func:`take_lock` / :func:`release_lock` (``release_lock.lua``).

The pending ledger: one record per message, written in the same step as the push that
queues the message (:func:`push_recorded`, from the broker transport, for a message that carries
its record in the ``keys.PENDING_HEADER`` header): a record never exists for a message that was
not queued, however long Redis refuses the push, so the reconciler never ends a message that is
still on its way. A record (``keys.PENDING_HASH``: JSON with the queue, the send time and, for a bundle, its
job ids, with the run of each job not of the task id's run; ``keys.pending_sent_zset``: the
send time by queue) lets the reconciler (``layertap.worker.queue.reconciler``) find a message lost
between the queue and a worker: it puts the message back from its queue's in-flight list, or,
where the message is nowhere, gives each of its jobs a final result. No copy of the message's
body is kept. The Client's messages carry one record each (one job, or a bundle of jobs), a worker's one per
half of a bundle it splits; the worker that publishes the message's
last final result removes it in the same transaction (:func:`publish`). A record covers a job
only while the job was not sent again after it: the record is written with each job's latest
send time in the run's submitted hash, so a record older than that time is stale for the job
(the job's newer message has its own record), and a record whose message is gone never ends a
job that has a final result or was sent again, nor a message that is still queued, in flight
or held (:func:`end_lost_message`).

Callers own retries (``redis_conn.retrying``, the worker's ``wait_out_redis``): every function
here is one attempt, and the multi-command ones are one transaction or one script.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import redis
from redis.client import Pipeline

from layertap.protocol import keys
from layertap.protocol.naming import storage_root_of
from layertap.protocol.schema import ErrorType, Result, Status
from layertap.transport.script_flags import lua, run_script

ATTEMPTS_TTL_S = 7 * 24 * 3600
#: How many messages from a queue's head :func:`end_lost_message` searches: restores put messages
#: back at the head, and a queue is in push order (:func:`push_recorded`), so a message sent
#: before the head that is still queued sits among the restored ones there (at most as many as
#: workers held at once).
RESTORED_SCAN = 10000
#: How long a delivery's start token lives: longer than a worker waits out Redis for one call.
START_TOKEN_TTL_S = 3600
TRIM_PAGE = 1000


def _run(client: redis.Redis | Pipeline, name: str, keys: Sequence[str], args: Sequence[Any] = ()) -> Any:
    """Run ``<name>.lua`` beside this module (``script_flags.run_script``)."""
    return run_script(client, lua(__name__, name), keys, args)


# -- results ------------------------------------------------------------------------------
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


# -- submitted and pending ----------------------------------------------------------------
class SentMessage(NamedTuple):
    """A message about to be sent: its queue, task id, ``(run, job id)`` of its jobs, and whether it is a bundle."""

    queue: str
    task_id: str
    jobs: list[tuple[str, str]]
    bundle: bool


def record_sent(client: redis.Redis, messages: Sequence[SentMessage], now: float) -> None:
    """Before sending: each job's latest send time (``keys.run_submitted_hash``), in one transaction.
    Each message's pending record goes with its push (:func:`push_recorded`)."""
    pipe = client.pipeline(transaction=True)
    for message in messages:
        for run, job_id in message.jobs:
            pipe.hset(keys.run_submitted_hash(run), job_id, now)
    pipe.execute()


def reopen(client: redis.Redis, run: str, job_id: str, group: str) -> None:
    """A job sent again: clear its old (error) status and its consumption by ``group``, in one transaction."""
    pipe = client.pipeline(transaction=True)
    pipe.hdel(keys.run_status_hash(run), job_id)
    pipe.hdel(keys.run_consumed_hash(run, group), job_id)
    pipe.execute()


def seal(client: redis.Redis, run: str, sealed: bool = True) -> None:
    """Mark ``run`` fed whole (a streaming consumer stops only on a sealed run), or still being fed."""
    key = keys.run_sealed_key(run)
    if sealed:
        client.set(key, time.time())
    else:
        client.delete(key)


def pending_record(queue: str, task_id: str, now: float, bundle_jobs: Sequence[tuple[str, str]] | None = None) -> str:
    """The JSON record of message ``task_id`` sent to ``queue`` at ``now`` (a bundle's: with the
    ``(run, job id)`` of each of its jobs; runs other than the task id's are kept per job, so a
    lost bundle's results go to each job's own run)."""
    record: dict[str, Any] = {"queue": queue, "submitted_at": now}
    if bundle_jobs is not None:
        own_run = task_id.partition(":")[0]
        record["jobs"] = [job_id for _, job_id in bundle_jobs]
        other_runs = {job_id: run for run, job_id in bundle_jobs if run != own_run}
        if other_runs:
            record["runs"] = other_runs
    return json.dumps(record)


def record_pending(pipe: Pipeline, queue: str, task_id: str, now: float,
                   bundle_jobs: Sequence[tuple[str, str]] | None = None) -> None:
    """Queue on ``pipe`` the record of message ``task_id`` (:func:`pending_record`) without its
    push: what an older client wrote before sending (the tests' stand-in for a message whose push
    was lost)."""
    _write_pending(pipe, task_id, pending_record(queue, task_id, now, bundle_jobs))


def _write_pending(pipe: Pipeline, task_id: str, record: str) -> None:
    fields = json.loads(record)
    queue = fields["queue"]
    pipe.hset(keys.PENDING_HASH, task_id, record)
    pipe.zadd(keys.pending_sent_zset(queue), {task_id: float(fields["submitted_at"])})
    pipe.sadd(keys.PENDING_QUEUES_SET, queue)


def push_recorded(client: redis.Redis, queue_key: str, body: str, task_id: str, record: str) -> None:
    """Queue a message (``LPUSH body`` onto ``queue_key``) with its pending ``record``, in one step
    (``push_recorded.lua``): both or neither, so a record never outlives a push that Redis
    refused. The record's send-time member is the push time on the server's clock."""
    queue = json.loads(record)["queue"]
    _run(client, "push_recorded", [queue_key, keys.PENDING_HASH, keys.pending_sent_zset(queue), keys.PENDING_QUEUES_SET],
         [task_id, record, body, queue])


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


def is_pending(client: redis.Redis, task_id: str) -> bool:
    return bool(client.hexists(keys.PENDING_HASH, task_id))


# -- attempts -----------------------------------------------------------------------------
def count_starts(client: redis.Redis, jobs: Sequence[tuple[str, str]], runs: Sequence[str],
                 token: str) -> tuple[list[int], set[str]]:
    """Count one start of each ``(run, job id)`` of one delivery (``count_starts.lua``: all or
    nothing; each counter lives ``ATTEMPTS_TTL_S``); their counts, and which of ``runs`` are
    cancelled. ``token`` names the delivery: a call repeated with it counts nothing again."""
    replies = _run(client, "count_starts",
                   [keys.start_token_key(token), *(keys.attempts_key(run, job_id) for run, job_id in jobs),
                    *(keys.run_cancelled_key(run) for run in runs)],
                   [len(jobs), ATTEMPTS_TTL_S, START_TOKEN_TTL_S])
    counts = [int(value) for value in replies[:len(jobs)]]
    return counts, {run for run, cancelled in zip(runs, replies[len(jobs):]) if int(cancelled)}


def split_message(client: redis.Redis, jobs: Sequence[tuple[str, str]], queue: str, task_id: str) -> None:
    """A bundle split in two, its halves queued (each with its record): undo one start of each of
    its ``jobs`` and end this one's record, in one transaction."""
    pipe = client.pipeline(transaction=True)
    for run, job_id in jobs:
        pipe.decr(keys.attempts_key(run, job_id))
    clear_pending(pipe, queue, task_id)
    pipe.execute()


def clear_attempts(client: redis.Redis, run: str, job_id: str) -> None:
    client.delete(keys.attempts_key(run, job_id))


# -- dead letters -------------------------------------------------------------------------
def dead_letter(client: redis.Redis, entry: Mapping[str, str]) -> None:
    """Record a job in the dead-letter stream (``keys.DEAD_LETTER_STREAM``)."""
    client.xadd(keys.DEAD_LETTER_STREAM, dict(entry))


def dead_letters(client: redis.Redis, count: int | None = None) -> list[tuple[str, dict[str, str]]]:
    """The dead-letter entries, oldest first: ``(entry id, fields)``."""
    return client.xrange(keys.DEAD_LETTER_STREAM, count=count)


def remove_dead_letters(client: redis.Redis, entry_ids: Sequence[str] | None = None) -> int:
    """Delete dead letters (the given entries, or all); returns how many."""
    if entry_ids:
        return int(client.xdel(keys.DEAD_LETTER_STREAM, *entry_ids))
    pipe = client.pipeline(transaction=True)
    pipe.xlen(keys.DEAD_LETTER_STREAM)
    pipe.delete(keys.DEAD_LETTER_STREAM)
    return int(pipe.execute()[0])


# -- the final publish --------------------------------------------------------------------
def publish(client: redis.Redis, results: Sequence[Result], message: str | None, queue: str | None,
            also_delete: Sequence[str] = ()) -> None:
    """Publish final ``results`` (and delete ``also_delete`` keys) in one transaction: each one's
    stream entry and its id in ``keys.run_result_ids_hash``, pub/sub, status, and a ``cancelled``
    one's job in ``keys.run_cancelled_jobs_set``; with ``message``, the task id whose last
    results these are, end its pending record (its member of ``queue``'s sorted set too)."""
    pipe = client.pipeline(transaction=True)
    for result in results:
        data, stream = result.model_dump_json(), keys.results_stream(result.run)
        _run(pipe, "xadd_and_index", [stream, keys.run_result_ids_hash(result.run)],
             [keys.RESULT_FIELD, data, result.job_id])
        pipe.publish(stream, data)
        pipe.hset(keys.run_status_hash(result.run), result.job_id, result.status.value)
        if result.error_type is ErrorType.cancelled:
            pipe.sadd(keys.run_cancelled_jobs_set(result.run), result.job_id)
    if message is not None:
        clear_pending(pipe, queue, message)
    if also_delete:
        pipe.delete(*also_delete)
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
    reply = _run(client, "end_lost_message", script_keys, args)
    if isinstance(reply, int):
        return None
    return [bool(int(flag)) for flag in reply]


# -- cancel -------------------------------------------------------------------------------
def cancel(client: redis.Redis, run: str) -> None:
    """Mark ``run`` cancelled (idempotent: the first cancel time stays; works at ``maxmemory``). A
    job not yet handed to a worker's engine then ends ``cancelled``; one already there ends as it
    would have."""
    _run(client, "cancel", [keys.run_cancelled_key(run)], [time.time()])


def cancelled_runs(client: redis.Redis, runs: Sequence[str]) -> set[str]:
    """Which of ``runs`` are cancelled (one round trip)."""
    pipe = client.pipeline(transaction=False)
    for run in runs:
        pipe.exists(keys.run_cancelled_key(run))
    return {run for run, flag in zip(runs, pipe.execute()) if flag}


# -- lost (the reconciler) ----------------------------------------------------------------
def head_delivery_tag(client: redis.Redis, queue: str) -> str | None:
    """The delivery tag of the message next in line in ``queue``: None if the queue is empty, ""
    if the message has none (``head_delivery_tag.lua``: only the tag leaves Redis)."""
    tag = _run(client, "head_delivery_tag", [queue])
    return None if tag is None else keys.as_text(tag)


def restore_inflight(client: redis.Redis, task_id: str, queue: str) -> bool:
    """Move task ``task_id``'s message from ``queue``'s in-flight list back to the head of the queue
    (``restore_inflight.lua``); if it was there, clear its suspicion and count the recovery."""
    restored = _run(client, "restore_inflight", [keys.inflight_list(queue), queue],
                    [task_id, keys.DELIVERY_TAG_SEPARATOR])
    if restored:
        client.hdel(keys.SUSPECT_HASH, task_id)
        client.incr(keys.RECOVERED_COUNTER)
    return bool(restored)


def note_suspects(client: redis.Redis, cleared: Sequence[str], found: Mapping[str, float]) -> None:
    """Forget the suspects ``cleared`` and note ``found`` (task id -> first seen), in one round trip."""
    pipe = client.pipeline(transaction=False)
    if cleared:
        pipe.hdel(keys.SUSPECT_HASH, *cleared)
    if found:
        pipe.hset(keys.SUSPECT_HASH, mapping=dict(found))
    pipe.execute()


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


def forget_sent(client: redis.Redis, queue: str, task_ids: Sequence[str]) -> None:
    """Drop finished messages (no pending record any more) from ``queue``'s send times."""
    if task_ids:
        client.zrem(keys.pending_sent_zset(queue), *task_ids)


# -- trim and delete ----------------------------------------------------------------------
def run_names(client: redis.Redis) -> list[str]:
    """Every run the Client has submitted to, by name."""
    return sorted({keys.run_of_submitted_hash(keys.as_text(key))
                   for key in client.scan_iter(match=keys.RUN_SUBMITTED_PATTERN, count=1000)})


def _entry_id(value: str) -> tuple[int, int]:
    milliseconds, _, sequence = value.partition("-")
    return int(milliseconds), int(sequence or 0)


def _after(entry_id: str) -> str:
    """The smallest stream id after ``entry_id``."""
    milliseconds, sequence = _entry_id(entry_id)
    return f"{milliseconds}-{sequence + 1}"


def unconsumed_from(client: redis.Redis, stream: str) -> str | None:
    """The first stream id some consumer group of ``stream`` has not acknowledged (an entry
    pending in it, or the first it has not read); None when no group holds any back."""
    try:
        groups = client.xinfo_groups(stream)
    except redis.exceptions.ResponseError:  # no such stream
        return None
    bounds = []
    for group in groups:
        bounds.append(_after(keys.as_text(group["last-delivered-id"])))
        pending = client.xpending(stream, group["name"])
        if pending["pending"]:
            bounds.append(keys.as_text(pending["min"]))
    return min(bounds, key=_entry_id) if bounds else None


def trim(client: redis.Redis, run: str, *, before: float | None = None) -> int:
    """Drop the run's stream entries published before ``before`` (Unix time; None: every one so
    far) that no consumer group still needs; returns how many were dropped.

    Safe while workers publish: entries are read, then dropped up to the last one read
    (``XTRIM MINID``, exact), and a job's result-id field goes only while it still names a
    dropped entry. The storage roots of dropped ok results go to ``keys.run_roots_set`` first,
    in the same script (``trim_page.lua``, which works at ``maxmemory``). The status and
    submitted hashes are not touched."""
    stream = keys.results_stream(run)
    bounds = [value for value in (unconsumed_from(client, stream),
                                  None if before is None else f"{int(before * 1000)}-0") if value]
    end = f"({min(bounds, key=_entry_id)}" if bounds else "+"
    dropped = 0
    while True:
        entries = client.xrange(stream, min="-", max=end, count=TRIM_PAGE)
        if not entries:
            return dropped
        pairs: list[str] = []
        roots: set[str] = set()
        for entry_id, fields in entries:
            result = entry_result({keys.as_text(name): value for name, value in fields.items()})
            pairs += [result.job_id, keys.as_text(entry_id)]
            root = storage_root_of(result.path, run, result.job_id) if result.ok and result.path else None
            if root is not None:
                roots.add(str(root))
        last = keys.as_text(entries[-1][0])
        _run(client, "trim_page", [keys.run_result_ids_hash(run), stream, keys.run_roots_set(run),
                                   keys.run_trimmed_key(run)], [_after(last), len(roots), *sorted(roots), *pairs, last])
        dropped += len(entries)


def run_keys(client: redis.Redis, run: str) -> list[str]:
    """Every key of ``run``: its results stream, its ``layertap:run:<run>:*`` keys, its attempt counters."""
    found = [keys.results_stream(run)] if client.exists(keys.results_stream(run)) else []
    for pattern in (keys.run_keys_pattern(run), keys.attempts_pattern(run)):
        found.extend(keys.as_text(key) for key in client.scan_iter(match=pattern, count=1000))
    return found


def remove_queued(client: redis.Redis, queue: str, run: str) -> None:
    """Remove the messages of ``run``'s tasks from ``queue`` (a Celery queue: a Redis list)."""
    prefix = keys.task_id(run, "")
    for raw in client.lrange(queue, 0, -1):
        try:
            task_id = json.loads(raw)["headers"]["id"]
        except (ValueError, KeyError, TypeError):
            continue
        if isinstance(task_id, str) and task_id.startswith(prefix):
            client.lrem(queue, 1, raw)


def forget_run(client: redis.Redis, run: str) -> None:
    """Remove every key of ``run`` (:func:`run_keys`) and its messages' pending records and send times."""
    prefix = keys.task_id(run, "")
    pipe = client.pipeline(transaction=False)
    for pending in (keys.PENDING_HASH, keys.SUSPECT_HASH):
        task_ids = [keys.as_text(task_id) for task_id, _ in client.hscan_iter(pending, match=f"{prefix}*")]
        if task_ids:
            pipe.hdel(pending, *task_ids)
    for queue in map(keys.as_text, client.smembers(keys.PENDING_QUEUES_SET)):
        sent = keys.pending_sent_zset(queue)
        task_ids = [keys.as_text(task_id) for task_id, _ in client.zscan_iter(sent, match=f"{prefix}*")]
        if task_ids:
            pipe.zrem(sent, *task_ids)
    for key in run_keys(client, run):
        pipe.delete(key)
    pipe.execute()


# -- certificate and captures -------------------------------------------------------------
def record_sample(client: redis.Redis, run: str, job_id: str, row: str, worker: str, facts: str) -> None:
    """Record a sampled row of ``run`` (JSON ``certificate.SampleRow``) and what its ``worker`` is
    (JSON ``facts``), in one transaction."""
    pipe = client.pipeline(transaction=True)
    pipe.hset(keys.run_samples_hash(run), job_id, row)
    pipe.hset(keys.run_workers_hash(run), worker, facts)
    pipe.execute()


def run_samples(client: redis.Redis, run: str) -> dict[str, str]:
    """job id -> JSON sampled row, of every sampled row of ``run``."""
    return {keys.as_text(job_id): keys.as_text(row) for job_id, row in
            client.hscan_iter(keys.run_samples_hash(run), count=1000)}


def run_workers(client: redis.Redis, run: str) -> dict[str, str]:
    """node -> JSON facts, of every worker that sampled rows of ``run``."""
    return {keys.as_text(node): keys.as_text(facts) for node, facts in client.hgetall(keys.run_workers_hash(run)).items()}


def record_capture(client: redis.Redis, capture_key: str, address: str) -> None:
    """Note the file at ``address`` as one holding the computed states of ``capture_key``."""
    client.hset(keys.capture_hash(capture_key), address, "")


def captures(client: redis.Redis, capture_key: str) -> list[str]:
    """The addresses noted for ``capture_key``, sorted."""
    return sorted(keys.as_text(address) for address in client.hkeys(keys.capture_hash(capture_key)))


def forget_capture(client: redis.Redis, capture_key: str, address: str) -> None:
    """Drop a noted address whose file is gone or is not of the capture."""
    client.hdel(keys.capture_hash(capture_key), address)


# -- consume ------------------------------------------------------------------------------
def create_group(client: redis.Redis, stream: str, group: str) -> None:
    """Create consumer group ``group`` on ``stream`` (and the stream) from its start, unless it exists."""
    try:
        client.xgroup_create(stream, group, id="0", mkstream=True)
    except redis.exceptions.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


def finish(client: redis.Redis | Pipeline, stream: str, run: str, group: str, entry_id: str, job_id: str,
           status: Status) -> None:
    """Acknowledge ``group``'s entry and record its job as consumed with ``status`` (an error only
    while it is still the job's status), in one step (``finish.lua``); on a pipeline, queued."""
    _run(client, "finish", [stream, keys.run_consumed_hash(run, group), keys.run_status_hash(run)],
         [group, entry_id, job_id, status.value])


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


def ack(client: redis.Redis, stream: str, group: str, entry_id: str) -> None:
    """Acknowledge an entry that is not a job's result to consume."""
    client.xack(stream, group, entry_id)


def queue_recovered(client: redis.Redis, run: str, group: str, job_ids: Sequence[str]) -> None:
    """Queue jobs ``group`` missed on its recovery stream (``keys.run_recovery_stream``), one round trip."""
    pipe = client.pipeline(transaction=False)
    for job_id in job_ids:
        pipe.xadd(keys.run_recovery_stream(run, group), {keys.RECOVERY_JOB_FIELD: job_id})
    pipe.execute()


def mark_recovered(client: redis.Redis, run: str, group: str, marker: str) -> None:
    """``group`` has its missed jobs queued up to the trim ``marker`` (``keys.run_trimmed_key``)."""
    client.set(keys.run_recovered_key(run, group), marker)


def take_lock(client: redis.Redis, lock: str, token: str, ttl_ms: int) -> bool:
    return bool(client.set(lock, token, nx=True, px=ttl_ms))


def release_lock(client: redis.Redis, lock: str, token: str) -> None:
    """Delete ``lock`` only while ``token`` holds it (``release_lock.lua``)."""
    _run(client, "release_lock", [lock], [token])

