"""A job that fails after the engine handed it its slice gives the host buffer back: failures
never use up ``host_buffers`` and stall every later job (a hung engine waits in ``wait_free``)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from layertap.protocol.schema import ErrorType
from layertap.settings import Limits
from layertap.worker.engine import engine as engine_module
from layertap.worker.extractor import build_processor
from layertap.worker.model.loading import load_model

HOST_BUFFERS = 1
FAILURES = 3 * HOST_BUFFERS + 2  # more failures than buffers: a leak would stall the jobs after them
TIMEOUT_S = 60


@pytest.fixture
def processor(tiny_models, tmp_path):
    loaded = load_model(str(tiny_models["qwen3"]), name="tiny-qwen3", device="cpu")
    value = build_processor(loaded, storage_root=tmp_path / "files", worker_name="buffers-test", layers=[1, 4],
                            limits=Limits(), token_budget=256, host_buffers=HOST_BUFFERS)
    yield value
    value.engine.stop(timeout=2)


def job(i: int, run: str = "buffers") -> dict:
    return {"model": "tiny-qwen3", "run": run, "job_id": f"j{i}", "token_ids": list(range(1, 12 + i))}


def run_all(processor, jobs: list[dict], *, one_at_a_time: bool = False) -> list:
    """Results of ``jobs`` run on daemon threads (a stalled engine must fail the test, not hang it)."""
    results: dict[int, object] = {}
    deadline = time.monotonic() + TIMEOUT_S
    threads = []
    for index, data in enumerate(jobs):
        thread = threading.Thread(target=lambda i=index, d=data: results.__setitem__(i, processor.process(d)),
                                  daemon=True)
        thread.start()
        threads.append(thread)
        if one_at_a_time:
            thread.join(max(0.0, deadline - time.monotonic()))
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    assert len(results) == len(jobs), f"{len(jobs) - len(results)} of {len(jobs)} jobs stalled in the engine"
    return [results[i] for i in range(len(jobs))]


def test_a_failing_wait_gives_its_host_buffer_back(processor, monkeypatch):
    """``JobSlice.wait`` raising stands in for what it does on a GPU when the device fails:
    ``Event.synchronize()`` raises. Jobs of 11..15 tokens fail there; the rest must still run."""
    real_wait = engine_module.JobSlice.wait
    failing = {11 + i for i in range(FAILURES)}

    def wait(self):
        if self.end - self.start in failing:
            raise RuntimeError("CUDA error: an illegal memory access was encountered (in synchronize)")
        return real_wait(self)

    monkeypatch.setattr(engine_module.JobSlice, "wait", wait)
    failed = run_all(processor, [job(i) for i in range(FAILURES)], one_at_a_time=True)  # each takes the buffer
    assert all(r.error_type == ErrorType.internal and "illegal memory access" in r.error for r in failed)
    later = run_all(processor, [job(i) for i in range(FAILURES, FAILURES + 6)])
    assert all(r.ok for r in later), [r.error for r in later]


def test_failing_writes_give_their_host_buffers_back(processor):
    """A real write failure: a file sits where the run's folder must be."""
    blocker = Path(processor.storage_root) / "unwritable"
    blocker.parent.mkdir(parents=True, exist_ok=True)
    blocker.write_text("not a folder")
    failed = run_all(processor, [job(i, "unwritable") for i in range(FAILURES)])
    assert all(r.error_type == ErrorType.write_failed for r in failed), [r.error for r in failed]
    later = run_all(processor, [job(i, "writable") for i in range(6)])
    assert all(r.ok for r in later), [r.error for r in later]
