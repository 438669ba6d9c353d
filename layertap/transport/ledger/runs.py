"""A run as the ledger holds it: its counts and statuses, where its trimmed files are, its
trim (the retention), and its keys, deleted with it.

A run exists once the Client has recorded a job in its submitted hash (or a worker has published
a result to its stream). Its progress is the length of that hash against the length of its
status hash (one entry per job with a final result). A trim (:func:`trim`) drops results-stream
entries but keeps the compact ledger: the status and submitted hashes and the storage roots of
the dropped ok results (``keys.run_roots_set``).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Container, Iterator, Mapping, Sequence

import redis

from layertap.protocol import keys
from layertap.protocol.naming import storage_root_of
from layertap.protocol.schema import Status
from layertap.transport.ledger.results import entry_result
from layertap.transport.ledger.script import run_lua

#: Results-stream entries one trim script drops at a time (each page one ``trim_page.lua`` call).
TRIM_PAGE = 1000
#: Hash fields read per round trip.
PAGE = 1000


def run_names(client: redis.Redis) -> list[str]:
    """Every run the Client has submitted to, by name."""
    return sorted({keys.run_of_submitted_hash(keys.as_text(key))
                   for key in client.scan_iter(match=keys.RUN_SUBMITTED_PATTERN, count=1000)})


def exists(client: redis.Redis, run: str) -> bool:
    """Jobs were submitted to ``run`` or results were published to it."""
    return bool(client.exists(keys.run_submitted_hash(run), keys.results_stream(run)))


def counts(client: redis.Redis, run: str) -> tuple[int, int, float | None]:
    """``run``'s jobs submitted, jobs with a final result, and when it was cancelled (None: it is
    not), in one round trip."""
    pipe = client.pipeline(transaction=False)
    pipe.hlen(keys.run_submitted_hash(run))
    pipe.hlen(keys.run_status_hash(run))
    pipe.get(keys.run_cancelled_key(run))
    submitted, finished, cancelled = pipe.execute()
    return int(submitted), int(finished), None if cancelled is None else float(cancelled)


def is_cancelled(client: redis.Redis, run: str) -> bool:
    """``run`` was cancelled (``attempts.cancel``): its jobs not yet in an engine end ``cancelled``."""
    return bool(client.exists(keys.run_cancelled_key(run)))


def in_flight(client: redis.Redis, runs: Sequence[str], group: str | None = None) -> int:
    """Jobs of ``runs`` submitted and not yet final (``group`` given: not yet consumed by it), one round trip."""
    pipe = client.pipeline(transaction=False)
    for run in runs:
        pipe.hlen(keys.run_submitted_hash(run))
        pipe.hlen(keys.run_consumed_hash(run, group) if group is not None else keys.run_status_hash(run))
    found = pipe.execute() if runs else []
    return sum(max(0, submitted - done) for submitted, done in zip(found[0::2], found[1::2]))


def job_records(client: redis.Redis, jobs: Mapping[str, Sequence[str]]) -> dict[str, tuple[list, list]]:
    """Run -> (status, latest send time) of each of its ``jobs`` (None: none), one round trip."""
    pipe = client.pipeline(transaction=False)
    for run, job_ids in jobs.items():
        pipe.hmget(keys.run_status_hash(run), list(job_ids))
        pipe.hmget(keys.run_submitted_hash(run), list(job_ids))
    replies = iter(pipe.execute() if jobs else [])
    return {run: (next(replies), next(replies)) for run in jobs}


def status_of(client: redis.Redis, run: str, job_id: str) -> str | None:
    """A job's final status (``ok``, ``error``), or None while it has none."""
    status = client.hget(keys.run_status_hash(run), job_id)
    return None if status is None else keys.as_text(status)


def job_state(client: redis.Redis, run: str, job_id: str) -> tuple[str | None, str | None, bool, bool]:
    """One moment (``MULTI``) of a job of ``run``: its final status and its latest stream entry's id
    (None: none), whether it was submitted, and whether the run is sealed."""
    pipe = client.pipeline(transaction=True)
    pipe.hget(keys.run_status_hash(run), job_id)
    pipe.hget(keys.run_result_ids_hash(run), job_id)
    pipe.hexists(keys.run_submitted_hash(run), job_id)
    pipe.exists(keys.run_sealed_key(run))
    status, entry_id, submitted, sealed = pipe.execute()
    return (None if status is None else keys.as_text(status), None if entry_id is None else keys.as_text(entry_id),
            bool(submitted), bool(sealed))


