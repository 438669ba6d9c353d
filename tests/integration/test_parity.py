"""Files written through the whole queue path equal plain transformers, layer by layer."""

from __future__ import annotations

import json

import pytest
import torch

from layertap.producer.files.reader import load_hidden_states
from layertap.protocol.fileformat import MetaKey, metadata_of
from tests.support.reference import load, reference_states

PROMPTS = [
    "hello the model is fast",
    "explain why the residual stream is a good place to read " * 12,
    "a",
    "what is the capital of a small city near a river? tell me about it. " * 5,
]


@pytest.mark.parametrize("arch", ["qwen3", "llama", "gpt2"])
def test_queue_path_matches_transformers(arch, arch_workers, tiny_models, client, run_name):
    model_dir = str(tiny_models[arch])
    _, tokenizer = load(model_dir)
    num_layers = 4
    asked = [num_layers, 0, -2, 2]  # unordered on purpose: files hold them ascending, as vLLM captures them
    resolved = [0, 2, 3, 4]
    jobs = [client.submit({"prompt": p}, model=f"tiny-{arch}", run=run_name, layers=asked) for p in PROMPTS]
    token_job = client.submit({"token_ids": [5, 17, 33, 2, 9, 101]}, model=f"tiny-{arch}", run=run_name,
                              layers=[-1, 1])
    results = client.wait(run_name, [j.job_id for j in [*jobs, token_job]], timeout=120)
    for job, prompt in zip(jobs, PROMPTS):
        result = results[job.job_id]
        assert result.ok, result.error
        assert result.layers == resolved
        files = load_hidden_states(result.path)
        expected_ids = tokenizer(prompt)["input_ids"]
        assert files["token_ids"].tolist() == expected_ids
        assert files["token_ids"].dtype == torch.int64
        assert result.num_tokens == len(expected_ids)
        reference = reference_states(model_dir, expected_ids, resolved)
        assert files["hidden_states"].shape == reference.shape
        torch.testing.assert_close(files["hidden_states"], reference, atol=1e-5, rtol=1e-5)
        meta = metadata_of(result.path)
        assert json.loads(meta[MetaKey.LAYERS]) == resolved
        assert meta[MetaKey.LAYER_CONVENTION] == "vllm"
    token_result = results[token_job.job_id]
    assert token_result.ok, token_result.error
    files = load_hidden_states(token_result.path)
    torch.testing.assert_close(files["hidden_states"], reference_states(model_dir, [5, 17, 33, 2, 9, 101], [1, 4]),
                               atol=1e-5, rtol=1e-5)


def test_pre_norm_last_layer_differs_from_hf_last_hidden_state(workers, tiny_models, client, run_name):
    """Id L is before the final norm: it must not equal HF's hidden_states[-1] (after the norm)."""
    model_dir = str(tiny_models["qwen3"])
    model, tokenizer = load(model_dir)
    job = client.submit({"prompt": "the cat and the dog"}, model="tiny-qwen3", run=run_name, layers=[-1])
    result = client.wait(run_name, [job.job_id], timeout=60)[job.job_id]
    states = load_hidden_states(result.path)["hidden_states"][:, 0]
    with torch.no_grad():
        hf_last = model(torch.tensor([tokenizer("the cat and the dog")["input_ids"]]),
                        output_hidden_states=True).hidden_states[-1][0]
    assert not torch.allclose(states, hf_last, atol=1e-3)
    torch.testing.assert_close(model.model.norm(states), hf_last, atol=1e-5, rtol=1e-5)
