"""Host buffers for batch outputs, allocated (and on a GPU pinned) once, reused for every batch.

Pinning host memory is slow and runs on the engine thread, so a batch that pins its own
output buffers leaves the GPU idle meanwhile; torch's caching host allocator avoids that
only after it has seen a batch of each size class. :class:`HostStaging` holds ``slots``
buffers of ``capacity`` bytes made at start. The engine takes a free slot per batch,
carves that batch's output tensors out of it (:meth:`HostSlot.take`), and the slot
returns to the pool when the batch's last job has released its views.

Invariants: a slot is used by one batch at a time; tensors taken from a slot are valid
until the slot is released; a tensor that does not fit in what is left of the slot (a
batch with more layers than planned, or a wider output dtype) is allocated on its own,
so any batch still runs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

ALIGNMENT = 256  # bytes; every carved tensor starts at a multiple (enough for any dtype, and DMA-friendly)


class HostSlot:
    """One reusable host buffer; :meth:`take` hands out consecutive, aligned pieces of it."""

    def __init__(self, capacity: int, pinned: bool):
        self.pinned = pinned
        self._buffer = torch.empty(capacity, dtype=torch.uint8, pin_memory=pinned)
        self._used = 0

    @property
    def capacity(self) -> int:
        return self._buffer.numel()

    def take(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor of ``shape`` and ``dtype``: a view into the slot, or its own
        allocation when the slot has no room left."""
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        start = -(-self._used // ALIGNMENT) * ALIGNMENT
        if start + nbytes > self.capacity:
            return torch.empty(shape, dtype=dtype, pin_memory=self.pinned)
        self._used = start + nbytes
        return self._buffer[start:start + nbytes].view(dtype).view(shape)

    def reset(self) -> None:
        self._used = 0


class HostStaging:
    """A fixed pool of :class:`HostSlot`; thread-safe (the engine takes, job threads release)."""

    def __init__(self, slots: int, capacity: int, pinned: bool):
        self._free = [HostSlot(capacity, pinned) for _ in range(slots)]
        self._cond = threading.Condition()

    def wait_free(self, interrupt: Callable[[], bool] = lambda: False) -> bool:
        """Block until a slot is free (True), without taking it, or until ``interrupt()`` holds
        (False); :meth:`wake` makes a waiter look at ``interrupt`` again."""
        with self._cond:
            self._cond.wait_for(lambda: self._free or interrupt())
            return bool(self._free)

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def acquire(self) -> HostSlot:
        """Take a free slot (blocks while none is)."""
        with self._cond:
            self._cond.wait_for(lambda: self._free)
            slot = self._free.pop()
        slot.reset()
        return slot

    def release(self, slot: HostSlot) -> None:
        with self._cond:
            self._free.append(slot)
            self._cond.notify_all()

    def free_slots(self) -> int:
        with self._cond:
            return len(self._free)


def slot_capacity(token_budget: int, layers: int, hidden_size: int, dtype: torch.dtype) -> int:
    """Bytes one batch of ``token_budget`` tokens and ``layers`` captured layers needs on the
    host: the states plus their per-row NaN/Inf flags, with alignment slack for each tensor."""
    states = token_budget * layers * hidden_size * dtype.itemsize
    flags = token_budget * layers
    return states + flags + 8 * ALIGNMENT
