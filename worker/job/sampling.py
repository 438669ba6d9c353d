"""The measured error of a run's certificate (``layertap.protocol.certificate``): a sample of the
rows this worker computes, each computed again alone through the model's own forward
(``layertap.worker.model.alone``) on the engine's thread and device, compared per layer with
what its file is to hold.

Which rows: one in ``every`` by a hash of its run and job id, and the first ``minimum`` this
worker computes of each run, so a small run is sampled too. Rows answered from disk or from a
capture run no forward and are not sampled (the rows that computed their states were); nor are
chats with images (their forward runs the vision tower; the load-time image check covers them).
A sampled row's batch host buffer is given back before it waits (its tensors are copied), and the
alone forward runs between two batches: the engine never waits for it.

The bound (``certificate.sample_bound``): the batching tolerance of the compute dtype
(``layertap.worker.engine.self_check``), plus the storage's rounding for states stored narrower than
computed. Every measured row is recorded (``record``: the worker's ledger) with what this worker
is (:func:`worker_facts`); the job pipeline fails a row over its bound with ``sample_over_bound``.
"""

from __future__ import annotations

import hashlib
import logging
import math
import platform
import threading
from collections import OrderedDict
from collections.abc import Callable
from functools import partial
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import torch

from layertap.protocol import fileformat as ff
from layertap.protocol.certificate import SampleRow, sample_bound
from layertap.protocol.schema import Job
from layertap.worker.engine.engine import Engine
from layertap.worker.engine.output_dtype import recorded_name
from layertap.worker.engine.records import EngineRequest
from layertap.worker.engine.self_check import HALF_TOLERANCE, TOLERANCE, CheckReport, relative_error_per_layer
from layertap.worker.model.alone import alone_states
from layertap.worker.model.loading import LoadedModel

log = logging.getLogger(__name__)

#: Runs whose first rows a worker counts (the oldest are forgotten beyond it).
RUNS_REMEMBERED = 4096
#: Packages whose versions a certificate states.
VERSIONED = ("layertap", "torch", "transformers", "safetensors", "accelerate", "kernels")

#: ``record(run, row, facts)``: keep a measured row of ``run`` with what its worker is.
Record = Callable[[str, SampleRow, dict[str, Any]], None]


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
    """Thread-safe; one per worker."""

    def __init__(self, engine: Engine, worker: str, facts: dict[str, Any], record: Record, *, every: int,
                 minimum: int):
        self.engine, self.worker, self.facts, self.record = engine, worker, facts, record
        self.every, self.minimum = every, minimum
        self._seen: OrderedDict[str, int] = OrderedDict()  # run -> rows this worker sampled as its first
        self._lock = threading.Lock()

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

    def measure(self, job: Job, request: EngineRequest, tensors: dict[str, torch.Tensor]) -> SampleRow | None:
        """The sampled row of a job whose file is to hold ``tensors`` (its states in ``request.output_dtype``),
        recorded; None (logged) when its alone forward failed: the row is then unsampled, not failed."""
        loaded = self.engine.loaded
        try:
            reference = self.engine.call(partial(alone_states, loaded, request.token_ids, request.layer_ids)).result()
        except Exception as exc:  # out of memory alone, a stopping engine: the row stays unmeasured
            log.warning("job %s (run %s): its sampled row could not be run alone, so it is not measured: %s: %s",
                        job.job_id, job.run, type(exc).__name__, exc)
            return None
        row = sample_row(job.job_id or "", self.worker, request.layer_ids, stored_states(tensors), reference,
                         recorded_name(request.output_dtype or loaded.dtype), loaded.dtype)
        self.record(job.run, row, self.facts)
        if not row.passed:
            log.error("run %s: sampled %s over its bound: computed alone it differs from its batched states",
                      job.run, row.describe())
        return row
