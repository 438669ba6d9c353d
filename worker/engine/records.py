"""The engine's records: what a caller submits, what one batch leaves in its host buffer, and
each job's share of it.

Ownership: an :class:`EngineRequest` is the caller's until submitted, then the engine's. A
:class:`BatchOutput` is shared by its batch's jobs; each job holds it through one
:class:`JobSlice` and gives it back with ``release`` (once; a second call does nothing).
The host buffer returns to the engine when the last job of the batch has released.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch


@dataclass
class EngineRequest:
    """One job's tokens and wanted layers (resolved ids, in the job's order), and its extras."""

    token_ids: torch.Tensor  # int64 [T] on the CPU
    layer_ids: list[int]
    want_final: bool = False
    output_dtype: torch.dtype | None = None  # None: the model's dtype; float8_e4m3fn: quantized per row
    topk: int = 0  # > 0: the teacher's top-k next-token log-probs
    topk_rows: list[int] | None = None  # positions to compute them at (ascending); None: every position
    # a chat with images: its processor's extra inputs (CPU, staged_inputs)
    model_inputs: dict[str, torch.Tensor] | None = None
    future: Future = field(default_factory=Future)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @functools.cached_property
    def token_bytes(self) -> bytes:
        """The token ids' bytes, once (prefix sharing compares them each time a batch is formed)."""
        return self.token_ids.numpy().tobytes()

    @property
    def topk_row_count(self) -> int | None:
        """How many top-k rows it asks for (None: no top-k)."""
        if not self.topk:
            return None
        return self.num_tokens if self.topk_rows is None else len(self.topk_rows)


@dataclass(frozen=True)
class HostTensors:
    """One batch's captured tensors in its host buffer."""

    hidden: torch.Tensor  # [T_batch, U, H]; U = union of the batch's layers, ascending
    hidden_scale: torch.Tensor | None  # float32 [T_batch, U] for float8 output
    final: torch.Tensor | None  # [T_batch, H] after the final norm, if any job asked
    final_scale: torch.Tensor | None  # float32 [T_batch] for float8 output
    topk_logprobs: torch.Tensor | None  # float32 [N, k_max]: the asked rows of the batch's top-k jobs, in order
    topk_ids: torch.Tensor | None  # int32 [N, k_max]
    non_finite: torch.Tensor  # bool [T_batch, U]: NaN/Inf in that token's state of that layer
    final_non_finite: torch.Tensor | None  # bool [T_batch]: NaN/Inf in the post-norm state


class Holders:
    """The jobs holding one batch's host buffer: ``on_free`` runs once, after the last has released."""

    def __init__(self, count: int, on_free: Callable[[], None]):
        self._lock = threading.Lock()
        self._left = count
        self._on_free = on_free

    def release_handle(self) -> Callable[[], None]:
        """One holder's release; calling it again does nothing."""
        released = False

        def release() -> None:
            nonlocal released
            with self._lock:
                if released:
                    return
                released = True
                self._left -= 1
                last = self._left == 0
            if last:
                self._on_free()

        return release


@dataclass
class BatchOutput:
    """One batch's outputs on the host; readable once ``ready`` (a device event) is done."""

    tensors: HostTensors
    ready: torch.cuda.Event | None  # None on the CPU: the copy is done already
    started: float  # perf_counter when the batch started
    _all_finite: bool | None = field(default=None, init=False, repr=False)

    def all_finite(self) -> bool:
        """No NaN/Inf in any job's states of this batch (the usual case: then no job checks its
        own). Read only once ``ready`` is done; computed by the first job to ask (jobs racing to
        it compute the same answer)."""
        if self._all_finite is None:
            host = self.tensors
            broken = bool(host.non_finite.any())
            if host.final_non_finite is not None:
                broken = broken or bool(host.final_non_finite.any())
            self._all_finite = not broken
        return self._all_finite


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
    topk_rows: slice | None  # its rows in the batch's top-k outputs
    topk: int
    want_final: bool
    release: Callable[[], None]  # gives the job's hold on the batch's host buffer back (idempotent)

    def wait(self) -> Captured:
        if self.batch.ready is not None:
            self.batch.ready.synchronize()
        compute_s = time.perf_counter() - self.batch.started
        host, tokens = self.batch.tensors, slice(self.start, self.end)
        hidden = host.hidden[tokens]
        hidden_scale = None if host.hidden_scale is None else host.hidden_scale[tokens]
        if self.slots != list(range(hidden.shape[1])):
            hidden = hidden[:, self.slots]
            hidden_scale = None if hidden_scale is None else hidden_scale[:, self.slots]
        final = None if host.final is None else host.final[tokens]
        final_scale = None if host.final_scale is None else host.final_scale[tokens]
        logprobs = ids = None
        if self.topk_rows is not None:
            logprobs = host.topk_logprobs[self.topk_rows, :self.topk]  # type: ignore[index]
            ids = host.topk_ids[self.topk_rows, :self.topk]  # type: ignore[index]
        non_finite = False
        if not self.batch.all_finite():
            # Only the job's own layers count: another job's layer in the same batch may be broken.
            non_finite = bool(host.non_finite[tokens][:, self.slots].any())
            if self.want_final and host.final_non_finite is not None:
                non_finite |= bool(host.final_non_finite[tokens].any())
        return Captured(hidden, hidden_scale, final, final_scale, logprobs, ids, non_finite, compute_s, self.release)


@dataclass
class EngineStats:
    """Counters of finished batches (written by the engine thread only)."""

    batches: int = 0
    tokens: int = 0  # computed (a row served from a longer row of its batch is not, nor a cached prefix)
    shared_tokens: int = 0  # served from a longer row of the same batch instead of computed (``prefix_share``)
    cached_tokens: int = 0  # first tokens of computed rows taken from an earlier batch (``prefix_cache``)
    jobs: int = 0
    oom_splits: int = 0
    #: The engine thread's wall and CPU seconds in its batches' runs (forward launched, copy-out
    #: queued). Wall well above CPU on a GPU: the thread waited for the GIL (or the device).
    run_s: float = 0.0
    run_cpu_s: float = 0.0
    #: Seconds the engine thread waited for a free host buffer with work queued (writers behind).
    buffer_wait_s: float = 0.0
