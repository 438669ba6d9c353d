"""The enqueue loop: rows become jobs, jobs go to the queue with back-pressure and resume.

Rows (``layertap.producer.ingest.sources``) become job data (``layertap.producer.ingest.formats``); the command line's
fields (model, run, layers, ...) fill in what a row leaves out. Then, per job:

* **resume**: a job whose result in the run's status hash is ``ok`` is skipped, so
  re-running the same command after an interruption sends only what is not done yet;
  a job with an ``error`` result is sent again (its status entry, and its consumption by the
  enqueue's ``group``, are cleared in the step that queues its message: ``Client.send``'s ``reopen``);
* **other content**: a job sent under its own id whose ok result holds other content than the
  row asks (other options or input, ``layertap.producer.ingest.existing``) is never "already ok":
  by :class:`OnChange`, it is refused (``changed``, not sent), kept (``kept``) or sent with
  ``replace`` (``replaced``: the worker writes what is asked in place of that file);
* **repeats**: a job this enqueue already sent (same run and id: a repeated row) is
  skipped; "already sent" is read from the run's submitted hash (its time is at or after
  this enqueue's start). A repeat of a row's own ``job_id`` with other content is a bad row
  naming itself, never skipped silently: the jobs sent under their own ids are remembered as
  fingerprints (``layertap.producer.ingest.sent``, 16 bytes a job; content-hash ids cost nothing);
* **bundles**: jobs go out in bundles (``layertap.producer.client.bundler``, ``settings.bundle``): a job
  counts as sent once it is in one, and every bundle is sent before the limiter reads
  Redis and before the runs are sealed;
* **back-pressure**: before each submit the loop waits until the run has fewer than
  ``max_inflight`` jobs submitted but not finished (submitted hash minus status hash), or,
  with ``until="consumed"``, submitted but not yet taken by the streaming consumer group
  ``group`` (submitted hash minus its consumed hash, ``layertap.producer.files.streaming``), so that a slow
  trainer slows the producer and the files on disk stay under ``max_inflight``;
* **sealing**: a run is unsealed when this enqueue first sends into it and sealed when its
  last row is done (``keys.run_sealed_key``); a streaming consumer stops only on a sealed run;
* **Redis away** (a failover, a restart): every read and write of the ledger, and every send, is
  waited out for up to ``settings.redis_wait_s``, so the enqueue goes on where it was.

Jobs that were in flight when an earlier enqueue was killed have no result yet and are
sent again; the worker answers a repeat of a finished job from its file on disk.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import redis
from pydantic import ValidationError

from layertap.producer.client.client import Client
from layertap.producer.client.fleet import ServedShape
from layertap.producer.ingest import existing
from layertap.producer.ingest.formats import RowConverter, UndetectableFormat
from layertap.producer.ingest.sent import SentJobs
from layertap.producer.ingest.sources import SourceRow
from layertap.protocol import keys
from layertap.protocol.images import ImageError, load_images, with_image_digests
from layertap.protocol.layers import LayerIdError
from layertap.protocol.naming import check_name
from layertap.protocol.schema import Job, JobTooLarge, Status, describe_validation_error, refuse_oversize
from layertap.settings import InflightUntil, Limits
from layertap.transport.ledger import Ledger
from layertap.transport.refusals import wait_out


@dataclass
class BadRow:
    """A row that was not enqueued: where it is and why."""

    where: str
    reason: str


@dataclass
class Planned:
    """A valid job and the row it came from."""

    where: str
    job: Job


class Outcome(str, Enum):
    """What became of one row (:meth:`Enqueuer.run` yields it with the row): only ``submitted`` and ``replaced``
    were sent."""

    submitted = "submitted"
    already_ok = "already_ok"  # the run has an ok result for this job, of the content asked
    repeated = "repeated"  # this enqueue already sent this job, same content (a repeated row)
    bad = "bad"  # not sent: invalid, or its own job_id already sent by this enqueue with other content
    changed = "changed"  # not sent: ok in the run with other content than asked (OnChange.refuse)
    kept = "kept"  # not sent: ok in the run with other content, kept (OnChange.keep)
    replaced = "replaced"  # sent: ok in the run with other content, to be replaced (OnChange.replace)


class OnChange(str, Enum):
    """What becomes of a row whose job is ok in its run with other content than it asks."""

    refuse = "refuse"
    keep = "keep"
    replace = "replace"


@dataclass
class Ledgered:
    """What the run's ledger holds of a job: its status and send time (None: none), and for an ok
    job whose result holds other content than asked, why (``existing.change``)."""

    status: str | None
    submitted_at: str | None
    change: str | None = None


def look_up(client: redis.Redis, jobs: list[Job], shape: ServedShape | None, wait_s: float = 0.0) -> list[Ledgered]:
    """What the ledger holds of each of ``jobs`` (in order): one round trip, and for the ok ones
    sent under their own ids, what made their results (``existing.made``). Read again while Redis
    is away, for up to ``wait_s`` seconds (0: one attempt)."""
    return wait_out(lambda: _look_up(client, jobs, shape), wait_s, what="the run ledger's look-up of a batch")


def _look_up(client: redis.Redis, jobs: list[Job], shape: ServedShape | None) -> list[Ledgered]:
    by_run: dict[str, list[str]] = {}
    for job in jobs:
        by_run.setdefault(job.run, []).append(job.job_id or "")
    records = Ledger(client, give_up_s=0).job_records(by_run)
    found = {run: (iter(statuses), iter(sent)) for run, (statuses, sent) in records.items()}  # in the jobs' order
    looked = [Ledgered(next(found[job.run][0]), next(found[job.run][1])) for job in jobs]
    own: dict[str, list[str]] = {}
    for job, ledgered in zip(jobs, looked):
        if ledgered.status == Status.ok.value and not job.has_content_id():
            own.setdefault(job.run, []).append(job.job_id or "")
    made = {run: existing.made(client, run, job_ids) for run, job_ids in own.items()}
    for job, ledgered in zip(jobs, looked):
        if job.job_id in made.get(job.run, {}):
            ledgered.change = existing.change(job, made[job.run][job.job_id], shape)  # type: ignore[index]
    return looked


def job_from_data(data: Any, defaults: dict[str, Any], max_job_bytes: int | None = None, *,
                  images_root: Path | None = None, limits: Limits | None = None) -> Job:
    """A job from one row's data with ``defaults`` under it; raises ``ValueError`` saying why not
    (:class:`JobTooLarge` over ``max_job_bytes``, checked before the data is validated). Image
    parts are checked as the Client checks them: a path is read under ``images_root`` only
    (its sha256 filled in), and every image is within ``limits`` and decodes
    (:class:`~layertap.protocol.images.ImageError`)."""
    if not isinstance(data, dict):
        raise ValueError(f"expected a JSON object, got {type(data).__name__}")
    limits = limits or Limits()
    merged = with_image_digests({**defaults, **data}, images_root, limits.max_image_bytes)
    if max_job_bytes is not None:
        refuse_oversize(merged, max_job_bytes)
    try:
        job = Job.model_validate(merged).with_id()
    except ValidationError as exc:
        raise ValueError(describe_validation_error(exc, most=1)) from None
    if job.messages is not None:
        load_images(job.messages, images_root, max_images=limits.max_images, max_bytes=limits.max_image_bytes)
    return job


def plan_jobs(rows: Iterable[SourceRow], converter: RowConverter, defaults: dict[str, Any],
              origin: str = "", max_job_bytes: int | None = None, *, images_root: Path | None = None,
              limits: Limits | None = None) -> Iterator[Planned | BadRow]:
    """A :class:`Planned` job or a :class:`BadRow` per row, placed as ``"<origin> <where>"``
    (image parts checked by :func:`job_from_data`). Raises ``UndetectableFormat`` for the whole file."""
    for row in rows:
        where = f"{origin} {row.where}" if origin else row.where
        if row.error is not None:
            yield BadRow(where, row.error)
            continue
        try:
            yield Planned(where, job_from_data(converter.job_data(row.data, row.where), defaults, max_job_bytes,
                                               images_root=images_root, limits=limits))
        except UndetectableFormat as exc:
            raise UndetectableFormat(f"{origin}: {exc}" if origin else str(exc)) from None
        except ValueError as exc:
            yield BadRow(where, converter.explain(str(exc)))


class InflightLimiter:
    """Waits until the runs fed have fewer than ``limit`` jobs submitted but not finished
    (``until="finished"``) or not consumed (``until="consumed"``).

    The count is read from Redis only when the running estimate reaches the limit; between
    reads each submit adds one, so the estimate is an upper bound and the limit holds at
    every moment (counting jobs left in flight by an earlier enqueue of the same run).
    ``before_read`` runs before each read (the enqueue sends its bundles, so that every job
    counted is in Redis).
    """

    def __init__(self, client: redis.Redis, limit: int, poll_s: float = 0.05, until: InflightUntil = "finished",
                 group: str = keys.DEFAULT_CONSUMER_GROUP, before_read: Callable[[], None] = lambda: None,
                 wait_s: float = 0.0):
        self.ledger = Ledger(client, give_up_s=wait_s)  # each read waited out for up to wait_s (0: one attempt)
        self.before_read = before_read
        self.limit = limit
        self.poll_s = poll_s
        check_name(group, "consumer group")
        self.until, self.group = until, group
        self.runs: set[str] = set()
        self.in_flight = 0

    def refresh(self) -> None:
        """Read the count of jobs in flight from Redis."""
        self.before_read()
        self.in_flight = self.ledger.in_flight(sorted(self.runs), self.group if self.until == "consumed" else None)

    def acquire(self, run: str) -> None:
        """Block until one more job of ``run`` may be submitted, and count it."""
        if run not in self.runs:
            self.runs.add(run)
            self.refresh()
        while self.in_flight >= self.limit:
            time.sleep(self.poll_s)
            self.refresh()
        self.in_flight += 1


class Enqueuer:
    """Sends planned jobs with resume, repeat skipping and back-pressure (see the module doc)."""

    def __init__(self, client: Client, max_inflight: int, batch_size: int = 256,
                 until: InflightUntil = "finished", group: str = keys.DEFAULT_CONSUMER_GROUP,
                 check: bool | None = None, on_change: OnChange = OnChange.refuse,
                 shape: ServedShape | None = None):
        self.client = client
        self.on_change = on_change
        self.shape = shape  # the live workers' shape of the model, to name settings as they resolve them
        self.group = group
        # refuse, as bad rows, jobs the live workers cannot run (Client's check)
        self.bundler = client.bundler(check=check)
        self.limiter = InflightLimiter(client.redis, max_inflight, until=until, group=group,
                                       before_read=self.bundler.flush, wait_s=client.settings.redis_wait_s)
        self.batch_size = batch_size
        self.started_at = time.time()
        self.fed: set[str] = set()  # runs this enqueue unsealed
        self.sent_jobs = SentJobs()  # the jobs with their own ids sent, to tell a repeated row's content

    def run(self, items: Iterable[Planned | BadRow]) -> Iterator[tuple[Outcome, Planned | BadRow]]:
        """Yield what happened to each item, in order of decision (bad rows as soon as they are read);
        seal the runs fed once the last item is done. Every job yielded as submitted is sent
        before this returns or raises."""
        batch: list[Planned] = []
        try:
            for item in items:
                if isinstance(item, BadRow):
                    yield Outcome.bad, item
                    continue
                batch.append(item)
                if len(batch) >= self.batch_size:
                    yield from self._send(batch)
                    batch = []
            yield from self._send(batch)
        finally:
            self.bundler.close()
        for run in sorted(self.fed):
            self.client.seal(run)

    def _send(self, batch: list[Planned]) -> Iterator[tuple[Outcome, Planned | BadRow]]:
        if not batch:
            return
        for run in sorted({item.job.run for item in batch} - self.fed):
            self.client.seal(run, sealed=False)
            self.fed.add(run)
        sent: set[tuple[str, str]] = set()
        looked = look_up(self.client.redis, [item.job for item in batch], self.shape, self.client.settings.redis_wait_s)
        for item, found in zip(batch, looked):
            job, status, submitted_at = item.job, found.status, found.submitted_at
            key = (job.run, job.job_id or "")
            replace = found.change is not None and self.on_change is OnChange.replace
            if status == Status.ok.value and found.change is None:
                yield Outcome.already_ok, item
            elif status == Status.ok.value and not replace:
                yield ((Outcome.kept, item) if self.on_change is OnChange.keep
                       else (Outcome.changed, BadRow(item.where, found.change or "")))
            elif (key in sent or self.bundler.holds(*key)
                  or (submitted_at is not None and float(submitted_at) >= self.started_at)):
                yield self._repeated(item)
            else:
                sent.add(key)
                self.sent_jobs.add(job)
                yield self._submit(item, reopen=status is not None or submitted_at is not None, replace=replace)

    def _repeated(self, item: Planned) -> tuple[Outcome, Planned | BadRow]:
        """A repeat of a job already sent: skipped, or a bad row when this enqueue sent its id with other content."""
        job = item.job
        if self.sent_jobs.other_content(job):
            return Outcome.bad, BadRow(item.where, f"job_id {job.job_id!r} of run {job.run!r} was sent by an earlier "
                                                   "row of this enqueue with other content; this row was not sent "
                                                   "(give each row its own id)")
        return Outcome.repeated, item

    def _submit(self, item: Planned, *, reopen: bool, replace: bool = False) -> tuple[Outcome, Planned | BadRow]:
        job = item.job
        self.limiter.acquire(job.run)
        try:  # sent before: its push clears its old (error, or replaced ok) status and this group's consumption
            self.bundler.add(job.model_copy(update={"replace": True}) if replace else job,
                             reopen_group=self.group if reopen else None)
        except (JobTooLarge, LayerIdError, ImageError) as exc:  # an image changed since its row was read
            return Outcome.bad, BadRow(item.where, str(exc))
        return (Outcome.replaced if replace else Outcome.submitted), item
