"""Callers prepare work just ahead of the engine, inside ``Engine.preparing``: it lets a caller
in while fewer than two token budgets are queued and fewer than two callers are inside, and
lets waiting callers in once the engine takes a batch, a caller leaves, or the engine stops.
Jobs answered from disk never wait for a place."""

from __future__ import annotations

import threading

import pytest
import torch

from layertap.protocol.schema import Job
from layertap.settings import Limits
from layertap.worker.engine.engine import MAX_PREPARING, Engine
from layertap.worker.engine.records import EngineRequest
from layertap.worker.extractor import build_processor
from layertap.worker.model.loading import load_model

BUDGET = 64
AHEAD = 2


@pytest.fixture
def engine(tiny_models):
    """An engine with one host buffer, held by a first job's unreleased slice: until the test
    releases it, the engine cannot form another batch, so what is submitted stays queued."""
    loaded = load_model(str(tiny_models["qwen3"]), name="tiny-qwen3", device="cpu")
    engine = Engine(loaded, token_budget=BUDGET, host_buffers=1, prepare_ahead=AHEAD)
    held = engine.submit(EngineRequest(torch.arange(1, 9), [1])).result(timeout=60)
    yield engine, held
    held.release()
    engine.stop()


class _Caller:
    """A thread that enters ``engine.preparing()`` and stays inside until told to leave."""

    def __init__(self, engine: Engine):
        self.inside, self.leave = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._run, args=(engine,), daemon=True)
        self.thread.start()

    def _run(self, engine: Engine) -> None:
        with engine.preparing():
            self.inside.set()
            self.leave.wait(30)

    def done(self) -> None:
        self.leave.set()
        self.thread.join(10)


def _half_budget_requests(count: int) -> list[EngineRequest]:
    return [EngineRequest(torch.arange(1, BUDGET // 2 + 1), [1]) for _ in range(count)]


def test_a_caller_waits_while_two_budgets_are_queued_and_goes_in_once_a_batch_is_taken(engine):
    engine, held = engine
    futures = engine.submit_many(_half_budget_requests(2 * AHEAD))  # AHEAD budgets queued
    caller = _Caller(engine)
    assert not caller.inside.wait(0.3), "a caller went in while two token budgets were queued"
    held.release()  # the engine takes the next batch (one budget): one budget is left queued
    assert caller.inside.wait(30), "the caller still waits after the engine took a batch"
    caller.done()
    for future in futures:
        future.result(timeout=60).release()


def test_at_most_two_callers_prepare_at_once(engine):
    engine, _ = engine
    inside = [_Caller(engine) for _ in range(MAX_PREPARING)]
    assert all(caller.inside.wait(10) for caller in inside)
    late = _Caller(engine)
    assert not late.inside.wait(0.3), f"a caller went in while {MAX_PREPARING} were preparing"
    inside[0].done()
    assert late.inside.wait(10), "a waiting caller did not go in when one left"
    for caller in [*inside[1:], late]:
        caller.done()


def test_stopping_lets_waiting_callers_in(engine):
    engine, held = engine
    futures = engine.submit_many(_half_budget_requests(2 * AHEAD + 1))
    caller = _Caller(engine)
    assert not caller.inside.wait(0.3)
    stopper = threading.Thread(target=engine.stop, daemon=True)  # finishes what is queued, then stops
    stopper.start()
    assert caller.inside.wait(30), "a caller still waits on a stopping engine"
    caller.done()
    held.release()
    for future in futures:
        future.result(timeout=60).release()
    stopper.join(30)


def test_prepare_ahead_zero_never_holds_a_caller_back(tiny_models):
    loaded = load_model(str(tiny_models["qwen3"]), name="tiny-qwen3", device="cpu")
    engine = Engine(loaded, token_budget=BUDGET, host_buffers=1, prepare_ahead=0)
    held = engine.submit(EngineRequest(torch.arange(1, 9), [1])).result(timeout=60)
    try:
        futures = engine.submit_many(_half_budget_requests(8))  # four budgets queued behind the held buffer
        callers = [_Caller(engine) for _ in range(MAX_PREPARING + 2)]
        assert all(caller.inside.wait(10) for caller in callers)
        for caller in callers:
            caller.done()
        held.release()
        for future in futures:
            future.result(timeout=60).release()
    finally:
        held.release()
        engine.stop()


def test_jobs_answered_from_disk_take_no_preparing_place(tiny_models, tmp_path):
    """A redelivered bundle whose files are written is answered while every place is taken."""
    loaded = load_model(str(tiny_models["qwen3"]), name="tiny-qwen3", device="cpu")
    processor = build_processor(loaded, storage_root=tmp_path, worker_name="room-test", layers=[1, 4],
                                limits=Limits(), token_budget=BUDGET)
    jobs = [Job.model_validate({"model": "tiny-qwen3", "run": "room", "job_id": f"j{i}",
                                "token_ids": list(range(1, 6 + i))}) for i in range(3)]
    try:
        assert all(result.ok and not result.cached for result in processor.process_many(jobs))
        inside = [_Caller(processor.engine) for _ in range(MAX_PREPARING)]
        assert all(caller.inside.wait(10) for caller in inside)
        answered: list = []
        thread = threading.Thread(target=lambda: answered.extend(processor.process_many(jobs)), daemon=True)
        thread.start()
        thread.join(10)
        finished = not thread.is_alive()
        for caller in inside:
            caller.done()
        thread.join(30)
        assert finished, "jobs answered from disk waited for a preparing place"
        assert [result.job_id for result in answered] == [job.job_id for job in jobs]
        assert all(result.ok and result.cached for result in answered)
    finally:
        processor.close()
