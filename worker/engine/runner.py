"""One batch on the device: the forward with the capture hooks on, the cast to the batch's
output dtype, the non-finite flags, the teacher's top-k, and the copy into a host buffer.

On a GPU the copy is asynchronous, on a side stream: :meth:`BatchRunner.run` returns as soon
as it is queued, and the batch's ``ready`` event says when it is done (a blocking event: a job
thread waiting on it sleeps rather than spinning a core). The host buffer goes
back to the free list when the batch's last job has released it, and never before its copy
is done (a job that never waited must not race the copy). Used on the engine thread only,
except :meth:`DeviceClock.busy_seconds`.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence

import torch

from layertap.worker.engine.host_buffers import HostSlot, HostStaging
from layertap.worker.engine.layout import layer_union
from layertap.worker.engine.output_dtype import non_finite_rows, to_output
from layertap.worker.engine.prefix_cache import BatchNeeds, CachedBatch, PrefixUse
from layertap.worker.engine.prefix_keys import PrefixKeys
from layertap.worker.engine.records import BatchOutput, EngineRequest, Holders, HostTensors
from layertap.worker.engine.teacher import TeacherHead
from layertap.worker.model.batching import layout_class
from layertap.worker.model.capture import StopForward
from layertap.worker.model.layouts.base import BatchLayout, to_device
from layertap.worker.model.loading import LoadedModel
from layertap.worker.model.modes import transformers_attention
from layertap.worker.model.vision.attention import vision_attention
from layertap.worker.model.vision.inputs import host_rope_positions, merge_image_inputs, pads_tiles, real_tokens_mask
from layertap.worker.model.vision.towers import one_image_at_a_time, takes_host_inputs

#: Processor outputs left on the host for a grid tower that takes its inputs there (``vision.towers``).
HOST_GRID = frozenset({"image_grid_thw"})
#: The layout of chats with images on a model that names none: one per forward.
IMAGE_BATCH = layout_class("single")("a chat with images runs alone through the model's own forward")


def image_layout(loaded: LoadedModel) -> BatchLayout:
    """How ``loaded``'s chats with images share a forward (``layertap.worker.model.vision.inputs``)."""
    return loaded.image_batching or IMAGE_BATCH


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


class DeviceClock:
    """Device time spent in batches (forward + capture): device events on a GPU, wall time on
    the CPU. Thread-safe."""

    def __init__(self) -> None:
        self._pending: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque()
        self._lock = threading.Lock()
        self._busy_s = 0.0

    def add(self, seconds: float) -> None:
        with self._lock:
            self._busy_s += seconds

    def add_events(self, start: torch.cuda.Event, end: torch.cuda.Event) -> None:
        """A batch timed between two recorded events; counted once ``end`` is done."""
        with self._lock:
            self._pending.append((start, end))
        self._collect(block=False)

    def busy_seconds(self, wait: bool = True) -> float:
        """Device time of finished batches (with ``wait``, first waits for queued device work)."""
        self._collect(block=wait)
        return self._busy_s

    def _collect(self, block: bool) -> None:
        with self._lock:
            while self._pending:
                start, end = self._pending[0]
                if not block and not end.query():
                    return
                end.synchronize()
                self._pending.popleft()
                self._busy_s += start.elapsed_time(end) / 1000.0


def run_with_images(loaded: LoadedModel, input_ids: torch.Tensor, token_ids: Sequence[torch.Tensor],
                    model_inputs: list[dict[str, torch.Tensor]]) -> None:
    """Chats with images (``input_ids`` ``[B, T]`` right-padded from each chat's ``token_ids``,
    each chat's processor outputs in batch order) through the model's own ``forward`` (vision
    tower, merging, its own positions such as M-RoPE, its own masks), on the attention
    implementation transformers chose for it (a vision tower that cuts its patches by
    ``cu_seqlens``: one varlen flash call per layer on a GPU,
    ``layertap.worker.model.vision.attention``), such a tower one image at a time
    (``layertap.worker.model.vision.towers``; on a GPU as its image size's CUDA graph where it has
    one, ``layertap.worker.model.vision.tower_graphs``): the capture hooks see what enters each decoder layer.

    What the model derives from the image grids (M-RoPE positions, the tower's positions and
    bounds) is computed on the host by its own functions where it can be, and the grid stays
    there: the forward then takes no device sync before its placeholder check, and the host
    can queue a batch's tower while the GPU still runs the one before.

    That holds where the chats batch (a family whose batching its tests and the image
    self-check verified). One chat per forward (every other family, and the image self-check's
    reference) runs plain, as a user runs the model on its processor's output: the chat's
    attention mask, the positions and tower inputs the model derives itself."""
    device = loaded.device
    plain = image_layout(loaded).slow
    tower = None if plain else loaded.grid_tower
    on_host = HOST_GRID if takes_host_inputs(tower) else frozenset()
    on_device = [{name: value if name in on_host else
                  value.to(device, loaded.dtype if value.is_floating_point() else value.dtype, non_blocking=True)
                  for name, value in chat.items()} for chat in model_inputs]  # pinned (staged_inputs): asynchronous
    extras = merge_image_inputs(on_device, input_ids.shape[1], pads_tiles(loaded.model))
    if plain:
        extras["attention_mask"] = to_device(real_tokens_mask(token_ids, input_ids.shape[1]), device)
    elif loaded.rope_index is not None:
        positions = host_rope_positions(loaded.rope_index, token_ids, model_inputs, input_ids.shape[1])
        if positions is not None:
            extras["position_ids"] = to_device(positions, device)
    with (transformers_attention(loaded), vision_attention(loaded.model, loaded.vision_attention),
          one_image_at_a_time(tower, loaded.tower_graphs)):
        loaded.model(input_ids=input_ids, **extras, use_cache=False)


