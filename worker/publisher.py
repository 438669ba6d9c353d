"""Publishing a final result: the run's Stream (durable), its pub/sub channel (instant), the
run's status hash (one entry per job) and the end of the job's pending record (see
``worker.reconciler``), in one MULTI/EXEC transaction.

The stream entry holds the result as flat JSON under the field ``result``. Redis being
away is waited out with backoff; only after ``give_up_s`` does publishing raise, and the
caller then leaves the job unacknowledged so it is redelivered (and answered from disk).
"""

from __future__ import annotations

import logging
import time

import redis

from producer import keys
from producer.client import RESULT_FIELD
from producer.schema import Result

log = logging.getLogger(__name__)


class ResultPublisher:
    def __init__(self, client: redis.Redis, give_up_s: float = 300.0):
        self.redis = client
        self.give_up_s = give_up_s

    def publish(self, result: Result, also_delete: tuple[str, ...] | list[str] = ()) -> None:
        """Publish ``result`` (and delete ``also_delete`` keys in the same transaction)."""
        data = result.model_dump_json()
        stream = keys.results_stream(result.run)
        deadline = time.monotonic() + self.give_up_s
        delay = 0.1
        while True:
            try:
                pipe = self.redis.pipeline(transaction=True)
                pipe.xadd(stream, {RESULT_FIELD: data})
                pipe.publish(stream, data)
                pipe.hset(keys.run_status_hash(result.run), result.job_id, result.status.value)
                task_id = keys.task_id(result.run, result.job_id)
                for pending in (keys.PENDING_HASH, keys.PENDING_PAYLOAD_HASH, keys.SUSPECT_HASH):
                    pipe.hdel(pending, task_id)
                if also_delete:
                    pipe.delete(*also_delete)
                pipe.execute()
                return
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError,
                    redis.exceptions.BusyLoadingError) as exc:
                if time.monotonic() > deadline:
                    raise
                log.warning("publishing result of %s failed (%s); retrying in %.1fs", result.job_id, exc, delay)
                time.sleep(delay)
                delay = min(delay * 2, 5.0)
