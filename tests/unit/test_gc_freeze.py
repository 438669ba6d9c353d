"""The worker freezes what it holds at start out of the garbage collector's reach, and what it
allocates later is still collected."""

from __future__ import annotations

import gc
import weakref

from layertap.worker.ops.gc_freeze import freeze_long_lived_objects


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def _cycle() -> _Node:
    first, second = _Node(), _Node()
    first.other, second.other = second, first
    return first


def test_objects_alive_at_the_freeze_are_frozen_and_later_garbage_is_collected():
    kept = [_Node() for _ in range(1000)]  # long-lived: alive when the worker freezes
    held = _cycle()  # alive at the freeze, dropped afterwards
    held_ref = weakref.ref(held)
    try:
        frozen = freeze_long_lived_objects()
        # The count is a snapshot: frozen objects other threads let go of leave it afterwards.
        assert frozen >= len(kept)
        assert gc.isenabled(), "the collector must keep running for what jobs allocate"
        del held
        later = weakref.ref(_cycle())  # garbage made after the freeze (a job's)
        gc.collect()
        assert held_ref() is not None, "a cycle alive at the freeze was collected: not frozen"
        assert later() is None, "a cycle allocated after the freeze was not collected"
    finally:
        gc.unfreeze()
    gc.collect()
    assert held_ref() is None, "once unfrozen, the cycle is garbage like any other"