class BatchRunner:
    """Runs batches of requests on ``loaded``'s device into host buffers from ``staging``."""

    def __init__(self, loaded: LoadedModel, staging: HostStaging, pad_to: int):
        self.loaded = loaded
        self.clock = DeviceClock()
        self._staging = staging
        self._pad_to = pad_to
        self._cuda = loaded.device.type == "cuda"
        self._teacher = TeacherHead(loaded) if loaded.lm_head is not None else None
        self._copy_stream = torch.cuda.Stream(loaded.device) if self._cuda else None
        #: a model split over GPUs: the cast and copy-out go on its gather stream, after its captures
        #: (``layertap.worker.model.split``)
        self._gather = loaded.split.gather if loaded.split is not None else None

    def run(self, batch: list[EngineRequest], prefixes: Sequence[PrefixUse | None] | None = None,
            keep: BatchNeeds | None = None) -> tuple[BatchOutput, Holders, CachedBatch | None]:
        """The batch's outputs (all requests share its ``output_dtype``), who holds their host
        buffer (one holder per request) and, with ``prefixes`` (a packed text batch under the
        prefix cache: each request's cached prefix or None) and ``keep`` (the batch's needs, where
        it is to be kept), what the batch leaves for the cache. Raises what the forward raises (out
        of memory included); the host buffer is then free again."""
        loaded, device = self.loaded, self.loaded.device
        images = batch[0].model_inputs is not None  # the engine's scheduler never mixes text and images
        layout = image_layout(loaded) if images else loaded.batching
        union = layer_union([request.layer_ids for request in batch])
        want_final = any(request.want_final for request in batch)
        keys = None
        if prefixes is None:
            inputs = layout.build_inputs([request.token_ids for request in batch], device, pad_to=self._pad_to)
            bounds = inputs.bounds
        else:
            keys = PrefixKeys([request.num_tokens for request in batch], prefixes, device, keep is not None)
            skipped = [0 if use is None else use.length for use in prefixes]
            inputs = layout.build_inputs([request.token_ids[skip:] for request, skip in zip(batch, skipped)], device,
                                         pad_to=self._pad_to, starts=skipped)
            inputs.keys, bounds = keys, keys.key_bounds
        topk_rows, topk = self._topk_rows(batch, bounds)
        if topk_rows is not None:
            topk_rows = to_device(topk_rows, device)
        output_dtype = batch[0].output_dtype

        slot = self._staging.acquire()
        ready: torch.cuda.Event | None = None

        def free_slot() -> None:
            if ready is not None:
                ready.synchronize()
            self._staging.release(slot)

        try:
            started = time.perf_counter()
            events = self._record_start()
            with (torch.inference_mode(),
                  loaded.capture.capture(union, inputs.total, want_final or topk_rows is not None,
                                         rows=inputs.rows) as (staging, final)):
                try:
                    if images:
                        run_with_images(loaded, inputs.input_ids, [request.token_ids for request in batch],
                                        [request.model_inputs for request in batch])
                    else:
                        inputs.run(loaded.decoder)
                except StopForward:
                    pass
                if self._gather is not None:  # its captures are queued there: the compute stream goes on
                    self._gather.wait_stream(torch.cuda.current_stream(device))
                    if topk_rows is not None:
                        topk_rows.record_stream(self._gather)
                if keys is not None:  # over the rows' whole lengths, the cached prefixes' states in front
                    staging = keys.whole_states(staging, union)
                    final = None if final is None else keys.whole(final, lambda source: source.final)
                with torch.cuda.stream(self._gather):  # None (not split): no change of stream
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
        output = BatchOutput(HostTensors(*host), ready=ready, started=started)  # type: ignore[arg-type]
        kept = None
        if keys is not None and keep is not None:
            kept = keys.cached_batch([request.token_ids for request in batch], staging, final, keep)
        return output, Holders(len(batch), free_slot), kept

    @staticmethod
    def _topk_rows(batch: list[EngineRequest], bounds: list[int]) -> tuple[torch.Tensor | None, int]:
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
            self.clock.add(time.perf_counter() - start)  # type: ignore[operator]
            return None
        end.record()  # type: ignore[union-attr]
        self.clock.add_events(start, end)  # type: ignore[arg-type]
        stream = self._copy_stream
        stream.wait_stream(torch.cuda.current_stream())  # type: ignore[union-attr]
        with torch.cuda.stream(stream):
            for source, target in pairs:
                if source is not None:
                    target.copy_(source, non_blocking=True)
                    source.record_stream(stream)
            ready = torch.cuda.Event(blocking=True)  # its waiters sleep, not spin a core each
            ready.record(stream)
        return ready
