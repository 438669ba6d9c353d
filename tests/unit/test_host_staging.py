"""Reused host buffers: batches share memory one after another, never at once, and the
states read from them still equal plain transformers."""

from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from layertap.producer.files.reader import load_hidden_states
from layertap.settings import Limits
from layertap.worker.engine.host_buffers import ALIGNMENT, HostStaging, slot_capacity
from layertap.worker.extractor import build_processor
from layertap.worker.model.loading import load_model
from tests.support.reference import reference_states


def test_slot_carves_aligned_views_and_overflows_to_its_own_memory():
    staging = HostStaging(1, capacity=4096, pinned=False)
    slot = staging.acquire()
    first = slot.take((3, 5), torch.float32)  # 60 bytes
    second = slot.take((10,), torch.bool)
    assert first.shape == (3, 5) and first.dtype == torch.float32
    assert second.data_ptr() - first.data_ptr() == ALIGNMENT  # the next piece starts on the next boundary
    too_big = slot.take((2048,), torch.float32)  # 8 KiB: more than is left
    assert too_big.shape == (2048,)
    assert not (first.data_ptr() <= too_big.data_ptr() < first.data_ptr() + 4096)
    staging.release(slot)
    again = staging.acquire().take((3, 5), torch.float32)
    assert again.data_ptr() == first.data_ptr()  # the slot is reused from its start


def test_acquire_waits_for_a_release():
    staging = HostStaging(1, capacity=1024, pinned=False)
    slot = staging.acquire()
    taken = threading.Event()
    thread = threading.Thread(target=lambda: (staging.acquire(), taken.set()))
    thread.start()
    assert not taken.wait(0.2)
    assert staging.free_slots() == 0
    staging.release(slot)
    assert taken.wait(5)
    thread.join()


def test_slot_capacity_fits_a_full_batch_of_the_planned_layers():
    capacity = slot_capacity(token_budget=512, layers=3, hidden_size=64, dtype=torch.float32)
    staging = HostStaging(1, capacity, pinned=False)
    slot = staging.acquire()
    states = slot.take((512, 3, 64), torch.float32)
    flags = slot.take((512, 3), torch.bool)
    base = states.data_ptr()
    for tensor in (states, flags):  # both views into the slot, not allocations of their own
        assert base <= tensor.data_ptr() < base + capacity


@pytest.mark.parametrize("layer_lists", [
    [[1, 4]],  # the planned layers in order: files are written straight from views into the buffer
    [[1, 4], [0, 1, 2, 3, 4], [3], [4, 0, 2]],  # mixed, some wider than the buffer was planned for
], ids=["planned-layers", "mixed-layers"])
def test_many_batches_through_one_host_buffer_match_transformers(layer_lists, tiny_models, tmp_path):
    """One host buffer, a small token budget, one writer at a time: every batch reuses the
    buffer the previous one filled, while that batch's files may still be waiting to be written."""
    model_dir = str(tiny_models["qwen3"])
    loaded = load_model(model_dir, name="tiny-qwen3", device="cpu")
    processor = build_processor(loaded, storage_root=tmp_path, worker_name="staging-test", layers=[1, 4],
                                limits=Limits(), token_budget=96, host_buffers=1,
                                writer_threads=1)  # slow writers: a buffer reused too early would show
    rng = random.Random(7)
    jobs = [{"model": "tiny-qwen3", "run": "staging", "job_id": f"j{i}",
             "token_ids": [rng.randrange(1, 200) for _ in range(rng.randint(3, 60))],
             "layers": layer_lists[i % len(layer_lists)]} for i in range(24)]
    try:
        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(processor.process, jobs))
        batches = processor.engine.stats.batches
    finally:
        processor.engine.stop()
    total_tokens = sum(len(job["token_ids"]) for job in jobs)
    assert batches >= -(-total_tokens // 96) > 4  # the one buffer served batch after batch
    for job, result in zip(jobs, results):
        assert result.ok, result.error
        states = load_hidden_states(result.path)["hidden_states"]
        expected = reference_states(model_dir, job["token_ids"], sorted(job["layers"]))  # files hold layers ascending
        torch.testing.assert_close(states, expected, atol=1e-5, rtol=1e-5)


def test_next_batch_waits_for_a_free_buffer_and_takes_everything_queued_meanwhile(tiny_models):
    """With the only host buffer held, jobs that arrive are not cut into a batch early: once
    the buffer is free they go into one batch together."""
    from layertap.worker.engine.engine import Engine
    from layertap.worker.engine.records import EngineRequest

    loaded = load_model(str(tiny_models["qwen3"]), name="tiny-qwen3", device="cpu")
    engine = Engine(loaded, token_budget=4096, host_buffers=1, staging_layers=1)
    try:
        first = engine.submit(EngineRequest(torch.arange(1, 9), [2])).result(timeout=30)
        held = first.wait()  # the batch's views are in use: its buffer is not free
        assert engine.stats.buffer_wait_s < 0.2
        later = []
        for i in range(3):  # each arrives well after the engine's 2 ms batch wait
            later.append(engine.submit(EngineRequest(torch.arange(1, 5 + i), [2])))
            threading.Event().wait(0.1)
        assert not any(future.done() for future in later)
        held.release()
        batches = []
        for future in later:
            piece = future.result(timeout=30)
            batches.append(piece.batch)
            piece.wait().release()
        assert len({id(batch) for batch in batches}) == 1  # one batch for all three
        assert engine.stats.batches == 2
        assert engine.stats.buffer_wait_s >= 0.25  # counted: it waited out the three 0.1 s arrivals
    finally:
        engine.stop()
