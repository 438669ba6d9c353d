"""What the Celery task does around the processor: attempts, retries, dead letters, publishing.

Invariants:
* every Redis state change and read here (attempts, cancelled runs, splits, dead letters) is the
  run ledger's (``layertap.transport.ledger``: the publisher's, which waits Redis out), and every
  result goes out through the one publisher;
* a job of a cancelled run (``layertap.producer.client.runs``) is not run: it gets a ``cancelled`` error
  result, published like any other final result; the run is checked when the message starts
  and again just before its jobs go to the engine (``JobProcessor.process_many``'s
  ``stopped_runs``), so a message held while the run was cancelled computes none of its jobs
  that had not reached the engine;
* every job that starts increments ``layertap:attempts:<run>:<job_id>`` first, so a job
  that kills its worker is counted too; a job past ``max_attempts`` starts is not run
  again but dead-lettered, with its last error;
* transient failures (``internal``, ``write_failed``) retry with exponential backoff
  through Celery (a new message; this one is acknowledged); an ``internal`` one up to
  ``max_attempts`` starts, a storage fault (``write_failed`` for read-only or full storage, an
  I/O error: ``layertap.worker.job.pipeline.STORAGE_ERRNOS``) for ``storage_retry_s`` seconds from its
  first fault (kwarg ``storage_fault_since``, per job), its starts excused, and only then
  dead-lettered;
* every job ends with exactly one final result published (ok, error, or dead-letter),
  and the counter is cleared then;
* the task returns only after publishing, so the message is acknowledged only after
  its file is durable and its result is on Redis.

A bundle (``keys.EXTRACT_BUNDLE_TASK``, ``layertap.producer.client.bundler``) holds several jobs of one
run; each is validated, counted, answered and published on its own (a bad job gets its own
error result, the others run), all valid ones go to the engine at once, and all final
results are published in one transaction that ends the message's pending record, before
the one ack. Its kwargs may say, per job, the attempt count when the message was sent
(``counted``) and the starts excused because a bigger bundle holding the job died
(``excused``). So:

* a bundle of two or more jobs one of which has started more often than ``counted`` says
  (the message killed its worker, or is a duplicate) is not run but split: its counts are
  undone and its halves are sent as two new bundles (each with its own pending record, in
  the transaction that ends this one's), with ``counted = excused =`` the counts;
* a job alone in a bundle is dead-lettered, as a job sent alone is, once it has started
  more than ``max_attempts`` times beyond its ``excused`` starts: a poison job ends in the
  dead-letter stream alone, after at most ``log2(bundle size)`` extra deaths;
* jobs with a transient error retry, as a bundle of those jobs (same task id), with their
  ``counted`` updated and their ``excused`` kept;
* a bundle without a pending record is not run: it was handled already (its results
  published or its halves sent, and the worker died before its ack reached Redis).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections import Counter
from functools import partial
from typing import Any

import redis
from celery import Celery

from layertap.protocol import keys
from layertap.protocol.schema import ErrorType, Job, Result, Status
from layertap.transport.backoff import Backoff
from layertap.transport.celery_app import send_extract
from layertap.transport.ledger import cancelled_error, cancelled_result, pending_record
from layertap.transport.redis_conn import retrying
from layertap.worker.job.errors import JobError
from layertap.worker.job.pipeline import STORAGE_FAULT, JobProcessor
from layertap.worker.queue.publisher import ResultPublisher

log = logging.getLogger(__name__)
TRANSIENT_ERRORS = {ErrorType.internal, ErrorType.write_failed}
RETRY_MAX_S = 60.0
RETRY_BACKOFF = Backoff(first_s=1.0, max_s=RETRY_MAX_S)  # countdowns of transient failures' retries


class RetryLater(Exception):
    """Raised to ask the task shell to retry the message after ``countdown`` seconds, with
    ``args``/``kwargs`` instead of its own if given (a bundle retries only some jobs)."""

    def __init__(self, countdown: float, args: list[Any] | None = None, kwargs: dict[str, Any] | None = None):
        super().__init__(f"retry in {countdown:.1f}s")
        self.countdown = countdown
        self.args_, self.kwargs_ = args, kwargs


def retry_delay(attempt: int) -> float:
    """Seconds before retrying a job whose ``attempt``-th start failed transiently."""
    return RETRY_BACKOFF.delay(attempt - 1)


def storage_retry_delay(faulty_s: float, window_s: float) -> float:
    """Seconds before retrying a job whose storage has failed for ``faulty_s`` seconds: as long
    again (from 1 s, up to ``RETRY_MAX_S``: the waits double), the last at the window's end."""
    return max(0.1, min(max(1.0, faulty_s), RETRY_MAX_S, window_s - faulty_s))


