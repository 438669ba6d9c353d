"""``Engine.call_when_idle`` (a run's sampled rows, measured alone): the work waits while batch
work is queued and runs once none is, or before the next batch once its time is up or it is
hurried; it runs before the engine stops, and fails with the engine's fault."""

from __future__ import annotations

import threading

import pytest
import torch

from layertap.worker.engine.engine import Engine
from layertap.worker.engine.records import EngineRequest
from layertap.worker.model.loading import load_model


@pytest.fixture
def engine(tiny_models):
    loaded = load_model(str(tiny_models["qwen3"]), name="tiny-qwen3", device="cpu")
    engine = Engine(loaded, token_budget=64, max_batch_jobs=1)
    yield engine
    engine.stop()


def _order_after_gate(engine: Engine, idle_within_s: float, hurry: bool = False) -> list[str]:
    """With the engine thread held in earlier idle work, queue idle work, then two one-job batches; let go and
    return the order the work ran in."""
    order: list[str] = []
    engine.on_batch = lambda jobs, tokens: order.append("batch")
    gate, held = threading.Event(), threading.Event()
    engine.call_when_idle(lambda: (held.set(), gate.wait(30)), 0)
    assert held.wait(30)
    idle = engine.call_when_idle(lambda: order.append("idle"), idle_within_s)
    slices = [future for future in engine.submit_many([EngineRequest(torch.arange(1, 9), [1]) for _ in range(2)])]
    if hurry:
        engine.hurry_idle_calls()
    gate.set()
    idle.result(timeout=60)
    for future in slices:
        future.result(timeout=60).release()
    return order


def test_idle_work_waits_for_queued_batches(engine):
    assert _order_after_gate(engine, idle_within_s=3600) == ["batch", "batch", "idle"]


def test_idle_work_that_is_due_or_hurried_runs_before_the_next_batch(engine):
    assert _order_after_gate(engine, idle_within_s=0) == ["idle", "batch", "batch"]
    assert _order_after_gate(engine, idle_within_s=3600, hurry=True) == ["idle", "batch", "batch"]


def test_idle_work_runs_before_the_engine_stops(tiny_models):
    loaded = load_model(str(tiny_models["qwen3"]), name="tiny-qwen3", device="cpu")
    engine = Engine(loaded, token_budget=64)
    gate = threading.Event()
    engine.call_when_idle(lambda: gate.wait(30), 0)
    idle = engine.call_when_idle(lambda: "measured", 3600)
    stopper = threading.Thread(target=engine.stop)
    stopper.start()
    gate.set()
    stopper.join(60)
    assert idle.result(timeout=0) == "measured" and not engine.thread_alive()
