"""What the Celery task does around the processor: attempts, retries, dead letters, publishing.

Invariants:
* a job of a cancelled run (``producer.client.runs``) is not run: it gets a ``cancelled`` error
  result, published like any other final result;
* every job that starts increments ``layertap:attempts:<run>:<job_id>`` first, so a job
  that kills its worker is counted too; a job past ``max_attempts`` starts is not run
  again but dead-lettered, with its last error;
* transient failures (``internal``, ``write_failed``) retry with exponential backoff
  through Celery (a new message; this one is acknowledged);
* every job ends with exactly one final result published (ok, error, or dead-letter),
  and the counter is cleared then;
* the task returns only after publishing, so the message is acknowledged only after
  its file is durable and its result is on Redis.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import redis

from producer.client import runs
from producer.protocol import keys
from producer.protocol.schema import ErrorType, Job, Result, Status
from producer.transport.backoff import Backoff
from worker.job.errors import JobError
from worker.job.pipeline import JobProcessor
from worker.queue.publisher import ResultPublisher, wait_out_redis

log = logging.getLogger(__name__)
TRANSIENT_ERRORS = {ErrorType.internal, ErrorType.write_failed}
ATTEMPTS_TTL_S = 7 * 24 * 3600
RETRY_MAX_S = 60.0
RETRY_BACKOFF = Backoff(first_s=1.0, max_s=RETRY_MAX_S)  # countdowns of transient failures' retries


class RetryLater(Exception):
    """Raised to ask the task shell to retry the job after ``countdown`` seconds."""

    def __init__(self, countdown: float):
        super().__init__(f"retry in {countdown:.1f}s")
        self.countdown = countdown


class WorkerService:
    """Thread-safe; shared by all task threads of one worker."""

    def __init__(self, processor: JobProcessor, client: redis.Redis, publisher: ResultPublisher, max_attempts: int):
        self.processor = processor
        self.redis = client
        self.publisher = publisher
        self.max_attempts = max_attempts

    def handle(self, args: tuple[Any, ...], kwargs: dict[str, Any], task_id: str | None,
               refusal: str | None = None) -> dict[str, Any]:
        """Run one task message; returns the published result as JSON data. May raise :class:`RetryLater`.

        ``refusal``: why the message is refused without running (its scheduling fields)."""
        raw: Any = args[0] if len(args) == 1 else list(args)
        submitted_at = kwargs.get("submitted_at")
        submitted_at = submitted_at if isinstance(submitted_at, (int, float)) else None
        try:
            job = self.processor.parse(raw, task_id)
        except JobError:
            result = self.processor.process(raw, submitted_at=submitted_at, fallback_id=task_id)
            self.publisher.publish(result)
            return result.model_dump(mode="json")
        if refusal is not None:
            result = self.processor.refused(job, JobError(ErrorType.invalid_job, refusal))
            self.publisher.publish(result)
            return result.model_dump(mode="json")
        attempts = keys.attempts_key(job.run, job.job_id)  # type: ignore[arg-type]

        def count_attempt() -> tuple[int, bool]:
            pipe = self.redis.pipeline(transaction=False)
            pipe.incr(attempts)
            pipe.expire(attempts, ATTEMPTS_TTL_S)
            pipe.exists(keys.run_cancelled_key(job.run))
            count, _, cancelled = pipe.execute()
            return int(count), bool(cancelled)

        attempt, cancelled = wait_out_redis(count_attempt, f"counting an attempt of {job.job_id}",
                                            self.publisher.give_up_s)
        if cancelled:
            result = runs.cancelled_result(job.run, job.job_id or "", worker=self.processor.worker_name,
                                           model=job.model, metadata=job.metadata)
        elif attempt > self.max_attempts:
            result = self.dead_letter(job, attempt - 1, ErrorType.internal,
                                      f"the worker died {attempt - 1} time(s) while running this job")
        else:
            result = self.processor.process(job, submitted_at=submitted_at, attempt=attempt)
            if result.status is Status.error and result.error_type in TRANSIENT_ERRORS:
                if attempt < self.max_attempts:
                    raise RetryLater(RETRY_BACKOFF.delay(attempt - 1))
                result = self.dead_letter(job, attempt, result.error_type, result.error or "")  # type: ignore[arg-type]
        self.publisher.publish(result, also_delete=(attempts,))
        if not result.ok:  # Celery's own log line calls every returned task "succeeded"
            log.warning("job %s (run %s) ended with an error result, %s: %s", result.job_id, result.run,
                        result.error_type.value if result.error_type else "error", result.error)
        return result.model_dump(mode="json")

    def dead_letter(self, job: Job, attempts: int, last_type: ErrorType, last_error: str) -> Result:
        """Record the job in the dead-letter stream and return its final error result."""
        entry = {"job": json.dumps(job.model_dump(mode="json", exclude_none=True)), "run": job.run,
                 "job_id": job.job_id or "", "attempts": str(attempts), "error_type": last_type.value,
                 "error": last_error, "at": str(time.time()), "worker": self.processor.worker_name}
        self.redis.xadd(keys.DEAD_LETTER_STREAM, entry)
        log.error("job %s dead-lettered after %d attempts: %s", job.job_id, attempts, last_error)
        return Result(job_id=job.job_id, run=job.run, status=Status.error, error_type=ErrorType.dead_letter,
                      error=f"failed {attempts} time(s); last error ({last_type.value}): {last_error}",
                      model=job.model, worker=self.processor.worker_name, metadata=job.metadata, attempt=attempts)
