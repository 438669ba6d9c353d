"""The measured error of a run's certificate (``layertap.protocol.certificate``): a sample of the
rows this worker computes, each computed again alone through the model's own forward
(``layertap.worker.model.alone``) on the engine's thread and device, compared per layer with
what its file holds.

Which rows: one in ``every`` by a hash of its run and job id, and the first ``minimum`` this
worker computes of each run, so a small run is sampled too. Rows answered from disk or from a
capture run no forward and are not sampled (the rows that computed their states were); nor are
chats with images (their forward runs the vision tower; the load-time image check covers them).

When: a sampled row's file is written and its result published as any other's; the row is noted as
waiting in the run's ledger first (``SampleBook.waiting``, before its result can be seen), and
measured when the engine has no batch work queued, or within ``within_s`` seconds
(``Engine.call_when_idle``), so measuring holds up no batch and no result. ``layertap certify``
waits for a run's waiting rows. Rows waiting hold a copy of their states (at most ``max_bytes``:
beyond it they are measured at once); :meth:`Sampler.close` measures every waiting row.

The bound (``certificate.sample_bound``): the batching tolerance of the compute dtype
(``layertap.worker.engine.self_check``), plus the storage's rounding for states stored narrower than
computed. Every measured row is recorded (``SampleBook.record``: the worker's ledger) with what this
worker is (:func:`worker_facts`); a row over its bound fails its run's certificate, naming it, and is
logged as an error here.
"""

from __future__ import annotations

import hashlib
import logging
import math
import platform
import threading
from collections import OrderedDict, deque
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Protocol

import torch

from layertap.protocol import fileformat as ff
from layertap.protocol.certificate import MEASURE_WITHIN_S, SampleRow, sample_bound
from layertap.protocol.schema import Job
from layertap.worker.engine.engine import Engine
from layertap.worker.engine.errors import EngineStopped
from layertap.worker.engine.output_dtype import recorded_name
from layertap.worker.engine.records import EngineRequest
from layertap.worker.engine.self_check import HALF_TOLERANCE, TOLERANCE, CheckReport, relative_error_per_layer
from layertap.worker.model.alone import start_alone_states
from layertap.worker.model.loading import LoadedModel

log = logging.getLogger(__name__)

#: Runs whose first rows a worker counts (the oldest are forgotten beyond it).
RUNS_REMEMBERED = 4096
#: Packages whose versions a certificate states.
VERSIONED = ("layertap", "torch", "transformers", "safetensors", "accelerate", "kernels")

#: Bytes of states that sampled rows waiting to be measured may hold before they are measured at once.
WAITING_BYTES = 1 << 30


class SampleBook(Protocol):
    """Where a worker keeps its sampled rows (the run's ledger, ``layertap.worker.queue.run_records``).
    Each method raises when it cannot keep what it is given."""

    def waiting(self, run: str, job_id: str, worker: str) -> None:
        """The row is sampled and waits to be measured by ``worker``."""

    def record(self, run: str, row: SampleRow, facts: dict[str, Any]) -> None:
        """The measured row, with what its worker is; no longer waiting."""

    def dropped(self, run: str, job_id: str) -> None:
        """The row could not be measured: no longer waiting, and not sampled."""


@dataclass(frozen=True)
class SamplingPlan:
    """Which rows a worker samples and where it keeps them (the worker's ``sample_*`` settings)."""

    book: SampleBook
    every: int
    minimum: int
    within_s: float = MEASURE_WITHIN_S


@dataclass
class _Waiting:
    """A sampled row whose file is written, waiting for its alone forward (``reference``)."""

    job: Job
    request: EngineRequest
    tensors: dict[str, torch.Tensor]
    reference: Future
    nbytes: int


def worker_facts(loaded: LoadedModel, report: CheckReport | None, every: int, minimum: int) -> dict[str, Any]:
    """What a certificate states of this worker: library versions, device, layout, sampling."""
    versions = {}
    for package in VERSIONED:
        try:
            versions[package] = version(package)
        except PackageNotFoundError:
            continue
    device = loaded.device
    return {"versions": {**versions, "python": platform.python_version(), "cuda": torch.version.cuda or ""},
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
            "architecture": loaded.architecture, "batching": loaded.batching.name,
            "batching_reason": loaded.batching.reason, "attention": loaded.native_attention,
            "stages": len(loaded.split.stages) if loaded.split else 1, "quant_compute": loaded.quant_compute,
            "compiled": loaded.compiled,
            "self_check": report.describe() if report else None, "sample_every": every, "sample_min": minimum}


