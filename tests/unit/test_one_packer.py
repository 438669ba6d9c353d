"""The bench's ceiling (b) and the engine (c) batch alike: (b)'s plan is the batches a real
engine with the same settings takes from a backlog of the same jobs, packed and padded."""

from __future__ import annotations

import pytest
import torch

from layertap.worker.bench.parts import ceiling_batches
from layertap.worker.engine.engine import Engine
from layertap.worker.engine.records import EngineRequest
from layertap.worker.model.loading import load_model

LENGTHS = [30, 12, 40, 7, 25, 9, 33, 18, 5, 21, 38, 11]
BUDGET = 64


@pytest.mark.parametrize("batching", ["packed", "padded"])
def test_the_ceiling_plans_the_batches_the_engine_takes_from_a_backlog(tiny_models, batching):
    loaded = load_model(str(tiny_models["qwen3"]), name="tiny-qwen3", device="cpu", batching=batching)
    assert loaded.batching.name == batching
    # a host buffer for every job: the engine never waits for a release between batches
    engine = Engine(loaded, token_budget=BUDGET, host_buffers=len(LENGTHS), staging_layers=1)
    try:
        futures = engine.submit_many([EngineRequest(torch.arange(1, n + 1), [2]) for n in LENGTHS])
        slices = [future.result(timeout=30) for future in futures]
    finally:
        engine.stop()
    taken: dict[int, list[int]] = {}
    for index, job_slice in enumerate(slices):
        taken.setdefault(id(job_slice.batch), []).append(index)
        job_slice.release()
    planned = ceiling_batches(loaded, LENGTHS, BUDGET)
    assert len(planned) > 1
    assert sorted(taken.values()) == sorted(planned)
