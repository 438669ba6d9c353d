"""The batching engine: one thread owns the model and packs many jobs into each forward.

Callers (Celery task threads, or the in-process Extractor) :meth:`Engine.submit` a
tokenized request and block on its future. The engine thread takes pending requests
in arrival order, fills a batch up to ``token_budget`` tokens (the head of the queue
always goes first, later requests fill the gaps), packs them into one row with
restarting positions (see ``packed_attention``), runs the decoder until the last
wanted layer, and on a GPU starts an asynchronous copy of the captured layers to
pinned host memory on a side stream, then goes straight on to the next batch. A job's
:class:`JobSlice` waits for that copy only when its caller reads it, on the caller's
thread. At most ``host_buffers`` batches are between the GPU and the writers at once;
when writers fall behind the engine waits (counted as GPU idle time).

Out of memory on a batch splits it in halves and retries; a single request that still
does not fit fails with ``out_of_memory``.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from producer.schema import ErrorType
from worker.capture import LayerCapture, StopForward
from worker.errors import JobError
from worker.model_loading import LoadedModel
from worker.packed_attention import packed_sequences, use_packed_attention

log = logging.getLogger(__name__)


def compile_decoder_layers(loaded: LoadedModel) -> None:
    """``torch.compile`` each decoder layer's ``forward`` with dynamic shapes: norms, rotary,
    MLP and residual adds fuse; attention stays eager (``packed_attention`` is excluded)
    and the capture hooks stay outside (they run in ``Module.__call__``). Identical layers
    share one compiled graph; the engine's warm-up pays the compile time."""
    for layer in loaded.layers:
        layer.forward = torch.compile(layer.forward, dynamic=True)


@dataclass
class EngineRequest:
    """One job's tokens and wanted layers (resolved ids, in the job's order)."""

    token_ids: torch.Tensor  # int64 [T] on the CPU
    layer_ids: list[int]
    want_final: bool = False
    future: Future = field(default_factory=Future)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])


@dataclass
class BatchOutput:
    """One batch's captured tensors on the host, shared by its jobs until all release."""

    hidden: torch.Tensor  # [T_batch, U, H]; U = union of the batch's layers, ascending
    final: torch.Tensor | None  # [T_batch, H] after the final norm, if any job asked
    non_finite: torch.Tensor  # bool [T_batch]: token has NaN/Inf in any captured layer
    layer_ids: list[int]
    ready: torch.cuda.Event | None  # set when the device->host copy is done
    started: float
    on_free: Callable[[], None]
    refs: int
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class Captured:
    """A job's states, on the CPU. Views into the batch's buffer: call ``release`` when written."""

    hidden_states: torch.Tensor  # [T, n_layers, H] in the job's layer order
    final_hidden_states: torch.Tensor | None
    non_finite: bool
    compute_s: float
    release: Callable[[], None]


@dataclass
class JobSlice:
    """A job's place in a batch output; :meth:`wait` turns it into :class:`Captured`."""

    batch: BatchOutput
    start: int
    end: int
    slots: list[int]
    _released: bool = False

    def wait(self) -> Captured:
        if self.batch.ready is not None:
            self.batch.ready.synchronize()
        compute_s = time.perf_counter() - self.batch.started
        hidden = self.batch.hidden[self.start:self.end]
        if self.slots != list(range(hidden.shape[1])):
            hidden = hidden[:, self.slots]
        final = None if self.batch.final is None else self.batch.final[self.start:self.end]
        non_finite = bool(self.batch.non_finite[self.start:self.end].any())
        return Captured(hidden, final, non_finite, compute_s, self.release)

    def release(self) -> None:
        with self.batch.lock:
            if self._released:
                return
            self._released = True
            self.batch.refs -= 1
            last = self.batch.refs == 0
        if last:
            self.batch.on_free()


@dataclass
class EngineStats:
    batches: int = 0
    tokens: int = 0
    jobs: int = 0
    busy_s: float = 0.0  # device time spent in batches (forward + capture), from device events
    oom_splits: int = 0


