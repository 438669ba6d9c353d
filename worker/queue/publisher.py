"""Publishing a final result: the run's Stream (durable), its pub/sub channel (instant), the
run's status hash (one entry per job), the entry's stream id in the run's result-ids hash
(``keys.run_result_ids_hash``), a ``cancelled`` result's job in the run's cancelled set
(``keys.run_cancelled_jobs_set``) and the end of the job's pending record (see
``worker.queue.reconciler``), in one MULTI/EXEC transaction.

The stream entry holds the result as flat JSON under the field ``result``. Redis being
away, or refusing writes for a while (``OOM`` at ``maxmemory``, ``READONLY`` after a
failover, ``MISCONF``, ``NOPERM``: ``producer.transport.redis_conn.refuses_writes``), is waited out
with backoff, so the result arrives once Redis takes writes again; only after
``give_up_s`` does publishing raise (the job's pending record then lets the reconciler
send it again).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

import redis

from producer.protocol import keys
from producer.protocol.schema import ErrorType, Result
from producer.transport.backoff import Backoff, retry_while
from producer.transport.pending import clear_pending
from producer.transport.redis_conn import UNREACHABLE, refuses_writes

log = logging.getLogger(__name__)
PUBLISH_BACKOFF = Backoff(first_s=0.1, max_s=5.0)
PUBLISH_GIVE_UP_S = 300.0  # how long publishing waits out a Redis that is away or refuses writes


T = TypeVar("T")

#: XADD KEYS[1] field ARGV[1] = ARGV[2], and record the new entry's id under job ARGV[3] in KEYS[2].
XADD_AND_INDEX = """
local id = redis.call('XADD', KEYS[1], '*', ARGV[1], ARGV[2])
redis.call('HSET', KEYS[2], ARGV[3], id)
return id
"""


def wait_out_redis(action: Callable[[], T], what: str, give_up_s: float) -> T:
    """``action()``, tried again with backoff while Redis is away or refuses writes; raises
    the last error after ``give_up_s`` seconds, and any other error at once."""
    def retryable(exc: Exception) -> bool:
        return isinstance(exc, redis.exceptions.RedisError) and (refuses_writes(exc) or isinstance(exc, UNREACHABLE))

    def report(exc: Exception, delay: float) -> None:
        unwritable = refuses_writes(exc)
        log.log(logging.ERROR if unwritable else logging.WARNING, "%s failed (%s%s); retrying in %.1fs", what,
                exc, ": Redis refuses writes" if unwritable else "", delay)

    return retry_while(action, retryable, give_up_s=give_up_s, backoff=PUBLISH_BACKOFF, on_retry=report)


class ResultPublisher:
    def __init__(self, client: redis.Redis, give_up_s: float = PUBLISH_GIVE_UP_S):
        self.redis = client
        self.give_up_s = give_up_s

    def publish(self, result: Result, also_delete: tuple[str, ...] | list[str] = ()) -> None:
        """Publish the final result of a job sent alone (and delete ``also_delete`` keys in the
        same transaction), ending its message's pending record."""
        queue = keys.model_queue(result.model) if result.model else None
        self.publish_many([result], keys.task_id(result.run, result.job_id), queue, also_delete)

    def publish_many(self, results: list[Result], message: str | None, queue: str | None,
                     also_delete: tuple[str, ...] | list[str] = ()) -> None:
        """Publish ``results`` (and delete ``also_delete`` keys) in one transaction; with
        ``message``, the task id whose last results these are, end its pending record (its
        member of ``queue``'s sorted set too)."""
        if not results and message is None and not also_delete:
            return

        def send() -> None:
            pipe = self.redis.pipeline(transaction=True)
            for result in results:
                data, stream = result.model_dump_json(), keys.results_stream(result.run)
                pipe.eval(XADD_AND_INDEX, 2, stream, keys.run_result_ids_hash(result.run), keys.RESULT_FIELD, data,
                          result.job_id)
                pipe.publish(stream, data)
                pipe.hset(keys.run_status_hash(result.run), result.job_id, result.status.value)
                if result.error_type is ErrorType.cancelled:
                    pipe.sadd(keys.run_cancelled_jobs_set(result.run), result.job_id)
            if message is not None:
                clear_pending(pipe, queue, message)
            if also_delete:
                pipe.delete(*also_delete)
            pipe.execute()

        what = f"publishing the result of {results[0].job_id}" if len(results) == 1 else \
            f"publishing {len(results)} results of {message}"
        wait_out_redis(send, what, self.give_up_s)
