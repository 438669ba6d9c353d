"""Where each decoder layer of a split model goes: contiguous stages, balanced by bytes.

Pure functions, no torch. A stage holds a contiguous run of decoder layers; the first stage
also holds what runs before the layers (the embedding, rotary tables, a vision tower) and the
capture buffers (the batch's staging tensor lives there), the last stage what runs after them
(the final norm and the head). :func:`balance_layers` picks the cut points that balance the
layers' work within each device's memory, then, among those, make the largest stage in bytes
smallest. A model's layers then each run on one device, in order, so the states are the same
bits as on one device (no reduction is split, unlike tensor parallel).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StagePlan:
    """Stage ``index`` runs layers ``start:stop`` on ``device`` and holds ``bytes`` in all."""

    index: int
    device: str
    start: int
    stop: int
    bytes: int

    @property
    def layers(self) -> int:
        return self.stop - self.start


def balance_layers(layer_bytes: Sequence[int], stages: int, *, first_extra: int = 0, last_extra: int = 0,
                   capacity: int | None = None) -> list[int]:
    """Layers per stage, in order (each at least 1, summing to ``len(layer_bytes)``). Stage 0 also
    holds ``first_extra`` (embedding, capture buffers), the last stage ``last_extra`` (final norm,
    head); one stage holds both. Two goals, in order:

    1. the layers' work is balanced: the largest stage's layer bytes (the work a forward does
       there; the extras do none while the head is not asked for) is as small as any split makes
       it, among the splits whose every stage, extras included, fits ``capacity`` (None: any);
    2. among those, the largest stage in bytes, extras included, is as small as can be: the
       extras take layers off the first and last stages wherever that leaves the work balanced.

    When no split fits ``capacity``, the one smallest in its largest stage's bytes. Raises
    ValueError for fewer layers than stages."""
    count = len(layer_bytes)
    if stages < 1:
        raise ValueError(f"a model is split into 1 or more stages, not {stages}")
    if count < stages:
        raise ValueError(f"{count} decoder layers cannot be split into {stages} stages (one layer at least each)")
    prefix = [0]
    for size in layer_bytes:
        prefix.append(prefix[-1] + size)

    def work(stage: int, start: int, stop: int) -> int:
        return prefix[stop] - prefix[start]

    def held(stage: int, start: int, stop: int) -> int:
        extra = (first_extra if stage == 0 else 0) + (last_extra if stage == stages - 1 else 0)
        return work(stage, start, stop) + extra

    limit = capacity if capacity is not None else float("inf")
    balanced = _min_max_split(count, stages, work, lambda stage, start, stop: held(stage, start, stop) <= limit)
    if balanced is None:  # nothing fits: the split holding the least on its fullest stage
        return _min_max_split(count, stages, held, lambda *_: True)  # type: ignore[return-value]
    most_work = max(work(stage, start, stop) for stage, (start, stop) in enumerate(_ranges(balanced)))
    return _min_max_split(count, stages, held, lambda stage, start, stop: (  # type: ignore[return-value]
        work(stage, start, stop) <= most_work and held(stage, start, stop) <= limit))


def _ranges(counts: Sequence[int]) -> list[tuple[int, int]]:
    ranges, start = [], 0
    for layers in counts:
        ranges.append((start, start + layers))
        start += layers
    return ranges


def _min_max_split(count: int, stages: int, cost: Callable[[int, int, int], int],
                   allowed: Callable[[int, int, int], bool]) -> list[int] | None:
    """Layers per stage minimising the largest ``cost(stage, start, stop)`` over the splits whose
    every stage is ``allowed`` (None: no such split); ties go to the fewest layers on the costliest
    stage, then the earliest cuts. Dynamic programming over (stage, end of its layers)."""
    Best = tuple[tuple[int, int], int]  # ((largest cost so far, its layers), where this stage starts)
    best: list[dict[int, Best]] = [{} for _ in range(stages)]
    for stop in range(1, count - stages + 2):
        if allowed(0, 0, stop):
            best[0][stop] = ((cost(0, 0, stop), stop), 0)
    for stage in range(1, stages):
        for stop in range(stage + 1, count - (stages - stage - 1) + 1):
            options = [(max(best[stage - 1][start][0], (cost(stage, start, stop), stop - start)), start)
                       for start in range(stage, stop) if start in best[stage - 1] and allowed(stage, start, stop)]
            if options:
                best[stage][stop] = min(options)
    if count not in best[stages - 1]:
        return None
    counts, stop = [], count
    for stage in range(stages - 1, -1, -1):
        start = best[stage][stop][1]
        counts.append(stop - start)
        stop = start
    return counts[::-1]


def stage_devices(devices: Sequence[str], stages: int) -> list[str]:
    """The device of each stage: ``stages`` spread over ``devices`` in order, consecutive stages
    sharing a device when there are more stages than devices (``--split-stages 2`` on one GPU)."""
    if not devices:
        raise ValueError("a split needs at least one device")
    if stages < len(devices):
        raise ValueError(f"{stages} stages cannot use {len(devices)} devices (one stage per device at least)")
    return [devices[stage * len(devices) // stages] for stage in range(stages)]


def plan_stages(layer_bytes: Sequence[int], devices: Sequence[str], stages: int, *, first_extra: int = 0,
                last_extra: int = 0, capacity: int | None = None) -> list[StagePlan]:
    """The stages of a split: devices (:func:`stage_devices`), layer ranges (:func:`balance_layers`)
    and the bytes each holds."""
    counts = balance_layers(layer_bytes, stages, first_extra=first_extra, last_extra=last_extra, capacity=capacity)
    plans, start = [], 0
    for index, (device, layers) in enumerate(zip(stage_devices(devices, stages), counts)):
        stop = start + layers
        extra = (first_extra if index == 0 else 0) + (last_extra if index == stages - 1 else 0)
        plans.append(StagePlan(index, device, start, stop, sum(layer_bytes[start:stop]) + extra))
        start = stop
    return plans
