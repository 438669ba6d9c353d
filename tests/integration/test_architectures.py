"""The architecture sweep: every causal-LM family, batched the way the worker batches it,
equals plain transformers run on each prompt alone, layer by layer, in the vLLM convention.

Tiny random float32 models (``tests/support/architectures.py``) are saved, loaded back through
``from_pretrained`` by the worker's own loader, and served by the in-process engine.
Several prompts of different lengths (3 to 41 tokens) go in together; the test asserts
that the engine batched prompts of different lengths together, that the file header names
the path the architecture's structure calls for, and that every layer ``0..L`` of every
prompt is within 1e-5 (relative, worst token) of the reference.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

from producer.files.reader import load_hidden_states
from producer.protocol.fileformat import MetaKey, metadata_of
from tests.support.architectures import ARCHITECTURES, SHIFTED_HIDDEN_STATES, build_tiny
from tests.support.processes import cli
from tests.support.reference import block_input_states, reference_states
from worker.extractor import Extractor
from worker.model.batching import ModelRefused
from worker.model.loading import load_model

LENGTHS = (3, 41, 17, 9, 26, 38, 30, 12)
TOLERANCE = 1e-5


def worst_token_relative_error(got: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """``[T, n_layers, H]`` pair -> ``[n_layers]``: the largest ``|got_t - ref_t| / |ref_t|`` over tokens."""
    return ((got.double() - reference.double()).norm(dim=-1) / reference.double().norm(dim=-1).clamp_min(1e-30)).amax(0)


def prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in LENGTHS]


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_batched_files_equal_each_prompt_alone(name, tmp_path):
    model_dir = str(build_tiny(name, tmp_path / "model"))
    _, _, expected_path = ARCHITECTURES[name]
    loaded = load_model(model_dir, name=name, device="cpu", dtype="float32")
    assert loaded.batching.path.value == expected_path, loaded.batching.reason
    layer_ids = list(range(loaded.num_layers + 1))
    batches: list[tuple[int, int]] = []
    with Extractor(loaded, layers=layer_ids, batch_wait_ms=300) as extractor:
        extractor.processor.engine.on_batch = lambda jobs, tokens: batches.append((jobs, tokens))
        inputs = prompts(loaded.vocab_size)
        results = extractor.extract(inputs, tmp_path / "files", run="sweep")
    assert max(jobs for jobs, _ in batches) >= 2, f"no two prompts were batched together: {batches}"
    for ids, result in zip(inputs, results):
        assert result.ok, result.error
        files = load_hidden_states(result.path)
        assert files["token_ids"].tolist() == ids
        meta = metadata_of(result.path)
        assert meta[MetaKey.BATCHING] == expected_path
        assert json.loads(meta[MetaKey.LAYERS]) == layer_ids
        references = [block_input_states(model_dir, ids, layer_ids)]
        if name not in SHIFTED_HIDDEN_STATES:
            references.append(reference_states(model_dir, ids, layer_ids))
        for reference in references:
            assert files["hidden_states"].shape == reference.shape
            errors = worst_token_relative_error(files["hidden_states"], reference)
            assert errors.max() <= TOLERANCE, f"{name}, {len(ids)} tokens: relative error per layer {errors.tolist()}"


def test_forced_packing_of_a_hybrid_is_refused_by_the_self_check(tmp_path):
    """Packing a gated-delta-net hybrid leaks state between prompts; the load-time check refuses it."""
    model_dir = str(build_tiny("qwen3-next", tmp_path / "model"))
    loaded = load_model(model_dir, name="forced", device="cpu", dtype="float32", batching="packed")
    with pytest.raises(ModelRefused, match="cannot serve Qwen3NextForCausalLM: packed batching changes the hidden"):
        Extractor(loaded)


@pytest.mark.parametrize("name", ["gpt-oss-sinks", "gemma2-softcap"])
def test_forced_packing_without_the_attention_feature_is_refused(name, tmp_path):
    """Packed attention does not do sinks or softcapping: asked for anyway, the model is refused, not served."""
    loaded = load_model(str(build_tiny(name, tmp_path / "model")), name=name, device="cpu", dtype="float32",
                        batching="packed")
    with pytest.raises(ModelRefused, match="not supported by packed attention"):
        Extractor(loaded)


def worker_start(model_dir: str, *extra: str) -> subprocess.CompletedProcess:
    """``layertap worker`` on a model that cannot be served: it must exit before reaching Redis."""
    env = {**os.environ, "LAYERTAP_REDIS_URL": "redis://127.0.0.1:1/0"}  # nothing listens: never reached
    return subprocess.run(cli("worker", "--model", model_dir, "--device", "cpu", *extra), env=env,
                          capture_output=True, text=True, timeout=180)


def test_worker_refuses_at_start_with_one_line(tmp_path):
    model_dir = str(build_tiny("qwen3-next", tmp_path / "model"))
    done = worker_start(model_dir, "--batching", "packed")
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert errors and errors[0].startswith("error: cannot serve Qwen3NextForCausalLM: packed batching changes"), done.stderr
    assert "Traceback" not in done.stderr


def test_a_model_without_a_causal_decoder_is_refused_in_one_line(tmp_path):
    from transformers import T5Config, T5ForConditionalGeneration

    T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2)
                               ).save_pretrained(tmp_path / "t5")
    done = worker_start(str(tmp_path / "t5"))
    assert done.returncode != 0
    assert "error: cannot serve T5Config (t5): transformers has no causal LM class" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
