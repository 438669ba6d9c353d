"""Jobs from raw message data to results (:class:`Result`): the core both the Celery tasks and the
in-process :class:`~layertap.worker.extractor.Extractor` run.

Steps per job: validate -> check the model -> answer from disk if the file at the job's name
verifies and has the ``content_id`` this worker would write (``fileformat.IDENTITY_KEYS``: the
job's fields, resolved layers and dtypes, model weights, tokenizer, format version); refuse the
job if that name holds a valid file of other job content (``job_id_conflict``), unless the job
says ``replace`` -> tokenize
(caller's thread; a call's chats with images on preparer threads side by side) -> engine ->
non-finite check -> write -> result. The jobs of one call
(:meth:`JobProcessor.process_many`: a bundle) that are not answered from disk are prepared and
submitted inside the engine's ``preparing`` block (just ahead of the engine, a few callers at
once; disk answers come before it and take no place there), go to the engine at once and are
handed to the processor's writer threads as their batches come back, so the files of one call
are written side by side (a batch's host buffer is free only once all its files are written).
A job whose file is to be computed is first looked for in the worker's capture index
(``layertap.worker.job.reuse``): a file of its capture that holds its layers answers it, written on
the caller's thread as the job's own file with no forward (``captured_from``). A computed row the
worker samples (``layertap.worker.job.sampling``) is noted as waiting once its file is written,
before its result, and computed again alone later, when the engine is idle: a row over its bound
fails its run's certificate.
Every failure becomes that job's error result with a typed reason; nothing raises.
"""

from __future__ import annotations

import copy
import errno
import json
import logging
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import torch
from pydantic import ValidationError
from safetensors import SafetensorError

from layertap.protocol import fileformat as ff
from layertap.protocol.capture import capture_key, holds_computed_values
from layertap.protocol.fileformat import MetaKey
from layertap.protocol.layers import CONVENTION
from layertap.protocol.naming import content_hash, is_safe_name
from layertap.protocol.schema import (
    ErrorType,
    Job,
    JobTooLarge,
    Result,
    Status,
    Timings,
    describe_validation_error,
    refuse_oversize,
)
from layertap.storage.base import Storage
from layertap.storage.examine import Existing, OnDisk
from layertap.worker.engine.engine import Engine
from layertap.worker.engine.errors import BatchFailed, DeviceFault, EngineError, EngineStopped, OutOfMemory
from layertap.worker.engine.output_dtype import recorded_name, resolve_output_dtype
from layertap.worker.engine.records import Captured, EngineRequest
from layertap.worker.engine.self_check import CheckReport
from layertap.worker.engine.teacher import dense_topk
from layertap.worker.job.errors import JobError
from layertap.worker.job.examiners import EXAMINE_THREADS, Examiners
from layertap.worker.job.reuse import CaptureIndex, NonFinite, computed_options, derived_tensors, find_capture
from layertap.worker.job.sampling import Sampler
from layertap.worker.job.tokenize import TOKENIZER_POOL, PreparedInput, Preparer
from layertap.worker.job.writer import FileTaken, write_job_file
from layertap.worker.model.fixes import fixes_of
from layertap.worker.model.loading import LoadedModel
from layertap.worker.model.vision.inputs import image_features_note

log = logging.getLogger(__name__)

#: Files a worker writes at once by default (``worker.writer_threads`` unset): the cores but one
#: (as :data:`~layertap.worker.job.examiners.EXAMINE_THREADS`), at least 2 (so a write waiting on
#: another writer's lock holds back no other file) and at most 8. More writer threads than cores take
#: the GIL and the cores from the thread that issues batches: small jobs through a 2-core CPU worker
#: ran 11% faster with 2 than with 8 (BENCHMARKS.md, "CPU: small jobs through one worker"); a 16-core
#: GPU host gets 8, as measured there.
WRITER_THREADS = min(8, max(2, EXAMINE_THREADS))

