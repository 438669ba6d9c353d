"""A job's starts, its dead letter, and a run's cancel.

Every start of a job is counted before it runs (``keys.attempts_key``, :func:`count_starts`),
so a job that kills its worker is counted too; a job past ``max_attempts`` starts is
dead-lettered (:func:`dead_letter`, ``keys.DEAD_LETTER_STREAM``) with its last error. A cancelled
run (:func:`cancel`) has its jobs that no engine took yet end ``cancelled``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import redis

from layertap.protocol import keys
from layertap.transport.ledger.pending import clear_pending
from layertap.transport.ledger.script import run_lua

ATTEMPTS_TTL_S = 7 * 24 * 3600
#: How long a delivery's start token lives: longer than a worker waits out Redis for one call.
START_TOKEN_TTL_S = 3600


def count_starts(client: redis.Redis, jobs: Sequence[tuple[str, str]], runs: Sequence[str],
                 token: str) -> tuple[list[int], set[str]]:
    """Count one start of each ``(run, job id)`` of one delivery (``count_starts.lua``: all or
    nothing; each counter lives ``ATTEMPTS_TTL_S``); their counts, and which of ``runs`` are
    cancelled. ``token`` names the delivery: a call repeated with it counts nothing again."""
    replies = run_lua(client, "count_starts",
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
    """Forget a job's starts (a dead job sent again starts from none)."""
    client.delete(keys.attempts_key(run, job_id))


# -- dead letters -------------------------------------------------------------------------
def dead_letter(client: redis.Redis, entry: Mapping[str, str]) -> None:
    """Record a job in the dead-letter stream (``keys.DEAD_LETTER_STREAM``)."""
    client.xadd(keys.DEAD_LETTER_STREAM, dict(entry))


def dead_letters(client: redis.Redis, count: int | None = None) -> list[tuple[str, dict[str, str]]]:
    """The dead-letter entries, oldest first: ``(entry id, fields)``."""
    return client.xrange(keys.DEAD_LETTER_STREAM, count=count)


def dead_letter_count(client: redis.Redis) -> int:
    """How many dead letters there are."""
    return int(client.xlen(keys.DEAD_LETTER_STREAM))


def remove_dead_letters(client: redis.Redis, entry_ids: Sequence[str] | None = None) -> int:
    """Delete dead letters (the given entries, or all); returns how many."""
    if entry_ids:
        return int(client.xdel(keys.DEAD_LETTER_STREAM, *entry_ids))
    pipe = client.pipeline(transaction=True)
    pipe.xlen(keys.DEAD_LETTER_STREAM)
    pipe.delete(keys.DEAD_LETTER_STREAM)
    return int(pipe.execute()[0])


# -- cancel -------------------------------------------------------------------------------
def cancel(client: redis.Redis, run: str) -> None:
    """Mark ``run`` cancelled (idempotent: the first cancel time stays; works at ``maxmemory``). A
    job not yet handed to a worker's engine then ends ``cancelled``; one already there ends as it
    would have."""
    run_lua(client, "cancel", [keys.run_cancelled_key(run)], [time.time()])


def cancelled_runs(client: redis.Redis, runs: Sequence[str]) -> set[str]:
    """Which of ``runs`` are cancelled (one round trip)."""
    pipe = client.pipeline(transaction=False)
    for run in runs:
        pipe.exists(keys.run_cancelled_key(run))
    return {run for run, flag in zip(runs, pipe.execute()) if flag}
