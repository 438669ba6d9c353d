"""Publishing a final result (the state change itself: ``layertap.transport.ledger.publish``;
then the result sinks, ``layertap.worker.queue.sinks``): the run's Stream (durable), its pub/sub channel (instant), the
run's status hash (one entry per job), the entry's stream id in the run's result-ids hash
(``keys.run_result_ids_hash``), a ``cancelled`` result's job in the run's cancelled set
(``keys.run_cancelled_jobs_set``) and the end of the job's pending record (see
``layertap.worker.queue.reconciler``), in one MULTI/EXEC transaction.

The stream entry holds the result as flat JSON under the field ``result``. Redis being
away, or refusing writes for a while (``OOM`` at ``maxmemory``, ``READONLY`` after a
failover, ``MISCONF``, ``NOPERM``: ``layertap.transport.redis_conn.refuses_writes``), is waited out
with backoff, so the result arrives once Redis takes writes again; only after
``give_up_s`` does publishing raise (the job's pending record then lets the reconciler
send it again).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import redis

from layertap.protocol import keys
from layertap.protocol.schema import Result
from layertap.transport import ledger
from layertap.transport.refusals import wait_out
from layertap.worker.queue.sinks import ResultSink, tell

PUBLISH_GIVE_UP_S = 300.0  # how long publishing waits out a Redis that is away or refuses writes


T = TypeVar("T")


def wait_out_redis(action: Callable[[], T], what: str, give_up_s: float) -> T:
    """``action()``, tried again with backoff while Redis is away or refuses writes; raises
    the last error after ``give_up_s`` seconds, and any other error at once (``refusals.wait_out``)."""
    return wait_out(action, give_up_s, what=what)


class ResultPublisher:
    """The one way a worker publishes final results (its jobs' and the reconciler's): the
    ledger's publish, waited out while Redis is away, with the result sinks around it
    (``layertap.worker.queue.sinks``)."""

    def __init__(self, client: redis.Redis, give_up_s: float = PUBLISH_GIVE_UP_S,
                 sinks: Sequence[ResultSink] = ()):
        self.redis = client
        self.give_up_s = give_up_s
        self.sinks = list(sinks)

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
        what = f"publishing the result of {results[0].job_id}" if len(results) == 1 else \
            f"publishing {len(results)} results of {message}"
        tell(self.sinks, "before_publish", results)
        wait_out_redis(lambda: ledger.publish(self.redis, results, message, queue, also_delete), what, self.give_up_s)
        tell(self.sinks, "after_publish", results)

    def end_lost_message(self, results: list[Result], message: str, queue: str, sent_at: float) -> int | None:
        """The reconciler's publish (``ledger.end_lost_message``): None, changing nothing, if the
        message ``message`` is queued, in flight or held after all; else each of ``results`` (its
        jobs' results; it was sent at ``sent_at``) unless its job has a final result or was sent
        again, with the message's pending record ended, in one step; how many were published. The
        sinks see only those, after the commit."""
        flags = wait_out_redis(lambda: ledger.end_lost_message(self.redis, results, message, queue, sent_at),
                               f"ending the jobs of lost message {message}", self.give_up_s)
        if flags is None:
            return None
        published = [result for result, flag in zip(results, flags) if flag]
        tell(self.sinks, "before_publish", published)
        tell(self.sinks, "after_publish", published)
        return len(published)