def stored_states(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """A file's ``hidden_states`` as values (float8 codes times their row scales)."""
    hidden = tensors[ff.HIDDEN_STATES]
    scale = tensors.get(ff.HIDDEN_STATES + ff.SCALE_SUFFIX)
    return hidden if scale is None else hidden.float() * scale.unsqueeze(-1)


def sample_row(job_id: str, worker: str, layers: list[int], got: torch.Tensor, reference: torch.Tensor, stored: str,
               compute_dtype: torch.dtype) -> SampleRow:
    """The measured row of a file's states ``got`` (values, states stored as ``stored``) against the
    same tokens run alone (``reference``, computed in ``compute_dtype``), per layer, with its bound."""
    compute = recorded_name(compute_dtype)
    errors = relative_error_per_layer(got, reference).tolist()
    return SampleRow(job_id=job_id, worker=worker, tokens=got.shape[0], layers=list(layers),
                     errors=[error if math.isfinite(error) else None for error in errors],
                     bound=sample_bound(TOLERANCE.get(compute_dtype, HALF_TOLERANCE), stored, compute),
                     dtype=stored, compute_dtype=compute)


class Sampler:
    """Thread-safe; one per worker. Its thread compares and records the measured rows."""

    def __init__(self, engine: Engine, worker: str, facts: dict[str, Any], book: SampleBook, *, every: int,
                 minimum: int, within_s: float = MEASURE_WITHIN_S, max_bytes: int = WAITING_BYTES):
        self.engine, self.worker, self.facts, self.book = engine, worker, facts, book
        self.every, self.minimum, self.within_s, self.max_bytes = every, minimum, within_s, max_bytes
        self._seen: OrderedDict[str, int] = OrderedDict()  # run -> rows this worker sampled as its first
        self._lock = threading.Lock()
        self._cond = threading.Condition()
        self._waiting: deque[_Waiting] = deque()
        self._bytes = 0
        self._measuring = self._closing = False
        self._thread = threading.Thread(target=self._loop, name="layertap-sampler", daemon=True)
        self._thread.start()

    def wants(self, job: Job, request: EngineRequest) -> bool:
        """Whether this computed row is sampled (called once per computed row)."""
        if request.model_inputs is not None:
            return False
        digest = hashlib.blake2b(f"{job.run}/{job.job_id}".encode(), digest_size=8).digest()
        if self.every and int.from_bytes(digest, "big") % self.every == 0:
            return True
        with self._lock:
            count = self._seen.pop(job.run, 0)
            self._seen[job.run] = count + 1 if count < self.minimum else count
            while len(self._seen) > RUNS_REMEMBERED:
                self._seen.popitem(last=False)
        return count < self.minimum

    def defer(self, job: Job, request: EngineRequest, tensors: dict[str, torch.Tensor]) -> None:
        """A sampled row whose file holds ``tensors`` (its own copies; its states in
        ``request.output_dtype``): noted as waiting (raises when the book cannot keep it), then queued
        to be measured. Call it before the row's result is published."""
        if self._closing:
            log.warning("job %s (run %s): sampled after the sampler closed; not measured", job.job_id, job.run)
            return
        self.book.waiting(job.run, job.job_id or "", self.worker)
        try:
            reference = self.engine.call_when_idle(
                partial(start_alone_states, self.engine.loaded, request.token_ids, request.layer_ids), self.within_s)
        except EngineStopped:
            self._dropped(job, "the engine is stopping")
            return
        nbytes = sum(tensor.nbytes for tensor in tensors.values())
        with self._cond:
            self._waiting.append(_Waiting(job, request, tensors, reference, nbytes))
            self._bytes += nbytes
            crowded = self._bytes > self.max_bytes
            self._cond.notify_all()
        if crowded:
            self.engine.hurry_idle_calls()

    def close(self, timeout: float | None = None) -> None:
        """Measure every waiting row now (the engine still runs), then stop the sampler's thread."""
        self.engine.hurry_idle_calls()
        with self._cond:
            self._cond.wait_for(lambda: not self._waiting and not self._measuring, timeout)
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._waiting or self._closing)
                if not self._waiting:
                    return
                waiting, self._measuring = self._waiting[0], True
            try:
                self._measure(waiting)
            except Exception:  # never lose the thread: the row stays waiting in the book, as logged
                log.exception("job %s (run %s): its sampled row could not be measured or recorded",
                              waiting.job.job_id, waiting.job.run)
            with self._cond:
                self._waiting.popleft()
                self._bytes -= waiting.nbytes
                self._measuring = False
                self._cond.notify_all()

    def _measure(self, waiting: _Waiting) -> None:
        """Compare a waiting row with its alone forward and record it (a failed alone forward: dropped)."""
        job, request, loaded = waiting.job, waiting.request, self.engine.loaded
        try:
            reference = waiting.reference.result().result()  # the engine's call, then the copy to the host
        except Exception as exc:  # out of memory alone, a stopping engine: the row stays unmeasured
            self._dropped(job, f"{type(exc).__name__}: {exc}")
            return
        row = sample_row(job.job_id or "", self.worker, request.layer_ids, stored_states(waiting.tensors), reference,
                         recorded_name(request.output_dtype or loaded.dtype), loaded.dtype)
        self.book.record(job.run, row, self.facts)
        if not row.passed:
            log.error("run %s: sampled %s over its bound: computed alone it differs from its batched states; "
                      "the run fails its certificate (`layertap certify`)", job.run, row.describe())

    def _dropped(self, job: Job, why: str) -> None:
        log.warning("job %s (run %s): its sampled row could not be run alone, so it is not measured: %s",
                    job.job_id, job.run, why)
        self.book.dropped(job.run, job.job_id or "")
