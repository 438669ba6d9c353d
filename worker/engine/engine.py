"""The batching engine: one thread owns the model and packs many jobs into each forward.

Callers (Celery task threads, or the in-process Extractor) :meth:`Engine.submit` a
tokenized request and block on its future. The engine thread takes pending requests
in arrival order, fills a batch up to ``token_budget`` tokens (``batch_schedule``: the
head of the queue always goes first), lays them out the way the model's batching plan
says (``batching``: one packed row with restarting positions, or a right-padded batch
of similar lengths; ``batch_inputs``), runs the decoder until the last
wanted layer (through the final norm when a job wants ``final_hidden_states`` or teacher
top-k, which is then computed on the device for only the asked positions), casts the
states to the batch's output dtype (a batch has one: requests of another wait for the
next batch), and on a GPU starts an asynchronous copy of the outputs to
pinned host memory on a side stream, then goes straight on to the next batch. A job's
:class:`JobSlice` waits for that copy only when its caller reads it, on the caller's
thread. At most ``host_buffers`` batches are between the GPU and the writers at once, each
in a host buffer allocated at start (``host_staging``); when writers fall behind the engine
waits for a free buffer (counted as GPU idle time) *before* it forms the next batch, so
the batch takes in every job that arrived meanwhile.

Out of memory on a batch splits it in halves and retries; a single request that still
does not fit fails with ``out_of_memory``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from producer.protocol.schema import ErrorType
from worker.engine.capture import LayerCapture, StopForward
from worker.engine.host_buffers import HostSlot, HostStaging, slot_capacity
from worker.engine.inputs import build_inputs, pad_multiple
from worker.engine.output_dtype import non_finite_rows, to_output
from worker.engine.scheduler import MAX_PADDING, select_batch
from worker.engine.teacher import TeacherHead
from worker.job.errors import JobError
from worker.model.batching import BatchingPath
from worker.model.loading import LoadedModel

log = logging.getLogger(__name__)


def is_device_fatal(exc: BaseException) -> bool:
    """A device error after which this process's CUDA context cannot be trusted (illegal
    address, device-side assert, ECC, launch failure). Out-of-memory is not one."""
    if isinstance(exc, torch.OutOfMemoryError):
        return False
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("CUDA error" in text or "device-side assert" in text)


@dataclass
class EngineRequest:
    """One job's tokens and wanted layers (resolved ids, in the job's order), and its extras."""

    token_ids: torch.Tensor  # int64 [T] on the CPU
    layer_ids: list[int]
    want_final: bool = False
    output_dtype: torch.dtype | None = None  # None: the model's dtype; float8_e4m3fn: quantized per row
    topk: int = 0  # > 0: the teacher's top-k next-token log-probs
    topk_rows: list[int] | None = None  # positions to compute them at (ascending); None: every position
    future: Future = field(default_factory=Future)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])


@dataclass
class BatchOutput:
    """One batch's captured tensors on the host, shared by its jobs until all release."""

    hidden: torch.Tensor  # [T_batch, U, H]; U = union of the batch's layers, ascending
    hidden_scale: torch.Tensor | None  # float32 [T_batch, U] for float8 output
    final: torch.Tensor | None  # [T_batch, H] after the final norm, if any job asked
    final_scale: torch.Tensor | None  # float32 [T_batch] for float8 output
    topk_logprobs: torch.Tensor | None  # float32 [N, k_max]: the asked rows of the batch's top-k jobs, in order
    topk_ids: torch.Tensor | None  # int32 [N, k_max]
    non_finite: torch.Tensor  # bool [T_batch, U]: NaN/Inf in that token's state of that layer
    final_non_finite: torch.Tensor | None  # bool [T_batch]: NaN/Inf in the post-norm state
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
    hidden_scale: torch.Tensor | None  # float32 [T, n_layers] when float8
    final_hidden_states: torch.Tensor | None
    final_scale: torch.Tensor | None  # float32 [T] when float8
    topk_logprobs: torch.Tensor | None  # float32 [len(topk_rows), k]
    topk_ids: torch.Tensor | None  # int32 [len(topk_rows), k]
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
    topk_rows: slice | None = None  # its rows in the batch's top-k outputs
    topk: int = 0
    want_final: bool = False
    _released: bool = False

    def wait(self) -> Captured:
        if self.batch.ready is not None:
            self.batch.ready.synchronize()
        compute_s = time.perf_counter() - self.batch.started
        batch, tokens = self.batch, slice(self.start, self.end)
        hidden = batch.hidden[tokens]
        hidden_scale = None if batch.hidden_scale is None else batch.hidden_scale[tokens]
        if self.slots != list(range(hidden.shape[1])):
            hidden = hidden[:, self.slots]
            hidden_scale = None if hidden_scale is None else hidden_scale[:, self.slots]
        final = None if batch.final is None else batch.final[tokens]
        final_scale = None if batch.final_scale is None else batch.final_scale[tokens]
        logprobs = ids = None
        if self.topk_rows is not None:
            logprobs = batch.topk_logprobs[self.topk_rows, :self.topk]  # type: ignore[index]
            ids = batch.topk_ids[self.topk_rows, :self.topk]  # type: ignore[index]
        # Only the job's own layers count: another job's layer in the same batch may be broken.
        non_finite = bool(batch.non_finite[tokens][:, self.slots].any())
        if self.want_final and batch.final_non_finite is not None:
            non_finite |= bool(batch.final_non_finite[tokens].any())
        return Captured(hidden, hidden_scale, final, final_scale, logprobs, ids, non_finite, compute_s, self.release)

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
                 batch_wait_s: float = 0.002, max_padding: float = MAX_PADDING, host_buffers: int = 3,
                 staging_layers: int = 4,
                 on_fatal: Callable[[BaseException], None] | None = None):
        """``staging_layers``: how many layers a typical batch captures (the worker's default
        list); the host buffers hold ``token_budget`` tokens of that many layers."""
        self.loaded = loaded
        self.token_budget = token_budget
        self.max_batch_jobs = max_batch_jobs
        self.batch_wait_s = batch_wait_s
        self.max_padding = max_padding
        self.stats = EngineStats()
        self.fatal: BaseException | None = None
        self._on_fatal = on_fatal
        self.on_batch: Callable[[int, int], None] | None = None  # called (jobs, tokens) after each batch
        self._cuda = loaded.device.type == "cuda"
        self._capture = LayerCapture(loaded)
        self._teacher = TeacherHead(loaded) if loaded.lm_head is not None else None
        self._pending: deque[EngineRequest] = deque()
        self._together: deque[list[EngineRequest]] = deque()  # batches asked for as they are
        self._cond = threading.Condition()
        self._stopping = False
        self._staging = HostStaging(host_buffers, slot_capacity(token_budget, staging_layers, loaded.hidden_size,
                                                                loaded.dtype), pinned=self._cuda)
        self._timing: deque[tuple[object, object]] = deque()
        self._timing_lock = threading.Lock()
        self._copy_stream = torch.cuda.Stream(loaded.device) if self._cuda else None
        self._padded = loaded.batching.path is BatchingPath.padded
        self._pad_to = pad_multiple(loaded.device)
        self._thread = threading.Thread(target=self._loop, name="layertap-engine", daemon=True)
        self._thread.start()

    # -- public -----------------------------------------------------------------------
    def submit(self, request: EngineRequest) -> Future:
        """Queue a request; its future resolves to a :class:`JobSlice` or raises :class:`JobError`."""
        return self.submit_many([request])[0]

    def submit_many(self, requests: list[EngineRequest], together: bool = False) -> list[Future]:
        """Queue several requests at once (the next batch sees them all); their futures.
        ``together``: run exactly these as one batch, whatever the policy (the self-check)."""
        for request in requests:
            if request.output_dtype is None:
                request.output_dtype = self.loaded.dtype
        with self._cond:
            if self._stopping:
                raise JobError(ErrorType.internal, "the engine is shutting down")
            if together:
                self._together.append(list(requests))
            else:
                self._pending.extend(requests)
            self._cond.notify()
        return [request.future for request in requests]

    def warm_up(self, num_tokens: int = 512) -> None:
        """Run one throwaway batch (kernel selection, allocator, lazy init) before real jobs."""
        tokens = torch.randint(0, self.loaded.vocab_size, (min(num_tokens, self.token_budget),))
        self.submit(EngineRequest(tokens, [self.loaded.num_layers])).result().wait().release()

    def pending(self) -> int:
        with self._cond:
            return len(self._pending)

    def thread_alive(self) -> bool:
        """Whether the engine thread still runs (it ends only on ``stop`` or a device fault)."""
        return self._thread.is_alive()

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
            except Exception as exc:  # fail these jobs (transient: they are retried), keep serving
                log.exception("engine batch failed")
                fatal = is_device_fatal(exc)
                message = ("device fault; this worker is stopping: " if fatal else "") + f"{type(exc).__name__}: {exc}"
                for request in batch:
                    if not request.future.done():
                        request.future.set_exception(JobError(ErrorType.internal, message))
                if fatal:
                    self._fail_fatally(exc)
                    return

    def _fail_fatally(self, exc: BaseException) -> None:
        """Refuse all further work and tell the owner, which exits non-zero for its supervisor to restart."""
        with self._cond:
            self.fatal, self._stopping = exc, True
            pending = [*self._pending, *(request for batch in self._together for request in batch)]
            self._pending, self._together = deque(), deque()
        for request in pending:
            request.future.set_exception(JobError(ErrorType.internal, f"device fault on this worker: {exc}"))
        if self._on_fatal is not None:
            self._on_fatal(exc)

    def _next_batch(self) -> list[EngineRequest] | None:
        """The next batch, formed once a host buffer is free for it (None: stopped, nothing queued)."""
        with self._cond:
            while not self._pending and not self._together and not self._stopping:
                self._cond.wait()
            if not self._pending and not self._together:
                return None
        self._staging.wait_free()
        with self._cond:
            if self._together:
                return self._together.popleft()
            deadline = time.monotonic() + self.batch_wait_s
            while (sum(r.num_tokens for r in self._pending) < self.token_budget
                   and len(self._pending) < self.max_batch_jobs and not self._stopping):
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._cond.wait(remaining):
                    break
            pending = list(self._pending)
            head_dtype = pending[0].output_dtype
            chosen = select_batch([r.num_tokens for r in pending], [r.output_dtype == head_dtype for r in pending],
                                  padded=self._padded, token_budget=self.token_budget,
                                  max_jobs=self.max_batch_jobs, pad_to=self._pad_to, max_padding=self.max_padding)
            taken = set(chosen)
            self._pending = deque(r for i, r in enumerate(pending) if i not in taken)
            return [pending[i] for i in chosen]

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
        start = topk_start = 0
        for request in batch:
            end = start + request.num_tokens
            slots = [output.layer_ids.index(layer_id) for layer_id in request.layer_ids]
            topk_rows = None
            if request.topk:
                topk_end = topk_start + (request.num_tokens if request.topk_rows is None else len(request.topk_rows))
                topk_rows, topk_start = slice(topk_start, topk_end), topk_end
            request.future.set_result(JobSlice(output, start, end, slots, topk_rows, request.topk,
                                               want_final=request.want_final))
            start = end
        if self.on_batch is not None:
            self.on_batch(len(batch), start)

    def _release_cached_memory(self) -> None:
        if self._cuda:
            torch.cuda.empty_cache()

    def _forward(self, batch: list[EngineRequest]) -> BatchOutput:
        device = self.loaded.device
        inputs = build_inputs([request.token_ids for request in batch], self.loaded.batching.path, device,
                              pad_to=self._pad_to)
        total, bounds = inputs.total, inputs.bounds
        union = sorted(set().union(*(request.layer_ids for request in batch)))
        want_final = any(request.want_final for request in batch)
        topk_rows, topk = self._topk_rows(batch, bounds)
        if topk_rows is not None and self._cuda:
            topk_rows = topk_rows.pin_memory().to(device, non_blocking=True)
        output_dtype = batch[0].output_dtype  # one per batch (see _next_batch)

        slot = self._staging.acquire()
        ready: torch.cuda.Event | None = None

        def free_slot() -> None:  # the last job's release; a job that never waited must not race the copy
            if ready is not None:
                ready.synchronize()
            self._staging.release(slot)

        try:
            started = time.perf_counter()
            events = self._record_start()
            with (torch.inference_mode(),
                  self._capture.capture(union, total, want_final or topk_rows is not None,
                                        rows=inputs.rows) as (staging, final)):
                try:
                    inputs.run(self.loaded.decoder)
                except StopForward:
                    pass
                hidden, hidden_scale = to_output(staging, output_dtype)
                flags = non_finite_rows(staging, hidden)
                final_out = final_scale = final_flags = None
                if want_final:
                    final_out, final_scale = to_output(final, output_dtype)
                    final_flags = non_finite_rows(final, final_out)
                logprobs = topk_ids = None
                if topk_rows is not None:
                    logprobs, topk_ids = self._teacher.topk(final, topk_rows, topk)  # type: ignore[union-attr]
                outputs = (hidden, hidden_scale, final_out, final_scale, logprobs, topk_ids, flags, final_flags)
                host = tuple(self._host_buffer(slot, tensor) for tensor in outputs)
                ready = self._copy_out(events, *zip(outputs, host))
        except BaseException:
            self._staging.release(slot)
            raise
        self.stats.batches += 1
        self.stats.jobs += len(batch)
        self.stats.tokens += total
        return BatchOutput(*host, layer_ids=union, ready=ready, started=started,  # type: ignore[misc]
                           on_free=free_slot, refs=len(batch))

    def _topk_rows(self, batch: list[EngineRequest], bounds: list[int]) -> tuple[torch.Tensor | None, int]:
        """Packed-row positions of every top-k job's asked rows, in batch order, and the largest k."""
        rows = [torch.arange(begin, begin + request.num_tokens) if request.topk_rows is None
                else torch.tensor(request.topk_rows, dtype=torch.long) + begin
                for request, begin in zip(batch, bounds) if request.topk]
        if not rows:
            return None, 0
        return torch.cat(rows), max(request.topk for request in batch)

    @staticmethod
    def _host_buffer(slot: HostSlot, tensor: torch.Tensor | None) -> torch.Tensor | None:
        """An empty host tensor like ``tensor`` from the batch's slot, or None."""
        if tensor is None:
            return None
        return slot.take(tensor.shape, tensor.dtype)

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