#: The error type of each engine failure. All but out-of-memory are transient (the job is retried).
ENGINE_ERROR_TYPES: dict[type[EngineError], ErrorType] = {
    OutOfMemory: ErrorType.out_of_memory,
    BatchFailed: ErrorType.internal,
    DeviceFault: ErrorType.internal,
    EngineStopped: ErrorType.internal,
}


#: Errors of a storage that cannot take a file now (read-only, full, over quota, failing): not the
#: job's fault. Their ``write_failed`` message starts with :data:`STORAGE_FAULT`; the task handler
#: retries them for ``worker.storage_retry_s``, not ``max_attempts`` times.
STORAGE_ERRNOS = frozenset({errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EIO})
STORAGE_FAULT = "storage fault: "


def is_storage_fault(exc: BaseException) -> bool:
    """Whether a write failed for :data:`STORAGE_ERRNOS` (safetensors gives only "(os error N)")."""
    if isinstance(exc, OSError):
        return exc.errno in STORAGE_ERRNOS
    found = re.search(r"\(os error (\d+)\)", str(exc))
    return found is not None and int(found.group(1)) in STORAGE_ERRNOS


def identify(raw: Any, fallback_id: str | None) -> tuple[str, str]:
    """Best-effort ``(job_id, run)`` of data that failed validation, for its error result."""
    run = raw.get("run") if isinstance(raw, dict) else None
    job_id = raw.get("job_id") if isinstance(raw, dict) else None
    run = run if is_safe_name(run) else "default"
    if not is_safe_name(job_id):
        try:
            job_id = "invalid-" + content_hash(raw)[:24]
        except (TypeError, ValueError):
            job_id = "invalid-" + (content_hash(fallback_id)[:24] if fallback_id else "unknown")
    return job_id, run


def _conflict(job: Job, path: str) -> JobError:
    """The error of a job whose explicit id already names a valid file of other content in its run."""
    return JobError(ErrorType.job_id_conflict,
                    f"job_id {job.job_id!r} already names a file of other content in run {job.run!r} ({path}); "
                    "give this job its own job_id (or remove that file to replace it)")


def _non_finite(dtype: str) -> JobError:
    return JobError(ErrorType.non_finite, "NaN or Inf in the captured hidden states (or values beyond "
                                          f"{dtype}'s range); no file written (check the model weights and dtype)")


def _queued(submitted_at: float | None) -> float | None:
    """Seconds since ``submitted_at`` (the job's time in the queue), if known."""
    return max(0.0, time.time() - submitted_at) if submitted_at else None


_Step = TypeVar("_Step")


@dataclass
class _Target:
    """A job for this worker's model with no valid file of its own yet: where it goes, and the
    identity metadata (``fileformat.IDENTITY_KEYS`` and ``content_id``) its file will have."""

    path: str
    identity: dict[str, str]


@dataclass
class _Located:
    """A job for this worker's model: where its file is, the identity metadata (``fileformat.IDENTITY_KEYS``
    and ``content_id``) that file has when it is this job's, and the job's ``spec()``."""

    path: str
    identity: dict[str, str]
    spec: dict[str, Any]


@dataclass
class _Started:
    """A job past its checks and tokenizer, for the engine to run."""

    job: Job
    path: str
    identity: dict[str, str]
    prepared: PreparedInput
    request: EngineRequest
    output_dtype: torch.dtype