def status_page(client: redis.Redis, run: str, cursor: int = 0) -> tuple[int, list[tuple[str, str]]]:
    """One page of ``run``'s final statuses (``HSCAN`` from ``cursor``): the next cursor (0: the
    last page) and ``(job id, status)`` pairs."""
    cursor, page = client.hscan(keys.run_status_hash(run), cursor, count=PAGE)
    return int(cursor), [(keys.as_text(job_id), keys.as_text(status)) for job_id, status in page.items()]


def statuses(client: redis.Redis, run: str) -> Iterator[tuple[str, str]]:
    """``(job id, status)`` of every job of ``run`` with a final status, a page at a time."""
    cursor = 0
    while True:
        cursor, page = status_page(client, run, cursor)
        yield from page
        if not cursor:
            return


def cancelled_jobs(client: redis.Redis, run: str) -> set[str]:
    """Jobs of ``run`` whose final result is ``cancelled`` (its cancelled set, less the jobs that
    ended otherwise since): O(cancelled jobs)."""
    found: set[str] = set()
    members = client.sscan_iter(keys.run_cancelled_jobs_set(run), count=PAGE)
    while batch := [keys.as_text(job_id) for job_id in itertools.islice(members, PAGE)]:
        values = client.hmget(keys.run_status_hash(run), batch)
        found |= {job_id for job_id, value in zip(batch, values) if value and keys.as_text(value) == Status.error.value}
    return found


def was_trimmed(client: redis.Redis, run: str) -> bool:
    """:func:`trim` dropped some of ``run``'s results-stream entries (its trim marker is set)."""
    return bool(client.exists(keys.run_trimmed_key(run)))


def trim_marker(client: redis.Redis, run: str) -> str | None:
    """The stream id up to which ``run``'s stream was trimmed (None: never)."""
    marker = client.get(keys.run_trimmed_key(run))
    return None if marker is None else keys.as_text(marker)


def storage_roots(client: redis.Redis, run: str) -> list[str]:
    """The storage roots of the run's trimmed ok results (``keys.run_roots_set``), sorted."""
    return sorted(keys.as_text(root) for root in client.smembers(keys.run_roots_set(run)))


def trimmed_statuses(client: redis.Redis, run: str, shown: Container[str] = ()) -> dict[str, str]:
    """Job id -> status of each job of ``run`` with a final status whose stream entry was trimmed
    (no field in ``keys.run_result_ids_hash``), but those in ``shown``."""
    trimmed: dict[str, str] = {}
    found = statuses(client, run)
    while page := list(itertools.islice(found, PAGE)):
        entry_ids = client.hmget(keys.run_result_ids_hash(run), [job_id for job_id, _ in page])
        trimmed |= {job_id: status for (job_id, status), entry_id in zip(page, entry_ids)
                    if entry_id is None and job_id not in shown}
    return trimmed


# -- trim ---------------------------------------------------------------------------------
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
        run_lua(client, "trim_page", [keys.run_result_ids_hash(run), stream, keys.run_roots_set(run),
                                      keys.run_trimmed_key(run)],
                [_after(last), len(roots), *sorted(roots), *pairs, last])
        dropped += len(entries)


# -- delete -------------------------------------------------------------------------------
def run_keys(client: redis.Redis, run: str) -> list[str]:
    """Every key of ``run``: its results stream, its ``layertap:run:<run>:*`` keys, its attempt counters."""
    found = [keys.results_stream(run)] if client.exists(keys.results_stream(run)) else []
    for pattern in (keys.run_keys_pattern(run), keys.attempts_pattern(run)):
        found.extend(keys.as_text(key) for key in client.scan_iter(match=pattern, count=1000))
    return found


def memory_bytes(client: redis.Redis, run: str) -> int:
    """Bytes ``run``'s keys take in Redis (``MEMORY USAGE``: large hashes and streams are sampled)."""
    pipe = client.pipeline(transaction=False)
    for key in run_keys(client, run):
        pipe.memory_usage(key)
    return sum(size or 0 for size in pipe.execute())


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
