"""Publishing a final result (the state change itself: the run ledger's ``publish``; then the
result sinks, ``layertap.worker.queue.sinks``): the run's Stream (durable), its pub/sub channel
(instant), the run's status hash (one entry per job), the entry's stream id in the run's
result-ids hash, a ``cancelled`` result's job in the run's cancelled set, the attempt counters
of the jobs it ends and the end of the message's pending record (see
``layertap.worker.queue.reconciler``), in one MULTI/EXEC transaction.

The stream entry holds the result as flat JSON under the field ``result``. Redis being
away, or refusing writes for a while (``OOM`` at ``maxmemory``, ``READONLY`` after a
failover, ``MISCONF``, ``NOPERM``: ``layertap.transport.refusals``), is waited out by the
ledger with backoff, so the result arrives once Redis takes writes again; only after
``give_up_s`` does publishing raise (the job's pending record then lets the reconciler
send it again).
"""

from __future__ import annotations

from collections.abc import Sequence

import redis

from layertap.protocol import keys
from layertap.protocol.schema import Result
from layertap.transport.ledger import Ledger
from layertap.worker.queue.sinks import ResultSink, tell

PUBLISH_GIVE_UP_S = 300.0  # how long publishing waits out a Redis that is away or refuses writes


class ResultPublisher:
    """The one way a worker publishes final results (its jobs' and the reconciler's): the
    ledger's publish, waited out while Redis is away (:attr:`ledger`), with the result sinks
    around it (``layertap.worker.queue.sinks``)."""

    def __init__(self, client: redis.Redis, give_up_s: float = PUBLISH_GIVE_UP_S,
                 sinks: Sequence[ResultSink] = ()):
        self.ledger = Ledger(client, give_up_s)
        self.sinks = list(sinks)

    def publish(self, result: Result, ended: Sequence[tuple[str, str]] = ()) -> None:
        """Publish the final result of a job sent alone (and forget the starts of the ``(run, job
        id)`` in ``ended``, in the same transaction), ending its message's pending record."""
        queue = keys.model_queue(result.model) if result.model else None
        self.publish_many([result], keys.task_id(result.run, result.job_id), queue, ended)

    def publish_many(self, results: list[Result], message: str | None, queue: str | None,
                     ended: Sequence[tuple[str, str]] = ()) -> None:
        """Publish ``results`` (and forget the starts of ``ended`` jobs) in one transaction; with
        ``message``, the task id whose last results these are, end its pending record (its
        member of ``queue``'s sorted set too)."""
        if not results and message is None and not ended:
            return
        tell(self.sinks, "before_publish", results)
        self.ledger.publish(results, message, queue, ended)
        tell(self.sinks, "after_publish", results)

    def end_lost_message(self, results: list[Result], message: str, queue: str, sent_at: float) -> int | None:
        """The reconciler's publish (the ledger's ``end_lost_message``): None, changing nothing, if the
        message ``message`` is queued, in flight or held after all; else each of ``results`` (its
        jobs' results; it was sent at ``sent_at``) unless its job has a final result or was sent
        again, with the message's pending record ended, in one step; how many were published. The
        sinks see only those, after the commit."""
        flags = self.ledger.end_lost_message(results, message, queue, sent_at)
        if flags is None:
            return None
        published = [result for result, flag in zip(results, flags) if flag]
        tell(self.sinks, "before_publish", published)
        tell(self.sinks, "after_publish", published)
        return len(published)
