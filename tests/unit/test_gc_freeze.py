"""The worker freezes what it holds at start out of the garbage collector's reach, and what it
allocates later is still collected."""

from __future__ import annotations

import gc
import weakref

from layertap.worker.ops.gc_freeze import freeze_long_lived_objects


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def _cycle() -> weakref.ref:
    first, second = _Node(), _Node()
    first.other, second.other = second, first
    return weakref.ref(first)


def test_objects_alive_at_the_freeze_are_frozen_and_later_garbage_is_collected():
    kept = [_Node() for _ in range(1000)]  # long-lived: alive when the worker freezes
    try:
        frozen = freeze_long_lived_objects()
        assert frozen == gc.get_freeze_count() >= len(kept)
        assert gc.isenabled(), "the collector must keep running for what jobs allocate"
        later = _cycle()  # garbage made after the freeze (a job's), unreachable once made
        gc.collect()
        assert later() is None, "a cycle allocated after the freeze was not collected"
    finally:
        gc.unfreeze()
