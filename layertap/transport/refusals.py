"""Waiting Redis out: which errors end by themselves (the server away for a while, or refusing
writes until an operator or a failover fixes it), and the one loop that tries again with backoff
(:func:`wait_out`), for the client's calls (``redis_conn.retrying``) and the run ledger's
(``layertap.transport.ledger.Ledger``) alike. redis-py errors only: no Celery or kombu here (the
ledger imports it); ``redis_conn`` adds kombu's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

import redis

from layertap.transport.backoff import Backoff, retry_while

T = TypeVar("T")
log = logging.getLogger("layertap.redis")

#: Error replies that end when an operator or a failover fixes the server: writes refused at
#: ``maxmemory`` (OOM), by a replica (READONLY), by an ACL (NOPERM); see also :data:`REFUSAL_CODES`.
WRITE_REFUSALS = (redis.exceptions.OutOfMemoryError, redis.exceptions.ReadOnlyError,
                  redis.exceptions.NoPermissionError)
#: Error codes of refusals redis-py gives no class: a failed snapshot (``MISCONF``), and a primary
#: with fewer replicas in reach than its ``min-replicas-to-write`` (``NOREPLICAS``).
REFUSAL_CODES = ("MISCONF", "NOREPLICAS")
PIPELINE_ERROR = " of pipeline caused error: "
#: Errors of a server that is away for a while (restarting, loading its data), as redis-py raises
#: them. BusyLoadingError is a ConnectionError.
REDIS_AWAY = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)
BACKOFF = Backoff(first_s=0.1, max_s=5.0)


def refuses_writes(exc: BaseException) -> bool:
    """True for an error reply in :data:`WRITE_REFUSALS` or :data:`REFUSAL_CODES` (no class of their own)."""
    if isinstance(exc, WRITE_REFUSALS):
        return True
    # redis-py puts "Command # N (...) of pipeline caused error: " before a pipeline command's reply
    reply = str(exc).partition(PIPELINE_ERROR)[2] or str(exc)
    return isinstance(exc, redis.exceptions.ResponseError) and reply.startswith(REFUSAL_CODES)


def redis_waits(exc: BaseException) -> bool:
    """Whether ``exc`` is waited out: Redis away (restarting) or refusing writes."""
    return isinstance(exc, REDIS_AWAY) or refuses_writes(exc)


def wait_out(action: Callable[[], T], give_up_s: float, *, what: str = "",
             waits: Callable[[BaseException], bool] = redis_waits,
             refusal: Callable[[BaseException], bool] = refuses_writes) -> T:
    """Run ``action``, trying again with backoff while it raises an error ``waits`` accepts, for up
    to ``give_up_s`` seconds; then, and on any other error, raise it. Each wait is logged (a
    refusal as an error: an operator must act), naming ``what`` was being done and how long it
    has waited."""
    started = time.monotonic()

    def report(exc: BaseException, delay: float) -> None:
        refused = refusal(exc)
        log.log(logging.ERROR if refused else logging.WARNING,
                "%sRedis %s (%s); waited %.0fs of %.0fs, trying again in %.1fs", f"{what}: " if what else "",
                "refuses writes" if refused else "is unreachable", exc, time.monotonic() - started, give_up_s, delay)

    return retry_while(action, waits, give_up_s=give_up_s, backoff=BACKOFF, on_retry=report)