class Engine:
    """Owns the model on one thread. ``submit`` is thread-safe."""

    def __init__(self, loaded: LoadedModel, *, token_budget: int = 16384, max_batch_jobs: int = 256,
                 batch_wait_s: float = 0.002, host_buffers: int = 3, compile_layers: bool = False):
        self.loaded = loaded
        self.token_budget = token_budget
        self.max_batch_jobs = max_batch_jobs
        self.batch_wait_s = batch_wait_s
        self.stats = EngineStats()
        self.on_batch: Callable[[int, int], None] | None = None  # called (jobs, tokens) after each batch
        self._cuda = loaded.device.type == "cuda"
        self._capture = LayerCapture(loaded)
        self._pending: deque[EngineRequest] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._in_flight = threading.BoundedSemaphore(host_buffers)
        self._timing: deque[tuple[object, object]] = deque()
        self._timing_lock = threading.Lock()
        self._copy_stream = torch.cuda.Stream(loaded.device) if self._cuda else None
        use_packed_attention(loaded.model)
        if compile_layers:
            compile_decoder_layers(loaded)
        self._thread = threading.Thread(target=self._loop, name="layertap-engine", daemon=True)
        self._thread.start()

    # -- public -----------------------------------------------------------------------
    def submit(self, request: EngineRequest) -> Future:
        """Queue a request; its future resolves to a :class:`JobSlice` or raises :class:`JobError`."""
        with self._cond:
            if self._stopping:
                raise JobError(ErrorType.internal, "the engine is shutting down")
            self._pending.append(request)
            self._cond.notify()
        return request.future

    def warm_up(self, num_tokens: int = 512) -> None:
        """Run one throwaway batch (kernel selection, allocator, lazy init) before real jobs."""
        tokens = torch.randint(0, self.loaded.vocab_size, (min(num_tokens, self.token_budget),))
        self.submit(EngineRequest(tokens, [self.loaded.num_layers])).result().wait().release()

    def pending(self) -> int:
        with self._cond:
            return len(self._pending)

    def stop(self, timeout: float = 60.0) -> None:
        """Finish what is queued, then stop the engine thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout)
        self._capture.close()

    def busy_seconds(self, wait: bool = True) -> float:
        """Device time spent in finished batches (with ``wait``, first waits for queued device work)."""
        self._collect_timings(block=wait)
        return self.stats.busy_s

    def snapshot(self) -> dict[str, float]:
        """Counters for monitoring (JSON-ready); does not wait for the device."""
        return {"batches": self.stats.batches, "jobs": self.stats.jobs, "tokens": self.stats.tokens,
                "busy_s": round(self.busy_seconds(wait=False), 6), "oom_splits": self.stats.oom_splits,
                "pending": self.pending()}

    # -- engine thread ----------------------------------------------------------------
    def _loop(self) -> None:
        if self._cuda:
            torch.cuda.set_device(self.loaded.device)
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            try:
                self._run_or_split(batch)
            except Exception as exc:  # a bug: fail these jobs, keep serving
                log.exception("engine batch failed")
                for request in batch:
                    if not request.future.done():
                        request.future.set_exception(JobError(ErrorType.internal, f"{type(exc).__name__}: {exc}"))

    def _next_batch(self) -> list[EngineRequest] | None:
        with self._cond:
            while not self._pending and not self._stopping:
                self._cond.wait()
            if not self._pending:
                return None
            deadline = time.monotonic() + self.batch_wait_s
            while (sum(r.num_tokens for r in self._pending) < self.token_budget
                   and len(self._pending) < self.max_batch_jobs and not self._stopping):
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._cond.wait(remaining):
                    break
            batch = [self._pending.popleft()]
            tokens = batch[0].num_tokens
            kept: deque[EngineRequest] = deque()
            while self._pending and len(batch) < self.max_batch_jobs and tokens < self.token_budget:
                request = self._pending.popleft()
                if tokens + request.num_tokens <= self.token_budget:
                    batch.append(request)
                    tokens += request.num_tokens
                else:
                    kept.append(request)
            kept.extend(self._pending)
            self._pending = kept
            return batch

    def _run_or_split(self, batch: list[EngineRequest]) -> None:
        try:
            output: BatchOutput | None = self._forward(batch)
        except torch.OutOfMemoryError:
            output = None  # handled below, once the traceback (and the activations it holds) is gone
        if output is None:
            self._release_cached_memory()
            if len(batch) == 1:
                request = batch[0]
                request.future.set_exception(JobError(
                    ErrorType.out_of_memory,
                    f"{request.num_tokens} tokens do not fit in device memory even alone; "
                    "lower max_length or use a larger GPU"))
                return
            self.stats.oom_splits += 1
            half = len(batch) // 2
            log.warning("out of memory on a batch of %d jobs; splitting", len(batch))
            self._run_or_split(batch[:half])
            self._run_or_split(batch[half:])
            return
        start = 0
        for request in batch:
            end = start + request.num_tokens
            slots = [output.layer_ids.index(layer_id) for layer_id in request.layer_ids]
            request.future.set_result(JobSlice(output, start, end, slots))
            start = end
        if self.on_batch is not None:
            self.on_batch(len(batch), start)

    def _release_cached_memory(self) -> None:
        if self._cuda:
            torch.cuda.empty_cache()

    def _forward(self, batch: list[EngineRequest]) -> BatchOutput:
        device = self.loaded.device
        lengths = [request.num_tokens for request in batch]
        total = sum(lengths)
        bounds = [0, *itertools.accumulate(lengths)]
        ids = torch.cat([request.token_ids for request in batch])
        positions = torch.cat([torch.arange(n, dtype=torch.long) for n in lengths])
        if self._cuda:
            ids = ids.pin_memory().to(device, non_blocking=True)
            positions = positions.pin_memory().to(device, non_blocking=True)
        union = sorted(set().union(*(request.layer_ids for request in batch)))
        want_final = any(request.want_final for request in batch)
        hidden_size = self.loaded.hidden_size
        host_hidden = torch.empty(total, len(union), hidden_size, dtype=self.loaded.dtype, pin_memory=self._cuda)
        host_final = (torch.empty(total, hidden_size, dtype=self.loaded.dtype, pin_memory=self._cuda)
                      if want_final else None)
        host_flags = torch.empty(total, dtype=torch.bool, pin_memory=self._cuda)

        self._in_flight.acquire()
        try:
            started = time.perf_counter()
            events = self._record_start()
            with (torch.inference_mode(), packed_sequences(bounds),
                  self._capture.capture(union, total, want_final) as (staging, final)):
                try:
                    self.loaded.decoder(input_ids=ids[None], position_ids=positions[None], use_cache=False)
                except StopForward:
                    pass
                flags = ~torch.isfinite(staging).all(dim=2).all(dim=1)
                if final is not None:
                    flags |= ~torch.isfinite(final).all(dim=1)
                ready = self._copy_out(events, (staging, host_hidden), (final, host_final), (flags, host_flags))
        except BaseException:
            self._in_flight.release()
            raise
        self.stats.batches += 1
        self.stats.jobs += len(batch)
        self.stats.tokens += total
        return BatchOutput(host_hidden, host_final, host_flags, union, ready, started,
                           on_free=self._in_flight.release, refs=len(batch))

    def _record_start(self) -> tuple[object, object]:
        if self._cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            return start, end
        return time.perf_counter(), None

    def _copy_out(self, events: tuple[object, object], *pairs: tuple[torch.Tensor | None, torch.Tensor | None]):
        """Copy device tensors into their host buffers; on a GPU asynchronously, on a side stream."""
        start, end = events
        if not self._cuda:
            for source, target in pairs:
                if source is not None:
                    target.copy_(source)
            self.stats.busy_s += time.perf_counter() - start  # type: ignore[operator]
            return None
        end.record()  # type: ignore[union-attr]
        with self._timing_lock:
            self._timing.append((start, end))
        self._collect_timings(block=False)
        stream = self._copy_stream
        stream.wait_stream(torch.cuda.current_stream())  # type: ignore[union-attr]
        with torch.cuda.stream(stream):
            for source, target in pairs:
                if source is not None:
                    target.copy_(source, non_blocking=True)
                    source.record_stream(stream)
            ready = torch.cuda.Event()
            ready.record(stream)
        return ready

    def _collect_timings(self, block: bool) -> None:
        """Fold finished batches' device event times into ``stats.busy_s``."""
        with self._timing_lock:
            while self._timing:
                start, end = self._timing[0]
                if not block and not end.query():  # type: ignore[attr-defined]
                    return
                end.synchronize()  # type: ignore[attr-defined]
                self._timing.popleft()
                self.stats.busy_s += start.elapsed_time(end) / 1000.0  # type: ignore[attr-defined]
