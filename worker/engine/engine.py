"""The batching engine: one thread owns the model and packs many jobs into each forward.

Callers (Celery task threads, or the in-process Extractor) :meth:`Engine.submit` a
tokenized request and block on its future. The engine thread takes pending requests
in arrival order, fills a batch up to ``token_budget`` tokens (``scheduler``: the
head of the queue always goes first), lays them out the way the model's batching layout
says (``layertap.worker.model.layouts``: one packed row with restarting positions, a right-padded
batch of similar lengths, or one prompt alone; chats with images batch only with each
other, in the layout ``layertap.worker.model.vision.inputs`` gives the model), and hands it to the
``runner``, which runs the decoder until the last wanted layer (through the final norm
when a job wants ``final_hidden_states`` or teacher top-k, which is then computed on the
device for only the asked positions), casts the states to the batch's output dtype (a
batch has one: requests of another wait for the next batch), and on a GPU starts an
asynchronous copy of the outputs to pinned host memory on a side stream, then goes straight
on to the next batch. A job's
:class:`JobSlice` waits for that copy only when its caller reads it, on the caller's
thread. At most ``host_buffers`` batches are between the GPU and the writers at once, each
in a host buffer allocated at start (``host_buffers``); when writers fall behind the engine
waits for a free buffer (counted as GPU idle time) *before* it forms the next batch, so
the batch takes in every job that arrived meanwhile.

Callers prepare work just ahead of the engine, in a *place* (:meth:`Engine.preparing`): at most
:data:`MAX_PREPARING` places at once, and a place is given only while fewer than ``prepare_ahead``
batches are queued, counted both ways: by token budgets and by ``max_batch_jobs`` (0: no such
limit). Preparing more at once gains nothing and costs the engine thread the GIL, which
every torch call releases and takes back: with a burst of 3,000 jobs prepared on 47 task
threads at once, the first batch took 0.7-1.2 s to launch on an H200, its forward using 0.1 s
of the engine thread's CPU. A caller may take its place earlier, before work it must not do
unless its jobs are about to run (an outer ``preparing`` block: the worker's task counts a
message's attempts only then); the place is left when the first block ends.
:meth:`Engine.close_admission` (a warm shutdown) refuses places to every caller waiting for one
(:class:`AdmissionClosed`) and to later ones; what is queued still runs. So a worker holds at
most ``MAX_PREPARING`` messages beyond those whose jobs are queued here or later.

Other work that needs the model outside a batch goes to the engine thread too
(:meth:`Engine.call_when_idle`: a run's sampled row, run alone): it runs once no batch work is
queued, or before the next batch once its time is up, so it holds up no batch while work keeps
coming; and before the engine stops.

Out of memory on a batch splits it in halves and retries; a single request that still
does not fit fails with :class:`~layertap.worker.engine.errors.OutOfMemory`. The engine raises only
``layertap.worker.engine.errors`` (the job pipeline maps them to error types); it changes nothing on
the model (``layertap.worker.model.loading`` does that).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

import torch

from layertap.worker.engine.errors import AdmissionClosed, BatchFailed, DeviceFault, EngineStopped, OutOfMemory
from layertap.worker.engine.host_buffers import HostStaging, slot_capacity
from layertap.worker.engine.inputs import batch_policy
from layertap.worker.engine.layout import place_jobs
from layertap.worker.engine.prefix_cache import PrefixCache, batch_needs
from layertap.worker.engine.prefix_share import family_batch, plan_sharing, with_served
from layertap.worker.engine.records import EngineRequest, EngineStats, JobSlice
from layertap.worker.engine.runner import BatchRunner, image_layout, is_device_fatal
from layertap.worker.engine.scheduler import MAX_PADDING, BatchPolicy
from layertap.worker.model.loading import LoadedModel

log = logging.getLogger(__name__)


#: Length of the requests of the full warm-up batch.
WARM_UP_LENGTH = 128
#: :meth:`Engine.preparing` lets at most this many callers in at once.
MAX_PREPARING = 2


class Engine:
    """Owns the model on one thread. ``submit`` is thread-safe."""

    def __init__(self, loaded: LoadedModel, *, token_budget: int = 16384, max_batch_jobs: int = 256,
                 batch_wait_s: float = 0.002, max_padding: float = MAX_PADDING, host_buffers: int = 3,
                 staging_layers: int = 4, prepare_ahead: int = 2,
                 on_fatal: Callable[[BaseException], None] | None = None):
        """``staging_layers``: how many layers a typical batch captures (the worker's default
        list); the host buffers hold ``token_budget`` tokens of that many layers.
        ``prepare_ahead``: token budgets queued beyond which callers wait to prepare more
        (:meth:`preparing`; 0: they never wait)."""
        self.loaded = loaded
        self.batch_wait_s = batch_wait_s
        self.prepare_ahead = prepare_ahead
        self.policy = batch_policy(loaded, token_budget=token_budget, max_jobs=max_batch_jobs,
                                   max_padding=max_padding)
        self.stats = EngineStats()
        self.fatal: BaseException | None = None
        self._on_fatal = on_fatal
        self.on_batch: Callable[[int, int], None] | None = None  # called (jobs, tokens computed) after each batch
        #: Serve a row that begins with a longer row of its batch from that row (``prefix_share``);
        #: set once the model passed ``self_check.check_prefix_sharing``.
        self.prefix_sharing = False
        #: Compute only the tokens of a row past its longest prefix an earlier batch computed
        #: (``prefix_cache``); set once the model passed ``self_check.check_prefix_cache``.
        self.prefix_cache: PrefixCache | None = None
        self._cuda = loaded.device.type == "cuda"
        self._pending: deque[EngineRequest] = deque()
        self._pending_tokens = 0
        self._places: set[int] = set()  # threads holding a place (preparing()); at most MAX_PREPARING
        self._admitting = True  # False once close_admission() was called
        self._together: deque[list[EngineRequest]] = deque()  # batches asked for as they are
        self._idle_calls: deque[tuple[Callable[[], Any], Future, float]] = deque()  # (work, future, due) when idle
        lock = threading.Lock()
        self._cond = threading.Condition(lock)  # the engine thread waits here for work
        self._room = threading.Condition(lock)  # callers wait here to start preparing
        self._stopping = False
        state_width = loaded.hidden_size * loaded.capture.stream.copies
        capacity = slot_capacity(token_budget, staging_layers, state_width, loaded.dtype)
        self._staging = HostStaging(host_buffers, capacity, pinned=self._cuda)
        self._runner = BatchRunner(loaded, self._staging, self.policy.pad_to)
        self._thread = threading.Thread(target=self._loop, name="layertap-engine", daemon=True)
        self._thread.start()

    # -- public -----------------------------------------------------------------------
    @property
    def token_budget(self) -> int:
        return self.policy.token_budget

    def submit(self, request: EngineRequest) -> Future:
        """Queue a request; its future resolves to a :class:`JobSlice` or raises an
        :class:`~layertap.worker.engine.errors.EngineError`."""
        return self.submit_many([request])[0]

    def submit_many(self, requests: list[EngineRequest], together: bool = False) -> list[Future]:
        """Queue several requests at once (the next batch sees them all); their futures.
        ``together``: run these as one batch, whatever the budget (the self-check); a layout
        that takes fewer jobs per forward (one prompt per batch) splits them its way.
        Raises :class:`EngineStopped` once the engine is stopping."""
        for request in requests:
            if request.output_dtype is None:
                request.output_dtype = self.loaded.dtype
        with self._cond:
            if self._stopping:
                raise EngineStopped("the engine is shutting down")
            if together:
                self._together.append(list(requests))
            else:
                self._pending.extend(requests)
                self._pending_tokens += sum(request.num_tokens for request in requests)
            self._cond.notify()
        return [request.future for request in requests]

    def call_when_idle(self, work: Callable[[], Any], within_s: float) -> Future:
        """Run ``work()`` on the engine thread once no batch work is queued, or before the next batch
        once ``within_s`` seconds have passed (or :meth:`hurry_idle_calls` was called), in order;
        its future holds what it returns or raises. Raises :class:`EngineStopped` once stopping."""
        future: Future = Future()
        with self._cond:
            if self._stopping:
                raise EngineStopped("the engine is shutting down")
            self._idle_calls.append((work, future, time.monotonic() + within_s))
            self._cond.notify()
        self._staging.wake()
        return future

    def hurry_idle_calls(self) -> None:
        """Make every queued :meth:`call_when_idle` work due now."""
        with self._cond:
            self._idle_calls = deque((work, future, 0.0) for work, future, _ in self._idle_calls)
            self._cond.notify()
        self._staging.wake()

    def warm_up(self, full_batch: bool = False) -> None:
        """Run throwaway work before real jobs: one 512-token request (kernel selection, lazy
        init), and with ``full_batch`` also one batch as full as the budget allows, of 128-token
        requests, so allocator growth and the compiled graphs' first big shapes are paid here and
        not by the first jobs."""
        vocab = self.loaded.vocab_size
        self.submit(EngineRequest(torch.randint(0, vocab, (min(512, self.token_budget),)),
                                  [self.loaded.num_layers])).result().wait().release()
        if full_batch:
            count = max(1, min(self.policy.max_jobs, self.token_budget // WARM_UP_LENGTH))
            requests = [EngineRequest(torch.randint(0, vocab, (WARM_UP_LENGTH,)), [self.loaded.num_layers])
                        for _ in range(count)]
            for future in self.submit_many(requests, together=True):
                future.result().wait().release()

    @contextlib.contextmanager
    def preparing(self) -> Iterator[None]:
        """Prepare work (tokenize, build its tensors) and submit it inside this block, in a place,
        taken once fewer than ``prepare_ahead`` batches are queued (by token budget and by job
        count) and fewer than :data:`MAX_PREPARING` places are held (at once if the engine is
        stopping, or ``prepare_ahead`` is 0); raises :class:`AdmissionClosed` once admission is
        closed. Nothing inside may wait on the engine while the place is held. A thread holds one
        place: a block inside another of the same thread uses the outer one's, and the place is
        left when the first of them ends, so a caller can take its place before work that must
        wait for one (the worker's task, before it counts a message's attempts) and wait on the
        engine after the inner block that submits."""
        me = threading.get_ident()
        self._take_place(me)
        try:
            yield
        finally:
            self._leave_place(me)

    def close_admission(self) -> None:
        """Give no more places (a warm shutdown): callers waiting for one, and later ones, get
        :class:`AdmissionClosed`; those holding one go on, and queued work runs as before."""
        with self._room:
            self._admitting = False
            self._room.notify_all()

    def _take_place(self, me: int) -> None:
        if not self.prepare_ahead:
            return
        limit, most_jobs = self.prepare_ahead * self.token_budget, self.prepare_ahead * self.policy.max_jobs
        with self._room:
            if me in self._places:  # an outer block of this thread holds it
                return
            self._room.wait_for(lambda: self._stopping or not self._admitting or (
                self._pending_tokens < limit and len(self._pending) < most_jobs
                and len(self._places) < MAX_PREPARING))
            if not self._admitting and not self._stopping:
                raise AdmissionClosed("this worker is shutting down and starts no more work")
            self._places.add(me)

    def _leave_place(self, me: int) -> None:
        if not self.prepare_ahead:
            return
        with self._room:
            if me in self._places:
                self._places.discard(me)
                self._room.notify_all()

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
            self._room.notify_all()
        self._thread.join(timeout)

    def busy_seconds(self, wait: bool = True) -> float:
        """Device time spent in finished batches (with ``wait``, first waits for queued device work)."""
        return self._runner.clock.busy_seconds(wait)

    def snapshot(self) -> dict[str, float]:
        """Counters for monitoring (JSON-ready); does not wait for the device."""
        return {"batches": self.stats.batches, "jobs": self.stats.jobs, "tokens": self.stats.tokens,
                "shared_tokens": self.stats.shared_tokens, "cached_tokens": self.stats.cached_tokens,
                "prefix_cache_bytes": 0 if self.prefix_cache is None else self.prefix_cache.held_bytes,
                "busy_s": round(self.busy_seconds(wait=False), 6), "oom_splits": self.stats.oom_splits,
                "run_s": round(self.stats.run_s, 6), "run_cpu_s": round(self.stats.run_cpu_s, 6),
                "buffer_wait_s": round(self.stats.buffer_wait_s, 6),
                "pending": self.pending()}

    # -- engine thread ----------------------------------------------------------------
    def _loop(self) -> None:
        if self._cuda:
            torch.cuda.set_device(self.loaded.device)
        while True:
            self._run_calls()
            batch = self._next_batch()
            if batch is None:
                return
            if not batch:  # woken for calls alone
                continue
            try:
                self._run_or_split(batch)
            except Exception as exc:  # fail these jobs (transient: they are retried), keep serving
                log.exception("engine batch failed")
                fatal = is_device_fatal(exc)
                failure = DeviceFault if fatal else BatchFailed
                prefix = "device fault; this worker is stopping: " if fatal else ""
                for request in batch:
                    if not request.future.done():
                        request.future.set_exception(failure(f"{prefix}{type(exc).__name__}: {exc}"))
                if fatal:
                    self._fail_fatally(exc)
                    return

    def _fail_fatally(self, exc: BaseException) -> None:
        """Refuse all further work and tell the owner, which exits non-zero for its supervisor to restart."""
        with self._cond:
            self.fatal, self._stopping = exc, True
            pending = [*self._pending, *(request for batch in self._together for request in batch)]
            calls = [(work, future) for work, future, _ in self._idle_calls]
            self._pending, self._together, self._idle_calls, self._pending_tokens = deque(), deque(), deque(), 0
            self._room.notify_all()
        for request in pending:
            request.future.set_exception(DeviceFault(f"device fault on this worker: {exc}"))
        for _, future in calls:
            future.set_exception(DeviceFault(f"device fault on this worker: {exc}"))
        if self._on_fatal is not None:
            self._on_fatal(exc)

    def _idle_work_due(self) -> bool:
        """Whether :meth:`call_when_idle` work is to run now: no batch work is queued, or the oldest
        is due (also read without the lock, under the host buffers' own: a hint to look again)."""
        try:
            due = self._idle_calls[0][2]
        except IndexError:
            return False
        return not self._pending and not self._together or due <= time.monotonic()

    def _run_calls(self) -> None:
        """Run the :meth:`call_when_idle` work that is to run now, in order (a device fault in one is
        the engine's)."""
        while True:
            with self._cond:
                if not self._idle_work_due():
                    return
                work, future, _ = self._idle_calls.popleft()
            try:
                future.set_result(work())
            except Exception as exc:
                future.set_exception(exc)
                if is_device_fatal(exc):
                    self._fail_fatally(exc)

    def _next_batch(self) -> list[EngineRequest] | None:
        """The next batch, formed once a host buffer is free for it (None: stopped, nothing queued;
        empty: only :meth:`call_when_idle` work is queued)."""
        with self._cond:
            while not self._pending and not self._together and not self._idle_calls and not self._stopping:
                self._cond.wait()
            if not self._pending and not self._together:
                return [] if self._idle_calls else None
        waited = time.perf_counter()
        while not self._staging.wait_free(self._idle_work_due):  # call work runs while writers are behind
            self._run_calls()
        self.stats.buffer_wait_s += time.perf_counter() - waited
        with self._cond:
            if self._together:
                return self._take_together()
            deadline = time.monotonic() + self.batch_wait_s
            while (not self.policy.is_full(self._pending_tokens, len(self._pending))
                   and not self._stopping):
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._cond.wait(remaining):
                    break
            pending = list(self._pending)
            head_dtype, images = pending[0].output_dtype, pending[0].model_inputs is not None
            # a batch has one output dtype: requests of another wait for a later batch; chats with
            # images (extra model inputs, the model's own forward) batch only with each other
            compatible = [r.output_dtype == head_dtype and (r.model_inputs is not None) == images for r in pending]
            policy = self._policy(images)
            if self.prefix_sharing and not images:
                chosen = family_batch(pending, compatible, policy.select, policy.max_jobs)
            else:
                chosen = policy.select([r.num_tokens for r in pending], compatible)
            taken = set(chosen)
            self._pending = deque(r for i, r in enumerate(pending) if i not in taken)
            batch = [pending[i] for i in chosen]
            self._pending_tokens -= sum(request.num_tokens for request in batch)
            self._room.notify_all()
            return batch

    def _policy(self, images: bool) -> BatchPolicy:
        """The policy of a batch of text jobs, or of chats with images (their layout, the same limits)."""
        if not images:
            return self.policy
        return replace(self.policy, layout=image_layout(self.loaded))

    def _take_together(self) -> list[EngineRequest]:
        """The first batch asked for as it is, or as much of it as the layout lets share a
        forward (under no budget); the rest stays first in line."""
        requests = self._together.popleft()
        layout = image_layout(self.loaded) if requests[0].model_inputs is not None else self.loaded.batching
        unlimited = BatchPolicy(layout, token_budget=sys.maxsize, max_jobs=len(requests), max_padding=1.0)
        chosen = set(unlimited.select([r.num_tokens for r in requests], [True] * len(requests)))
        rest = [r for i, r in enumerate(requests) if i not in chosen]
        if rest:
            self._together.appendleft(rest)
        return [r for i, r in enumerate(requests) if i in chosen]

    def _run_or_split(self, batch: list[EngineRequest]) -> None:
        sources = plan_sharing(batch) if self.prefix_sharing else {}
        computed = [index for index in range(len(batch)) if index not in sources]
        ran_requests = [batch[index] for index in computed]
        # text in packed rows only (a check's reference runs one sequence per forward meanwhile)
        cache = self.prefix_cache if batch[0].model_inputs is None and self.loaded.batching.name == "packed" else None
        prefixes, keep = None, None
        if cache is not None:
            needs = batch_needs(ran_requests, self.loaded.num_layers)
            prefixes = cache.plan(ran_requests, needs)
            if cache.keeps(sum(request.num_tokens for request in ran_requests), len(needs.layer_ids)):
                keep = needs
            elif not any(prefixes):
                prefixes = None  # nothing from the cache, nothing for it: the plain forward
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            ran = self._runner.run(ran_requests, prefixes, keep)
        except torch.OutOfMemoryError:
            ran = None  # handled below, once the traceback (and the activations it holds) is gone
        self.stats.run_s += time.perf_counter() - wall
        self.stats.run_cpu_s += time.thread_time() - cpu
        if ran is None and cache is not None and len(cache):
            cache.shrink()  # its room first: the batch may fit without it
            self._release_cached_memory()
            log.warning("out of memory on a batch of %d jobs; the prefix cache is emptied, its budget halved to "
                        "%d MiB, and the batch run again", len(batch), cache.budget_bytes >> 20)
            self._run_or_split(batch)
            return
        if ran is None:
            self._release_cached_memory()
            if len(computed) == 1:
                request = batch[computed[0]]
                request.future.set_exception(OutOfMemory(
                    f"{request.num_tokens} tokens do not fit in device memory even alone; "
                    "lower max_length or use a larger GPU"))
                if sources:  # the rows it would have served are shorter: they may fit on their own
                    self._run_or_split([batch[index] for index in sources])
                return
            self.stats.oom_splits += 1
            half = len(batch) // 2
            log.warning("out of memory on a batch of %d jobs; splitting", len(batch))
            self._run_or_split(batch[:half])
            self._run_or_split(batch[half:])
            return
        output, holders, kept = ran
        if kept is not None:
            cache.add(kept, prefixes)  # type: ignore[union-attr,arg-type]
        places = place_jobs([r.num_tokens for r in ran_requests], [r.layer_ids for r in ran_requests],
                            [r.topk_row_count for r in ran_requests])
        cached_tokens = sum(use.length for use in prefixes or () if use is not None)
        tokens = places[-1].end - cached_tokens
        self.stats.batches += 1
        self.stats.jobs += len(batch)
        self.stats.tokens += tokens
        self.stats.shared_tokens += sum(batch[index].num_tokens for index in sources)
        self.stats.cached_tokens += cached_tokens
        slices = with_served(batch, sources, {
            index: JobSlice(output, place.start, place.end, place.slots, place.topk_rows, batch[index].topk,
                            batch[index].want_final, holders.release_handle())
            for index, place in zip(computed, places)})
        for index, request in enumerate(batch):
            request.future.set_result(slices[index])
        if self.on_batch is not None:
            self.on_batch(len(batch), tokens)

    def _release_cached_memory(self) -> None:
        if self._cuda:
            torch.cuda.empty_cache()