class JobProcessor:
    """Thread-safe; one per worker (or Extractor), sharing one engine."""

    def __init__(self, loaded: LoadedModel, engine: Engine, preparer: Preparer, storage: Storage,
                 worker_name: str, writer_threads: int | None = None, self_check: CheckReport | None = None,
                 sampler: Sampler | None = None, captures: CaptureIndex | None = None,
                 examiners: Examiners | None = None):
        """``storage``: where files go (the worker's own root: paths never come from jobs).
        ``writer_threads``: files written at once, over all calls (each job's check, write and
        result run on one of them; default :data:`WRITER_THREADS`).
        ``sampler``: measures a sample of the computed rows (none: no sampling); ``captures``:
        where files are noted to answer later jobs (none: no reuse); ``examiners``: what checks the
        files already at the jobs' names (default: helper processes for a local storage,
        ``examiners.Examiners``)."""
        self.loaded = loaded
        self.sampler, self.captures = sampler, captures
        self.examiners = examiners or Examiners()
        self.self_check = self_check  # the engine's batching self-check, passed before any job
        self.engine = engine
        self.preparer = preparer
        self.storage = storage
        self.worker_name = worker_name
        self.writer_threads = WRITER_THREADS if writer_threads is None else writer_threads
        self._writers = ThreadPoolExecutor(max_workers=self.writer_threads, thread_name_prefix="layertap-write")
        # a bundle's chats with images are prepared side by side (as many as the preparer has tokenizers)
        self._preparers = ThreadPoolExecutor(max_workers=TOKENIZER_POOL, thread_name_prefix="layertap-prepare")
        self._awaiting_engine = 0
        self._fixes = fixes_of(loaded.model.config)
        self._awaiting_lock = threading.Lock()

    @property
    def storage_root(self) -> str:
        """The root files go under (a local folder or a URL)."""
        return self.storage.root

    def writing_to(self, storage: Storage) -> JobProcessor:
        """This processor writing to another storage (same engine, tokenizer and writer threads)."""
        other = copy.copy(self)
        other.storage = storage
        return other

    def close(self) -> None:
        """Measure the sampled rows still waiting, finish what is queued, then stop the engine and the
        writer threads (no job is being processed any more)."""
        if self.sampler is not None:
            self.sampler.close()
        self.engine.stop()
        self._writers.shutdown(wait=True)
        self._preparers.shutdown(wait=True)
        self.examiners.close()

    def awaiting_engine(self) -> int:
        """Jobs submitted to the engine whose batch has not come back yet (the watchdog reads it)."""
        return self._awaiting_engine

    def parse(self, raw: Any, fallback_id: str | None = None) -> Job:
        """Validate raw message data into a job with an id; raises :class:`JobError`.

        The size is checked first, so a huge message is refused before it is validated."""
        try:
            refuse_oversize(raw, self.preparer.limits.max_job_bytes)
        except JobTooLarge as exc:
            raise JobError(ErrorType.invalid_job, str(exc)) from None
        try:
            return Job.model_validate(raw).with_id()
        except ValidationError as exc:
            if all(error["type"] == ErrorType.empty_input.value for error in exc.errors()):
                raise JobError(ErrorType.empty_input, describe_validation_error(exc)) from None
            raise JobError(ErrorType.invalid_job, "invalid job: " + describe_validation_error(exc)) from None

    def process(self, raw: Any, *, submitted_at: float | None = None, attempt: int | None = None,
                fallback_id: str | None = None) -> Result:
        """Run one job (raw message data, or an already validated :class:`Job`) and return its
        result (never raises)."""
        if not isinstance(raw, Job):
            try:
                raw = self.parse(raw, fallback_id)
            except JobError as exc:
                return self.invalid(raw, exc, submitted_at=submitted_at, attempt=attempt, fallback_id=fallback_id)
        return self.process_many([raw], submitted_at=submitted_at, attempts=[attempt])[0]

    def invalid(self, raw: Any, exc: JobError, *, submitted_at: float | None = None, attempt: int | None = None,
                fallback_id: str | None = None) -> Result:
        """The error result of raw message data that :meth:`parse` refused with ``exc``."""
        job_id, run = identify(raw, fallback_id)
        return self._error(job_id, run, exc, Timings(queued=_queued(submitted_at)), attempt=attempt)

    def process_many(self, jobs: list[Job], *, submitted_at: float | None = None,
                     attempts: list[int | None] | None = None,
                     stopped_runs: Callable[[set[str]], dict[str, JobError]] | None = None) -> list[Result]:
        """Run validated jobs together (all go to the engine at once, so its next batch sees
        them all) and return one result each, in order (never raises). Each job is answered
        from disk, computed and written on its own; one job's failure is its result alone.
        Those answered from disk (a redelivery) are answered first; the rest are prepared and
        submitted inside the engine's ``preparing`` block, and waited for and written after it.
        ``stopped_runs``: asked, once a call's turn to prepare has come (just before its jobs go to
        the engine), which of its jobs' runs must not run now (a cancelled run), with their error."""
        attempts = attempts or [None] * len(jobs)
        jobs = [job.with_id() for job in jobs]
        results: list[Result | None] = [None] * len(jobs)
        targets: list[tuple[int, _Target]] = []
        queued = _queued(submitted_at)
        for index, checked in enumerate(self._check_all(jobs, queued, attempts)):
            if isinstance(checked, _Target):
                targets.append((index, checked))
            else:
                results[index] = checked
        if not targets:
            return results  # type: ignore[return-value]
        started: list[tuple[int, _Started]] = []
        with self.engine.preparing():
            queued = _queued(submitted_at)  # waiting to prepare counts as time in the queue
            stopped = stopped_runs({jobs[index].run for index, _ in targets}) if stopped_runs else {}
            starting = []
            for index, target in targets:
                if jobs[index].run in stopped:
                    results[index] = self.refused(jobs[index], stopped[jobs[index].run])
                else:
                    starting.append((index, partial(self._guarded, jobs[index], queued, attempts[index],
                                                    partial(self._start, jobs[index], target))))
            for index, outcome in self._prepare(jobs, starting):
                if isinstance(outcome, _Started):
                    started.append((index, outcome))
                else:
                    results[index] = outcome
            futures = self._submit(jobs, started, results, queued, attempts) if started else []
        if futures:
            self._finish_all(jobs, started, futures, results, queued, attempts)
        return results  # type: ignore[return-value]

    def _prepare(self, jobs: list[Job], starting: list[tuple[int, Callable[[], Any]]]) -> list[tuple[int, Any]]:
        """Each ``(index, start)``'s outcome, in order. Where two or more are chats with images
        (decoding and the image processor: tens of milliseconds each, mostly outside the GIL),
        all run on the preparer threads side by side; else on this thread."""
        if sum(1 for index, _ in starting if jobs[index].images()) < 2:
            return [(index, start()) for index, start in starting]
        return list(zip((index for index, _ in starting), self._preparers.map(lambda item: item[1](), starting)))

    def _submit(self, jobs: list[Job], started: list[tuple[int, _Started]], results: list[Result | None],
                queued: float | None, attempts: list[int | None]) -> list[Future]:
        """Put every started job into the engine at once; their futures, or none (and their error
        results) if the engine refuses them."""
        try:
            return self.engine.submit_many([job.request for _, job in started])
        except EngineError as engine_error:
            exc = JobError(ENGINE_ERROR_TYPES[type(engine_error)], str(engine_error))
            for index, _ in started:
                results[index] = self._error(jobs[index].job_id, jobs[index].run, exc, Timings(queued=queued),  # type: ignore[arg-type]
                                             job=jobs[index], attempt=attempts[index])
            return []

    def _finish_all(self, jobs: list[Job], started: list[tuple[int, _Started]], futures: list[Future],
                    results: list[Result | None], queued: float | None, attempts: list[int | None]) -> None:
        """Hand each submitted job to a writer thread as soon as its batch comes back (a slice's
        host buffer is held until its job is written, so none waits behind a later batch or
        behind the other files of this call), then wait for all of them."""
        by_future = dict(zip(futures, started))
        waiting = len(futures)
        writing: list[tuple[int, Future]] = []
        notes: list[tuple[str, str]] = []  # (capture key, address) of the files computed and written
        with self._awaiting_lock:
            self._awaiting_engine += waiting
        try:
            for future in as_completed(futures):
                index, job = by_future[future]
                with self._awaiting_lock:
                    self._awaiting_engine -= 1
                waiting -= 1
                writing.append((index, self._writers.submit(
                    self._guarded, jobs[index], queued, attempts[index],
                    partial(self._finish, job, future, queued, attempts[index], notes))))
        finally:
            with self._awaiting_lock:
                self._awaiting_engine -= waiting
        for index, written in writing:
            results[index] = written.result()  # _guarded never raises
        if notes and self.captures is not None:  # before the results are published: a later job finds them
            self.captures.add_many(notes)

    def _guarded(self, job: Job, queued: float | None, attempt: int | None,
                 step: Callable[[], _Step]) -> _Step | Result:
        """``step()``, or the error result of ``job`` it raised."""
        try:
            return step()
        except JobError as exc:
            return self._error(job.job_id, job.run, exc, Timings(queued=queued), job=job, attempt=attempt)  # type: ignore[arg-type]
        except Exception as exc:
            log.exception("job %s failed", job.job_id)
            return self._error(job.job_id, job.run, JobError(ErrorType.internal, f"{type(exc).__name__}: {exc}"),  # type: ignore[arg-type]
                               Timings(queued=queued), job=job, attempt=attempt)

    def refused(self, job: Job, exc: JobError) -> Result:
        """The error result of a valid job refused before it runs."""
        return self._error(job.job_id, job.run, exc, Timings(), job=job)  # type: ignore[arg-type]

    def _check_all(self, jobs: list[Job], queued: float | None, attempts: list[int | None]) -> list[Result | _Target]:
        """Each job's answer from disk (a redelivery), or where its file is to go, in order. The jobs'
        files are examined side by side (``examiners``); the rest runs on this thread."""
        located = [self._guarded(job, queued, attempts[index], partial(self._locate, job))
                   for index, job in enumerate(jobs)]
        found = [(index, where) for index, where in enumerate(located) if isinstance(where, _Located)]
        verdicts = self.examiners.examine_many(
            [(where.path, where.identity[MetaKey.SPEC_HASH], where.identity[MetaKey.CONTENT_ID]) for _, where in found],
            self.storage)
        for (index, where), verdict in zip(found, verdicts):
            located[index] = self._guarded(jobs[index], queued, attempts[index],
                                           partial(self._check, jobs[index], where, verdict, queued, attempts[index]))
        self._answer_from_captures(jobs, located, queued, attempts)  # type: ignore[arg-type]
        return located  # type: ignore[return-value]

    def _answer_from_captures(self, jobs: list[Job], located: list[Result | _Target], queued: float | None,
                              attempts: list[int | None]) -> None:
        """Answer each job still to compute from a noted file of its capture where one answers it
        (``reuse``), in place; the index is read once for the call."""
        waiting = [(index, target) for index, target in enumerate(located) if isinstance(target, _Target)]
        if self.captures is None or not waiting:
            return
        noted = self.captures.find_many([target.identity[MetaKey.CAPTURE_KEY] for _, target in waiting])
        for (index, target), addresses in zip(waiting, noted):
            if addresses:
                answered = self._guarded(jobs[index], queued, attempts[index],
                                         partial(self._from_capture, jobs[index], target, addresses, queued,
                                                 attempts[index]))
                located[index] = answered if answered is not None else target

    def _locate(self, job: Job) -> _Located:
        """Where a job of this worker's model has its file, and the identity that file has when it is this job's."""
        if job.model != self.loaded.name:
            raise JobError(ErrorType.unknown_model,
                           f"this worker serves model {self.loaded.name!r}, not {job.model!r}")
        spec = job.spec()
        path = self.storage.locate(job.run, job.job_id)  # type: ignore[arg-type]
        return _Located(path, self._identity(job, spec), spec)

    def _check(self, job: Job, where: _Located, verdict: Future, queued: float | None,
               attempt: int | None) -> Result | _Target:
        """A job's answer from disk (a redelivery), or where its file is to go; ``verdict``: what
        ``storage.examine.examine`` found at ``where``."""
        path, identity = where.path, where.identity
        existing: Existing = verdict.result()
        if existing.state is OnDisk.taken and not job.replace:
            raise _conflict(job, path)
        if existing.state is OnDisk.matches:
            return self._from_disk(job, path, existing.header, queued, attempt)  # type: ignore[arg-type]
        return _Target(path, {**identity, MetaKey.CAPTURE_KEY: capture_key(where.spec, identity)})

    def _identity(self, job: Job, spec: dict[str, Any]) -> dict[str, str]:
        """What decides the bytes of ``job``'s file on this worker (``fileformat.IDENTITY_KEYS``;
        ``spec``: ``job.spec()``), with its ``content_id``. Raises :class:`JobError` for layers the model lacks."""
        loaded = self.loaded
        identity = {
            MetaKey.FORMAT_VERSION: ff.FORMAT_VERSION,
            MetaKey.SPEC_HASH: content_hash(spec),  # job.spec_hash()
            MetaKey.MODEL_SOURCE: loaded.source,
            MetaKey.MODEL_REVISION: loaded.revision or "",
            MetaKey.WEIGHTS_FINGERPRINT: loaded.weights_fingerprint,
            MetaKey.TOKENIZER_FINGERPRINT: loaded.tokenizer_fingerprint,
            MetaKey.LAYERS: json.dumps(self.preparer.layers_of(job)),
            MetaKey.LAYER_CONVENTION: CONVENTION,
            MetaKey.DTYPE: recorded_name(resolve_output_dtype(job.dtype, loaded.dtype)),
            MetaKey.COMPUTE_DTYPE: recorded_name(loaded.dtype),
            **loaded.quantization_header(),  # a quantized checkpoint's scheme and compute path
        }
        if self._fixes:  # fixes that changed this model's files (only where any: ``model.fixes``)
            identity[MetaKey.COMPUTE_FIXES] = self._fixes
        return {**identity, MetaKey.CONTENT_ID: ff.content_id(identity)}

    def _start(self, job: Job, target: _Target) -> _Started:
        """What the engine is to run for a checked job (tokenized here, on the caller's thread)."""
        prepared = self.preparer.prepare(job)
        output_dtype = resolve_output_dtype(job.dtype, self.loaded.dtype)
        request = EngineRequest(torch.tensor(prepared.token_ids, dtype=torch.long), prepared.layer_ids,
                                want_final=job.final_hidden_states, output_dtype=output_dtype,
                                topk=job.topk or 0, topk_rows=prepared.topk_rows,
                                model_inputs=prepared.model_inputs)
        return _Started(job, target.path, target.identity, prepared, request, output_dtype)

    def _finish(self, started: _Started, future: Future, queued: float | None, attempt: int | None,
                notes: list[tuple[str, str]]) -> Result:
        """A job whose batch came back: checked, written, its ok result; its file added to ``notes``
        where the capture index is to note it."""
        job, prepared, request, path = started.job, started.prepared, started.request, started.path
        try:
            job_slice = future.result()
        except EngineError as exc:
            raise JobError(ENGINE_ERROR_TYPES[type(exc)], str(exc)) from None
        try:  # the slice's host buffer is given back on every path, or the engine stalls for good
            captured = job_slice.wait()
            if captured.non_finite:
                raise _non_finite(recorded_name(started.output_dtype))
            tensors = self._tensors(job, prepared, request, captured)
            write_s = self._write(job, path, tensors, self._metadata(job, started.identity,
                                                                    self._computed(job, prepared)))
            if self.sampler is not None and self.sampler.wants(job, request):
                self._sample(job, request, tensors)
        finally:
            job_slice.release()
        self._note_capture(started.identity, path, notes)
        if prepared.warning:
            log.warning("job %s: %s", job.job_id, prepared.warning)
        return self._ok(job, path, len(prepared.token_ids), prepared.layer_ids, recorded_name(started.output_dtype),
                        Timings(queued=queued, compute=captured.compute_s, write=write_s), attempt,
                        started.identity[MetaKey.SPEC_HASH], warning=prepared.warning)

    @staticmethod
    def _tensors(job: Job, prepared: PreparedInput, request: EngineRequest,
                 captured: Captured) -> dict[str, torch.Tensor]:
        """The file's tensors (``layertap.protocol.fileformat`` names) for what the job asked."""
        tensors = {ff.HIDDEN_STATES: captured.hidden_states, ff.TOKEN_IDS: request.token_ids}
        if captured.hidden_scale is not None:
            tensors[ff.HIDDEN_STATES + ff.SCALE_SUFFIX] = captured.hidden_scale
        if prepared.loss_mask is not None:
            tensors[ff.LOSS_MASK] = torch.tensor(prepared.loss_mask, dtype=torch.uint8)
        if prepared.image_token_mask is not None:
            tensors[ff.IMAGE_TOKEN_MASK] = torch.tensor(prepared.image_token_mask, dtype=torch.uint8)
        if job.final_hidden_states:
            tensors[ff.FINAL_HIDDEN_STATES] = captured.final_hidden_states  # type: ignore[assignment]
            if captured.final_scale is not None:
                tensors[ff.FINAL_HIDDEN_STATES + ff.SCALE_SUFFIX] = captured.final_scale
        if job.topk:
            tensors[ff.TOPK_LOGPROBS], tensors[ff.TOPK_IDS] = dense_topk(  # type: ignore[arg-type]
                request.num_tokens, prepared.topk_rows, captured.topk_logprobs, captured.topk_ids)
        return tensors

    def _from_disk(self, job: Job, path: str, header: ff.FileHeader, queued: float | None,
                   attempt: int | None) -> Result:
        """The ok result of a verified file whose content identity is this job's on this worker."""
        result = self._ok(job, path, header.tensors[ff.TOKEN_IDS]["shape"][0], ff.layers_of(header),
                          header.metadata[MetaKey.DTYPE], Timings(queued=queued), attempt,
                          header.metadata[MetaKey.SPEC_HASH])
        result.cached = True
        return result

    def _from_capture(self, job: Job, target: _Target, noted: list[str], queued: float | None,
                      attempt: int | None) -> Result | None:
        """The ok result of a job answered from a file of its capture (its own file written from it,
        no forward), or None when none of the ``noted`` files answers it."""
        path, identity = target.path, target.identity
        layers = json.loads(identity[MetaKey.LAYERS])
        capture = find_capture(self.captures, self.storage, identity[MetaKey.CAPTURE_KEY], layers, noted)  # type: ignore[arg-type]
        if capture is None:
            return None
        output_dtype = resolve_output_dtype(job.dtype, self.loaded.dtype)
        try:
            tensors = derived_tensors(capture, layers, output_dtype, self.loaded.dtype)
        except NonFinite:
            raise _non_finite(identity[MetaKey.DTYPE]) from None
        write_s = self._write(job, path, tensors, self._metadata(job, identity, computed_options(capture.header)))
        result = self._ok(job, path, tensors[ff.TOKEN_IDS].shape[0], layers, identity[MetaKey.DTYPE],
                          Timings(queued=queued, write=write_s), attempt, identity[MetaKey.SPEC_HASH])
        return result.model_copy(update={"captured_from": capture.address})

    def _write(self, job: Job, path: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> float:
        """Write the job's file (``writer.write_job_file``); the seconds it took. Raises :class:`JobError`."""
        write_start = time.perf_counter()
        try:
            write_job_file(path, tensors, metadata, self.storage, replace=bool(job.replace))
        except FileTaken:
            raise _conflict(job, path) from None
        except (OSError, SafetensorError) as exc:  # safetensors reports a full disk as its own error
            fault = STORAGE_FAULT if is_storage_fault(exc) else ""
            raise JobError(ErrorType.write_failed, f"{fault}could not write {path}: {exc}") from None
        return time.perf_counter() - write_start

    def _sample(self, job: Job, request: EngineRequest, tensors: dict[str, torch.Tensor]) -> None:
        """Hand a sampled row, its file written, to the sampler (``sampling``: measured later, noted as
        waiting now, before its result is published); raises :class:`JobError` when it cannot be noted."""
        try:
            self.sampler.defer(job, request, {name: tensor.clone() for name, tensor in tensors.items()})  # type: ignore[union-attr]
        except Exception as exc:  # the ledger is away past its wait: the job retries, answered from its file
            raise JobError(ErrorType.internal, f"could not note sampled row {job.job_id} of run {job.run} as "
                                               f"waiting to be measured: {type(exc).__name__}: {exc}") from None

    def _note_capture(self, identity: dict[str, str], path: str, notes: list[tuple[str, str]]) -> None:
        """Add a computed file to ``notes`` (for the capture index), where it holds the computed values."""
        if self.captures is not None and holds_computed_values(identity[MetaKey.DTYPE],
                                                               identity[MetaKey.COMPUTE_DTYPE]):
            notes.append((identity[MetaKey.CAPTURE_KEY], path))

    def _computed(self, job: Job, prepared: PreparedInput) -> dict[str, str]:
        """The header fields of how a job's states were computed here (``reuse.COMPUTED_KEYS``)."""
        loaded = self.loaded
        options = {MetaKey.BATCHING: loaded.batching.name, MetaKey.ARCHITECTURE: loaded.architecture}
        if prepared.loss_mask is not None:
            options[MetaKey.LOSS_ON] = job.loss_on
        if job.topk:
            options.update({MetaKey.TOPK: str(job.topk), MetaKey.TOPK_ON: job.topk_on})
        if loaded.capture.stream.copies > 1:
            options[MetaKey.RESIDUAL_COPIES] = str(loaded.capture.stream.copies)
        if prepared.image_token_mask is not None:
            options[MetaKey.IMAGE_FEATURES] = image_features_note(loaded.model, loaded.decoder, loaded.num_layers)
        return options

    def _metadata(self, job: Job, identity: dict[str, str], computed: dict[str, str]) -> dict[str, str]:
        """A job's file header: the job's names and options, its ``identity``, how it was ``computed``."""
        loaded = self.loaded
        options = dict(computed)
        if job.metadata is not None:
            options[MetaKey.JOB_METADATA] = job.metadata
        if job.provenance is not None:
            options[MetaKey.PROVENANCE] = json.dumps(job.provenance, sort_keys=True)
        return {
            MetaKey.FORMAT: ff.FORMAT_NAME,
            MetaKey.MODEL: loaded.name,
            MetaKey.NUM_LAYERS: str(loaded.num_layers),
            MetaKey.JOB_ID: job.job_id or "",
            MetaKey.RUN: job.run,
            **identity,
            **options,
        }

    def _ok(self, job: Job, path: str, num_tokens: int, layers: list[int], dtype: str, timings: Timings,
            attempt: int | None, spec_hash: str, *, warning: str | None = None) -> Result:
        return Result(job_id=job.job_id, run=job.run, status=Status.ok, path=str(path), num_tokens=num_tokens,
                      layers=layers, dtype=dtype, model=self.loaded.name, worker=self.worker_name, timings=timings,
                      metadata=job.metadata, warning=warning, attempt=attempt, spec_hash=spec_hash)

    def _error(self, job_id: str, run: str, exc: JobError, timings: Timings, *, job: Job | None = None,
               attempt: int | None = None) -> Result:
        return Result(job_id=job_id, run=run, status=Status.error, error_type=exc.error_type, error=exc.message,
                      model=job.model if job else None, worker=self.worker_name, timings=timings,
                      metadata=job.metadata if job else None, attempt=attempt)
