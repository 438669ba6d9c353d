"""The client: submit jobs, read results. Imports no torch.

Results are read from the run's Redis Stream (durable, ordered; ``XREAD``), which holds
every result a worker published within the retention (``retention.results_s``), duplicates
included when a job ran twice. The :meth:`Client.results` iterator yields each result in
stream order; use :meth:`Client.latest` for one result per job, and :meth:`Client.wait` for
given jobs: both also answer jobs whose entries were trimmed, from the run's ledger.
"""

from __future__ import annotations

import time
import uuid
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from functools import partial
from typing import Any

import redis

from layertap.producer.client import runs
from layertap.producer.client.bundler import Bundler
from layertap.producer.client.fleet import did_you_mean, live_workers, served_depths
from layertap.producer.client.results import PAGE, read_after
from layertap.protocol import keys
from layertap.protocol.images import load_images, with_image_digests
from layertap.protocol.layers import LayerIdError, resolve_layer_ids
from layertap.protocol.naming import served_model_name
from layertap.protocol.schema import Job, JobTooLarge, Result, oversize, refuse_oversize
from layertap.settings import Settings
from layertap.storage.registry import use_options
from layertap.transport.celery_app import make_celery, send_extract
from layertap.transport.ledger import Ledger, SentMessage, pending_record
from layertap.transport.redis_conn import connect, retrying


class NoWorker(RuntimeError):
    """``submit``: no live worker serves the job's model while others are live (or ``check=True``)."""


class NoWorkerWarning(UserWarning):
    """``submit``: no live worker serves the job's model (its jobs wait in the queue until one does)."""


class JobFailed(RuntimeError):
    """``wait(..., raise_on_error=True)``: some jobs ended with an error result (``.results`` has them all)."""

    def __init__(self, failed: list[Result], results: dict[str, Result]):
        first = failed[0]
        super().__init__(f"{len(failed)} of {len(results)} job(s) failed; job {first.job_id}: "
                         f"{first.error_type.value if first.error_type else 'error'}: {first.error}")
        self.failed = failed
        self.results = results


def _message(jobs: list[tuple[Job, dict[str, Any]]]) -> SentMessage:
    """The message that sends ``jobs`` (prepared, of one model and run): a job message for one, a bundle for more."""
    first = jobs[0][0]
    bundle = len(jobs) > 1
    task_id = (keys.bundle_task_id(first.run, uuid.uuid4().hex) if bundle
               else keys.task_id(first.run, first.job_id or ""))
    return SentMessage(keys.model_queue(first.model), task_id, [(job.run, job.job_id or "") for job, _ in jobs], bundle)