def _time(value: Any) -> float | None:
    """A kwarg that is a time (``submitted_at``), or None."""
    return value if isinstance(value, (int, float)) else None


def _times(value: Any) -> dict[str, float]:
    """A kwarg of per-job times (``storage_fault_since``), or {} if it is not one."""
    if not isinstance(value, dict):
        return {}
    return {key: float(when) for key, when in value.items() if isinstance(key, str) and isinstance(when, (int, float))}


def _first_error(results: list[Result], error_type: ErrorType) -> str:
    """The message of the first of ``results`` with ``error_type``."""
    return next((result.error or "" for result in results if result.error_type is error_type), "")


def _counts(value: Any) -> dict[str, int]:
    """A kwarg of per-job counts (``counted``, ``excused``), or {} if it is not one."""
    if not isinstance(value, dict):
        return {}
    return {key: count for key, count in value.items() if isinstance(key, str) and isinstance(count, int)}


class WorkerService:
    """Thread-safe; shared by all task threads of one worker."""

    def __init__(self, processor: JobProcessor, publisher: ResultPublisher, max_attempts: int,
                 app: Celery | None = None, storage_retry_s: float = 900.0):
        self.processor = processor
        self.publisher = publisher
        self.ledger = publisher.ledger  # waits Redis out as the publish does
        self.max_attempts = max_attempts
        self.storage_retry_s = storage_retry_s
        self.app = app  # sends the halves of a split bundle

    def handle(self, args: tuple[Any, ...], kwargs: dict[str, Any], task_id: str | None,
               refusal: str | None = None) -> dict[str, Any]:
        """Run one task message; returns the published result as JSON data. May raise :class:`RetryLater`.

        ``refusal``: why the message is refused without running (its scheduling fields)."""
        raw: Any = args[0] if len(args) == 1 else list(args)
        submitted_at = _time(kwargs.get("submitted_at"))
        try:
            job = self.processor.parse(raw, task_id)
        except JobError as exc:
            result = self.processor.invalid(raw, exc, submitted_at=submitted_at, fallback_id=task_id)
            self.publisher.publish(result)
            return result.model_dump(mode="json")
        if refusal is not None:
            result = self.processor.refused(job, JobError(ErrorType.invalid_job, refusal))
            self.publisher.publish(result)
            return result.model_dump(mode="json")
        queue = keys.model_queue(job.model)
        results = self._settle([job], [raw], [], kwargs, keys.task_id(job.run, job.job_id), queue,  # type: ignore[arg-type]
                               bundle=False)
        return results[0].model_dump(mode="json")

    def _count_attempts(self, jobs: list[Job]) -> tuple[list[int], set[str]]:
        """Count one start of each job (one step, once however often Redis makes it retry); their
        counts, and which of their runs are cancelled."""
        run_names = sorted({job.run for job in jobs})
        pairs = [(job.run, job.job_id or "") for job in jobs]
        return self.ledger.count_starts(pairs, run_names, uuid.uuid4().hex)

    def handle_bundle(self, args: tuple[Any, ...], kwargs: dict[str, Any], task_id: str, queue: str | None,
                      refusal: str | None = None) -> dict[str, int]:
        """Run one bundle message (see the module doc); returns how many results it published and
        how many of them are ok (the results themselves are on the runs' streams). May raise
        :class:`RetryLater` (for the jobs that failed transiently)."""
        if not self.ledger.is_pending(task_id):
            log.info("bundle %s is handled already (its results are published, or it was split); not run again",
                     task_id)
            return _summary([])
        submitted_at = _time(kwargs.get("submitted_at"))
        raws = args[0] if len(args) == 1 and isinstance(args[0], list) and args[0] else None
        if raws is None:  # not a list of jobs: one error result says so
            result = self.processor.process(list(args), submitted_at=submitted_at, fallback_id=task_id)
            result = result.model_copy(update={"error": f"not a bundle (a list of jobs): {result.error}"})
            self.publisher.publish_many([result], task_id, queue)
            return _summary([result])
        finished: list[Result] = []
        jobs: list[Job] = []
        payloads: list[Any] = []
        for raw in raws:
            try:
                jobs.append(self.processor.parse(raw))
                payloads.append(raw)
            except JobError as exc:
                finished.append(self.processor.invalid(raw, exc, submitted_at=submitted_at))
        if refusal is not None or not jobs:
            finished += [self.processor.refused(job, JobError(ErrorType.invalid_job, refusal or "")) for job in jobs]
            self.publisher.publish_many(finished, task_id, queue)
            return _summary(finished)
        return _summary(self._settle(jobs, payloads, finished, kwargs, task_id, queue, bundle=True))

    def _settle(self, jobs: list[Job], payloads: list[Any], finished: list[Result], kwargs: dict[str, Any],
                message: str, queue: str | None, *, bundle: bool) -> list[Result]:
        """Count, run and publish valid ``jobs`` (with the ``finished`` results of the message's
        others) and end message ``message``; or split it, or raise :class:`RetryLater` (module doc)."""
        counts, cancelled_runs = self._count_attempts(jobs)
        counted, excused = _counts(kwargs.get("counted")), _counts(kwargs.get("excused"))
        ids = [job.job_id or "" for job in jobs]
        copies = Counter(ids)  # a job twice in one bundle counts two starts per delivery
        if bundle and len(jobs) > 1 and any(count > counted.get(job_id, 0) + copies[job_id]
                                            for job_id, count in zip(ids, counts)):
            self.publisher.publish_many(finished, None, None)
            self._split(jobs, payloads, [count - 1 for count in counts], kwargs, message, queue)
            return finished
        own = [count - excused.get(job_id, 0) for job_id, count in zip(ids, counts)]  # starts held against each
        to_run: list[int] = []
        for index, job in enumerate(jobs):
            if job.run in cancelled_runs:
                finished.append(cancelled_result(job.run, ids[index], worker=self.processor.worker_name,
                                                 model=job.model, metadata=job.metadata))
            elif len(jobs) == 1 and own[index] > self.max_attempts:
                finished.append(self.dead_letter(job, counts[index] - 1, ErrorType.internal,
                                                 f"the worker died {counts[index] - 1} time(s) while running this job"))
            else:
                to_run.append(index)
        ran = self.processor.process_many([jobs[i] for i in to_run], submitted_at=_time(kwargs.get("submitted_at")),
                                          attempts=[counts[i] for i in to_run], stopped_runs=self._cancelled_now)
        retry: list[int] = []
        now, fault_since = time.time(), _times(kwargs.get("storage_fault_since"))
        storage_faults: dict[str, float] = {}  # job id -> its first storage fault, for those retried for one
        for index, result in zip(to_run, ran):
            if result.error_type is ErrorType.write_failed and (result.error or "").startswith(STORAGE_FAULT):
                since = fault_since.get(ids[index], now)
                if now - since < self.storage_retry_s:
                    storage_faults[ids[index]] = since
                    excused[ids[index]] = excused.get(ids[index], 0) + 1  # this start is the storage's
                    retry.append(index)
                    continue
                result = self.dead_letter(jobs[index], counts[index], ErrorType.write_failed,
                                          f"{result.error} (storage faults for {now - since:.0f}s)")
            elif result.status is Status.error and result.error_type in TRANSIENT_ERRORS:
                if own[index] < self.max_attempts:
                    retry.append(index)
                    continue
                result = self.dead_letter(jobs[index], counts[index], result.error_type,  # type: ignore[arg-type]
                                          result.error or "")
            finished.append(result)
        retried = {ids[i] for i in retry}
        done = [(job.run, job_id) for job, job_id in zip(jobs, ids) if job_id not in retried]
        self.publisher.publish_many(finished, None if retry else message, queue, ended=done)
        for result in finished:
            _log_error(result)
        if retry:
            delay = min(retry_delay(own[i]) if ids[i] not in storage_faults
                        else storage_retry_delay(now - storage_faults[ids[i]], self.storage_retry_s) for i in retry)
            retry_kwargs = {**kwargs, "counted": {ids[i]: counts[i] for i in retry},
                            "excused": {ids[i]: excused[ids[i]] for i in retry if ids[i] in excused},
                            "storage_fault_since": storage_faults}
            if storage_faults:
                log.warning("storage faults on %d job(s) of message %s (%s); retrying in %.1fs, for up to %.0fs "
                            "in all", len(storage_faults), message, _first_error(ran, ErrorType.write_failed), delay,
                            self.storage_retry_s)
            if not bundle:
                raise RetryLater(delay, kwargs=retry_kwargs)
            raise RetryLater(delay, args=[[payloads[i] for i in retry]], kwargs=retry_kwargs)
        return finished

    def _cancelled_now(self, run_names: set[str]) -> dict[str, JobError]:
        """Which of ``run_names`` are cancelled now (asked just before their jobs are computed), with
        the error their jobs end with; none while Redis cannot say (the jobs run)."""
        order = sorted(run_names)
        try:
            cancelled = self.ledger.waiting(0).cancelled_runs(order)
        except redis.exceptions.RedisError as exc:
            log.warning("could not check for cancelled runs before computing (%s); running the jobs", exc)
            return {}
        return {run: JobError(ErrorType.cancelled, cancelled_error(run)) for run in order if run in cancelled}

    def _split(self, jobs: list[Job], payloads: list[Any], counts: list[int], kwargs: dict[str, Any],
               task_id: str, queue: str | None) -> None:
        """Send ``jobs`` as two bundles instead of this message, whose starts are undone (``counts``:
        after). Each half is queued with its pending record, both waited out while Redis refuses
        writes; only then is this message's record ended, so no job is left without a message."""
        assert self.app is not None, "a worker that takes bundles sends their halves"
        queue = queue or keys.model_queue(jobs[0].model)
        middle, now = len(jobs) // 2, time.time()
        for part in (slice(0, middle), slice(middle, None)):
            counted = {job.job_id or "": count for job, count in zip(jobs[part], counts[part])}
            half_id = keys.bundle_task_id(jobs[0].run, uuid.uuid4().hex)
            record = pending_record(queue, half_id, now, [(job.run, job.job_id or "") for job in jobs[part]])
            retrying(partial(send_extract, self.app, [payloads[part]],
                             {**kwargs, "counted": counted, "excused": counted},
                             queue, half_id, keys.EXTRACT_BUNDLE_TASK, record), self.ledger.give_up_s)
        self.ledger.split_message([(job.run, job.job_id or "") for job in jobs], queue, task_id)
        log.warning("bundle %s of %d jobs started before and did not finish (its worker died?): sent it again "
                    "as two bundles of %d and %d", task_id, len(jobs), middle, len(jobs) - middle)

    def dead_letter(self, job: Job, attempts: int, last_type: ErrorType, last_error: str) -> Result:
        """Record the job in the dead-letter stream and return its final error result."""
        entry = {"job": json.dumps(job.model_dump(mode="json", exclude_none=True)), "run": job.run,
                 "job_id": job.job_id or "", "attempts": str(attempts), "error_type": last_type.value,
                 "error": last_error, "at": str(time.time()), "worker": self.processor.worker_name}
        self.ledger.dead_letter(entry)
        log.error("job %s dead-lettered after %d attempts: %s", job.job_id, attempts, last_error)
        return Result(job_id=job.job_id, run=job.run, status=Status.error, error_type=ErrorType.dead_letter,
                      error=f"failed {attempts} time(s); last error ({last_type.value}): {last_error}",
                      model=job.model, worker=self.processor.worker_name, metadata=job.metadata, attempt=attempts)


def _summary(results: list[Result]) -> dict[str, int]:
    """A bundle task's return value: small, whatever its jobs' results hold."""
    return {"published": len(results), "ok": sum(result.ok for result in results)}


def _log_error(result: Result) -> None:
    if not result.ok:  # Celery's own log line calls every returned task "succeeded"
        log.warning("job %s (run %s) ended with an error result, %s: %s", result.job_id, result.run,
                    result.error_type.value if result.error_type else "error", result.error)
