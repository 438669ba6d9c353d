"""The engine's own failures, on a real tiny model: what it raises, that it keeps serving after
a failed batch, and the error type each becomes in a job's result."""

from __future__ import annotations

import pytest
import torch

from layertap.protocol.schema import ErrorType
from layertap.settings import Limits
from layertap.worker.engine.engine import Engine
from layertap.worker.engine.errors import BatchFailed, EngineError, EngineStopped
from layertap.worker.engine.records import EngineRequest
from layertap.worker.extractor import build_processor
from layertap.worker.job.pipeline import ENGINE_ERROR_TYPES
from layertap.worker.model.loading import load_model


@pytest.fixture
def loaded(tiny_models):
    return load_model(str(tiny_models["qwen3"]), name="tiny-qwen3", device="cpu")


def test_every_engine_error_has_an_error_type():
    assert set(ENGINE_ERROR_TYPES) == set(EngineError.__subclasses__())
    assert ENGINE_ERROR_TYPES[BatchFailed] is ErrorType.internal  # transient: the job is retried


def test_a_failing_forward_fails_its_batch_only(loaded):
    engine = Engine(loaded, token_budget=256, host_buffers=1, staging_layers=1)
    try:
        outside = torch.tensor([loaded.vocab_size + 5, 1, 2])  # past the embedding table: the forward raises
        with pytest.raises(BatchFailed, match="IndexError"):
            engine.submit(EngineRequest(outside, [2])).result(timeout=30)
        captured = engine.submit(EngineRequest(torch.arange(1, 9), [2])).result(timeout=30).wait()
        assert captured.hidden_states.shape == (8, 1, loaded.hidden_size)
        captured.release()
    finally:
        engine.stop()


def test_a_stopped_engine_refuses_and_the_job_gets_an_internal_error(loaded, tmp_path):
    processor = build_processor(loaded, storage_root=tmp_path, worker_name="errors-test", layers=[1],
                                limits=Limits(), token_budget=256)
    processor.engine.stop()
    with pytest.raises(EngineStopped):
        processor.engine.submit(EngineRequest(torch.arange(1, 9), [1]))
    result = processor.process({"model": "tiny-qwen3", "run": "errors", "job_id": "j0", "token_ids": [1, 2, 3]})
    assert result.error_type is ErrorType.internal and result.error == "the engine is shutting down"


def test_warm_up_runs_one_small_and_one_full_batch(loaded):
    """The worker's warm-up (``full_batch=True``): a 512-token request, then one batch filled to
    the budget with 128-token requests, both before any job; the engine serves jobs after."""
    engine = Engine(loaded, token_budget=1024, host_buffers=1, staging_layers=1)
    try:
        engine.warm_up(full_batch=True)
        assert (engine.stats.batches, engine.stats.jobs, engine.stats.tokens) == (2, 1 + 1024 // 128, 512 + 1024)
        captured = engine.submit(EngineRequest(torch.arange(1, 9), [2])).result(timeout=30).wait()
        assert captured.hidden_states.shape == (8, 1, loaded.hidden_size)
        captured.release()
    finally:
        engine.stop()