class Client:
    """Submit jobs to the model's queue and read results back from Redis."""

    def __init__(self, settings: Settings | None = None, *, redis_url: str | None = None):
        settings = settings or Settings()
        if redis_url is not None:
            settings = settings.model_copy(update={"redis_url": redis_url})
        self.settings = settings
        use_options(settings.storage_root, settings.storage_options)  # result files are read with them
        self.celery = make_celery(settings)
        self.redis = connect(settings, decode_responses=True)
        self.ledger = Ledger(self.redis, settings.redis_wait_s)  # its changes wait Redis out; reads are one attempt
        self._open_runs: set[str] = set()  # runs seen not cancelled by this client
        self._served: set[str] = set()  # models seen served by a live worker, or already warned about
        self._depths: dict[str, int] = {}  # served model -> decoder layers, as live workers reported them

    # -- submitting -------------------------------------------------------------------
    def submit(self, job: Job | Mapping[str, Any], *, check: bool | None = None, **fields: Any) -> Job:
        """Validate, give an id, and enqueue one job in a message of its own, at once; returns
        the job as sent (with ``job_id``). Its result comes on the run's results stream
        (:meth:`wait`, :meth:`results`); there is no per-job ``AsyncResult``.

        ``model`` follows the workers' naming rule (``naming.served_model_name``): an existing
        local folder is its basename, so the ``--model`` a worker was started with meets.
        The first job of a model that no live worker serves is checked as ``layertap enqueue``
        does (:meth:`check_served`); unless ``check=False``, a job asking for layers the live
        workers' model lacks raises ``LayerIdError``; a job for a cancelled run raises
        :class:`~layertap.producer.client.runs.RunCancelled`. Each is looked up once per model or run and client.
        A job whose id the run already has is sent again and reopened (:meth:`send`): ``wait`` and a
        streaming consumer wait for its new result."""
        job, payload = self.prepare(job, check=check, **fields)
        self.send([[(job, payload)]])
        return job

    def prepare(self, job: Job | Mapping[str, Any], *, check: bool | None = None,
                **fields: Any) -> tuple[Job, dict[str, Any]]:
        """The job validated, with its served model name and its id, and its JSON payload; raises
        as :meth:`submit` does, and :class:`~layertap.protocol.images.ImageError` for an image that
        cannot be used (an image path gets the sha256 of its file under ``settings.images_root`` first)."""
        limits, images_root = self.settings.limits, self.settings.images_root
        limit = limits.max_job_bytes
        if not isinstance(job, Job):
            data = with_image_digests({**job, **fields}, images_root, limits.max_image_bytes)
            refuse_oversize(data, limit, f"job {data.get('job_id') or ''}".rstrip())
            job = Job.model_validate(data)
        elif fields:
            job = Job.model_validate({**job.model_dump(exclude_none=True), **fields})
        if served_model_name(job.model) != job.model:
            job = job.model_copy(update={"model": served_model_name(job.model)})
        job = job.with_id()
        if job.messages is not None:
            load_images(job.messages, images_root, max_images=limits.max_images, max_bytes=limits.max_image_bytes)
        self._check_destination(job, check)
        payload = job.model_dump(mode="json", exclude_none=True)
        size = oversize(job, payload, limit)
        if size is not None:
            raise JobTooLarge(f"job {job.job_id} is {size} bytes of JSON; the limit is {limit} "
                              "(LAYERTAP_LIMITS__MAX_JOB_BYTES)")
        return job, payload

    def send(self, messages: list[list[tuple[Job, dict[str, Any]]]],
             reopen: Mapping[tuple[str, str], Sequence[str]] | None = None) -> None:
        """Send prepared jobs (:meth:`prepare`), one message per list: a list of one job is a
        plain job message, a longer one a bundle (all of one model and run). The run's ledger
        (each job's latest send time: a pending record older than it no longer covers the job,
        ``layertap.transport.ledger``) is written first, in one round trip; each message's
        pending record goes in the transaction that queues it. A job sent again (the ledger had
        its send time) is reopened: the step that queues its message clears its old status and
        latest-entry index, so nothing takes it as final with its old result, and its consumption
        by the consumer groups ``reopen`` names for it (``(run, job id)`` -> groups). Not named:
        every group of its run for a ``replace`` job (other content, to be trained on), none for
        another (a group that trained on its ok result takes the new one as a duplicate; one that
        saw its error still takes the new ok result)."""
        now = time.time()
        sent = [_message(jobs) for jobs in messages]
        named = dict(reopen or {})
        unnamed = self.ledger.record_sent(sent, now) - named.keys()
        replacing = {(job.run, job.job_id) for jobs in messages for job, _ in jobs if job.replace} & unnamed
        groups = {run: self.ledger.group_names(run) for run in {run for run, _ in replacing}}
        reopened = {pair: groups[pair[0]] if pair in replacing else [] for pair in unnamed} | named
        for jobs, message in zip(messages, sent):
            if message.bundle:
                task, args = keys.EXTRACT_BUNDLE_TASK, [[payload for _, payload in jobs]]
            else:
                task, args = keys.EXTRACT_TASK, [jobs[0][1]]
            record = pending_record(message.queue, message.task_id, now, message.jobs if message.bundle else None,
                                    {job_id: reopened[run, job_id] for run, job_id in message.jobs
                                     if (run, job_id) in reopened})
            retrying(partial(send_extract, self.celery, args, {"submitted_at": now}, message.queue, message.task_id,
                             task, record), self.settings.redis_wait_s)  # kombu's send, waited out as the ledger's

    def bundler(self, *, check: bool | None = None, **overrides: Any) -> Bundler:
        """A :class:`~layertap.producer.client.bundler.Bundler` sending this client's jobs in bundles
        (``settings.bundle``, with ``overrides`` such as ``max_jobs=16``); close it, or use it
        with ``with``, to send what it still holds."""
        settings = self.settings.bundle.model_copy(update=overrides)
        return Bundler(self, settings, check=check)

    def _check_destination(self, job: Job, check: bool | None) -> None:
        if job.run not in self._open_runs:
            if runs.is_cancelled(self.redis, job.run):
                raise runs.RunCancelled(f"run {job.run} is cancelled; `layertap runs delete {job.run}` first, "
                                        "or use another run name")
            self._open_runs.add(job.run)
        if job.model not in self._served:
            workers = self.check_served(job.model, check, stacklevel=5)
            self._depths.update(served_depths(workers))
            self._served.add(job.model)
        depth = self._depths.get(job.model)
        if check is not False and job.layers is not None and depth is not None:
            try:
                resolve_layer_ids(job.layers, depth)
            except LayerIdError as exc:
                raise LayerIdError(f"job {job.job_id}: model {job.model!r} as live workers serve it: {exc}") from None

    def check_served(self, model: str, check: bool | None = None, *,
                     stacklevel: int = 2) -> dict[str, dict[str, Any]]:
        """The one check of a destination, for ``Client`` and ``layertap enqueue`` alike. If no live
        worker serves ``model``: raise :class:`NoWorker` (with a "did you mean") when ``check`` is
        None (the default) and some other worker is live, since a typo is likelier than a worker
        still to come, or when ``check`` is True; otherwise warn (:class:`NoWorkerWarning`): the
        jobs wait in the queue until such a worker starts. Returns the live workers (node -> info)."""
        live = self.workers()
        served = {info["model"] for info in live.values()}
        if model in served:
            return live
        guess = did_you_mean(model, served)
        reason = (f"no live worker serves model {model!r} (served: {', '.join(sorted(served)) or 'none'}"
                  + (f"; did you mean {guess!r}?)" if guess else ")"))
        if check or (check is None and live):
            raise NoWorker(reason)
        warnings.warn(f"{reason}; its jobs wait in queue {keys.model_queue(model)} until one does", NoWorkerWarning,
                      stacklevel=stacklevel)
        return live

    def submit_many(self, jobs: Iterable[Job | Mapping[str, Any]], *, check: bool | None = None,
                    **fields: Any) -> list[Job]:
        """Submit each job, in bundles (``settings.bundle``); returns them with ids once all are sent."""
        with self.bundler(check=check) as bundler:
            return [bundler.add(job, **fields) for job in jobs]

    def seal(self, run: str, sealed: bool = True) -> None:
        """Mark ``run`` as fed whole (``sealed``) or still being fed: a streaming consumer
        (``layertap.producer.files.streaming``) stops only on a sealed run. ``layertap enqueue`` does both."""
        self.ledger.seal(run, sealed)

    # -- reading results ---------------------------------------------------------------
    def results(self, run: str, *, follow: bool = False, since: str = "0",
                block_ms: int = 1000, timeout: float | None = None,
                until_complete: bool = False) -> Iterator[Result]:
        """Yield the run's results in stream order; with ``follow``, keep waiting for more.

        Stops after ``timeout`` seconds without a new result when following, and with
        ``until_complete`` once every submitted job has a result and all are yielded.
        """
        last_id, idle_since = since, time.monotonic()
        while True:
            # Completeness is read before the stream: a result is on the stream when it counts.
            draining = follow and until_complete and runs.is_complete(self.redis, run)
            try:
                entries = read_after(self.redis, run, last_id, block_ms=block_ms if follow and not draining else None)
            except redis.exceptions.ConnectionError:
                if not follow:
                    raise
                time.sleep(0.5)  # Redis restarting: try again
                continue
            for entry_id, result in entries:
                last_id = entry_id
                yield result
            if draining and len(entries) < PAGE:
                return
            if entries:
                idle_since = time.monotonic()
            elif not follow:
                return
            elif timeout is not None and time.monotonic() - idle_since > timeout:
                return

    def latest(self, run: str) -> dict[str, Result]:
        """One result per job id (the last published): from the run's stream so far, and for jobs
        whose entries were trimmed (first), from the ledger (``runs.ledger_result``)."""
        found = {result.job_id: result for result in self.results(run)}
        if not runs.was_trimmed(self.redis, run):
            return found
        trimmed = {job_id: runs.ledger_result(self.redis, run, job_id, status)
                   for job_id, status in self.ledger.statuses(run) if job_id not in found}
        return {**trimmed, **found}

    def wait(self, run: str, job_ids: Iterable[str], timeout: float = 600.0, *,
             raise_on_error: bool = False) -> dict[str, Result]:
        """Block until every job in ``job_ids`` has a result; raise ``TimeoutError`` otherwise.
        With ``raise_on_error``, raise :class:`JobFailed` if any of them is an error result.

        Jobs already finished are read by their latest stream ids, the others from the stream's
        end onwards: the cost grows with ``job_ids``, not with the run. Redis away is waited out
        for up to ``timeout`` while the finished ones are read."""
        wanted = set(job_ids)
        found, since = self._published_results(self.ledger.waiting(timeout), run, wanted)
        deadline = time.monotonic() + timeout
        if len(found) < len(wanted):
            for result in self.results(run, follow=True, since=since, block_ms=500, timeout=timeout):
                if result.job_id in wanted:
                    found[result.job_id] = result
                    if len(found) == len(wanted):
                        break
                if time.monotonic() > deadline:
                    break
        if len(found) == len(wanted):
            failed = [found[job_id] for job_id in sorted(found) if not found[job_id].ok]
            if raise_on_error and failed:
                raise JobFailed(failed, found)
            return found
        missing = sorted(wanted - set(found))
        raise TimeoutError(f"{len(missing)} of {len(wanted)} jobs have no result after {timeout:.0f}s, "
                           f"e.g. {missing[:3]}")

    @staticmethod
    def _published_results(book: Ledger, run: str, wanted: set[str]) -> tuple[dict[str, Result], str]:
        """The latest results of ``wanted`` jobs published so far, and the stream id after which
        every later result lies (one snapshot: ``MULTI``). A job with a status but no latest
        entry was trimmed (``runs.trim``: its result comes from the ledger, ``runs.ledger_result``)
        or, in a run never trimmed, published before the index existed: that sends the caller to
        the stream's start."""
        order = sorted(wanted)
        if not order:
            return {}, "0"
        last, entry_ids, statuses = book.published_snapshot(run, order)
        unindexed = {job_id: status for job_id, status, entry_id in zip(order, statuses, entry_ids)
                     if status is not None and entry_id is None}
        if unindexed and not book.was_trimmed(run):
            return {}, "0"
        found = {job_id: runs.ledger_result(book, run, job_id, status) for job_id, status in unindexed.items()}
        for job_id, status, result in zip(order, statuses, book.results_at(run, entry_ids)):
            if result is not None:
                found[job_id] = result
            elif job_id not in found and status is not None:  # trimmed since the snapshot
                found[job_id] = runs.ledger_result(book, run, job_id, status)
        return found, last or "0"

    def subscribe(self, run: str) -> Iterator[Result]:
        """Results as they are published (pub/sub: at-most-once; use :meth:`results` to not miss any)."""
        yield from self.ledger.follow_published(run)

    # -- fleet -------------------------------------------------------------------------
    def workers(self) -> dict[str, dict[str, Any]]:
        """Live workers (their heartbeat key exists): node name -> description."""
        return live_workers(self.redis)

    def served_models(self) -> set[str]:
        """Models some live worker serves."""
        return {info["model"] for info in self.workers().values()}

    def close(self) -> None:
        self.redis.close()
        self.celery.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
