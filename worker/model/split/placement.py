"""Where each decoder layer of a split model goes: contiguous stages, balanced by bytes.

Pure functions, no torch. A stage holds a contiguous run of decoder layers; the first stage
also holds what runs before the layers (the embedding, rotary tables, a vision tower) and the
capture buffers (the batch's staging tensor lives there), the last stage what runs after them
(the final norm and the head). :func:`balance_layers` picks the cut points that make the
largest stage smallest; a model's layers then each run on one device, in order, so the states
are the same bits as on one device (no reduction is split, unlike tensor parallel).
"""

from __future__ import annotations

from collections.abc import Sequence
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


def balance_layers(layer_bytes: Sequence[int], stages: int, *, first_extra: int = 0,
                   last_extra: int = 0) -> list[int]:
    """Layers per stage, in order (each at least 1, summing to ``len(layer_bytes)``), minimising
    the largest stage's bytes, where stage 0 also carries ``first_extra`` (embedding, capture
    buffers) and the last stage ``last_extra`` (final norm, head); one stage carries both. Among
    equally large splits, the one whose largest stage has the fewest layers (then the earliest
    cuts). Raises ValueError for fewer layers than stages."""
    count = len(layer_bytes)
    if stages < 1:
        raise ValueError(f"a model is split into 1 or more stages, not {stages}")
    if count < stages:
        raise ValueError(f"{count} decoder layers cannot be split into {stages} stages (one layer at least each)")
    prefix = [0]
    for size in layer_bytes:
        prefix.append(prefix[-1] + size)

    def load(stage: int, start: int, stop: int) -> tuple[int, int]:
        extra = (first_extra if stage == 0 else 0) + (last_extra if stage == stages - 1 else 0)
        return prefix[stop] - prefix[start] + extra, stop - start

    # best[s][i]: the smallest (largest stage bytes, its layers) of layers [0, i) over stages [0, s]
    best: list[dict[int, tuple[tuple[int, int], int]]] = [{} for _ in range(stages)]
    for stop in range(1, count - stages + 2):
        best[0][stop] = (load(0, 0, stop), 0)
    for stage in range(1, stages):
        for stop in range(stage + 1, count - (stages - stage - 1) + 1):
            options = [(max(best[stage - 1][start][0], load(stage, start, stop)), start)
                       for start in range(stage, stop)]
            best[stage][stop] = min(options)
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
                last_extra: int = 0) -> list[StagePlan]:
    """The stages of a split: devices (:func:`stage_devices`), layer ranges (:func:`balance_layers`)
    and the bytes each holds."""
    counts = balance_layers(layer_bytes, stages, first_extra=first_extra, last_extra=last_extra)
    plans, start = [], 0
    for index, (device, layers) in enumerate(zip(stage_devices(devices, stages), counts)):
        stop = start + layers
        extra = (first_extra if index == 0 else 0) + (last_extra if index == stages - 1 else 0)
        plans.append(StagePlan(index, device, start, stop, sum(layer_bytes[start:stop]) + extra))
        start = stop
    return plans
