"""Impossible jobs are refused before they cost anything: layers the live workers' model lacks
(``Client.submit(check=True)``, ``layertap enqueue``), and prompts past the model's context
length (refused ``too_long``, or truncated with a warning on the result when the job asks)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
from transformers import GPT2Config, LlamaConfig, Qwen3Config

from layertap.producer.dataset import HiddenStatesDataset, collate
from layertap.producer.files.manifest import entry_from_file
from layertap.protocol import keys
from layertap.protocol.layers import LayerIdError
from layertap.protocol.schema import ErrorType
from layertap.worker.job.tokenize import context_length
from tests.support.processes import cli

MODEL = "tiny-qwen3"


def test_submit_and_enqueue_refuse_layers_the_served_model_lacks(workers, redis_server, client, run_name):
    depth = client.workers()["test-qwen3@localhost"]["num_layers"]
    with pytest.raises(LayerIdError, match="out of range"):
        client.submit({"prompt": "too deep"}, model=MODEL, run=run_name, layers=[depth + 5], check=True)
    client.submit({"prompt": "deep enough"}, model=MODEL, run=run_name, layers=[depth, -1 - depth], check=True)
    env = {**os.environ, "LAYERTAP_REDIS_URL": redis_server.url}
    refused = subprocess.run(cli("enqueue", "--model", MODEL, "--run", f"{run_name}-cli", "--prompt", "a",
                                 "--prompt", "b", "--layers", f"1,{depth + 1}"),
                             env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "0 job(s) sent" in refused.stderr and "2 bad row(s)" in refused.stderr
    assert "out of range" in refused.stderr
    assert client.redis.hlen(keys.run_submitted_hash(f"{run_name}-cli")) == 0
    assert client.redis.hlen(keys.run_submitted_hash(run_name)) == 1  # only the job that can run


@pytest.fixture
def short_model(tiny_models, tmp_path):
    """The tiny Qwen3 checkpoint with a context length of 64 positions."""
    folder = tmp_path / "short-model"
    shutil.copytree(tiny_models["qwen3"], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 64}))
    return folder


def test_a_prompt_past_the_context_length_is_refused_or_truncated_with_a_warning(make_worker, private_client,
                                                                                    short_model):
    make_worker("short@localhost", model_dir=short_model, name="tiny-short")
    too_long = private_client.submit({"token_ids": [5] * 100}, model="tiny-short", run="ctx")
    cut = private_client.submit({"token_ids": [5] * 100, "truncate": True}, model="tiny-short", run="ctx")
    fits = private_client.submit({"token_ids": [5] * 64}, model="tiny-short", run="ctx")
    results = private_client.wait("ctx", [too_long.job_id, cut.job_id, fits.job_id], timeout=120)
    refused = results[too_long.job_id]
    assert refused.error_type == ErrorType.too_long and "context length (64)" in refused.error
    assert results[cut.job_id].ok and results[cut.job_id].num_tokens == 64
    assert "truncated from 100 to 64 tokens" in results[cut.job_id].warning
    assert results[fits.job_id].ok and results[fits.job_id].warning is None


def test_context_length_is_derived_as_vllm_derives_max_model_len():
    assert context_length(Qwen3Config(max_position_embeddings=40960)) == 40960
    assert context_length(GPT2Config(n_positions=1024)) == 1024
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert context_length(Qwen3Config(max_position_embeddings=32768, rope_scaling=yarn)) == 131072
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    assert context_length(LlamaConfig(max_position_embeddings=131072, rope_scaling=llama3)) == 131072


def test_export_and_the_dataset_refuse_mixed_layers_before_any_work(workers, redis_server, client, run_name,
                                                                     tmp_path):
    """``export`` checks that the run's layers agree before it writes anything; ``HiddenStatesDataset``
    refuses files of different layers when it is built (same count: they would batch, mixed up)."""
    jobs = [client.submit({"prompt": f"row {index}"}, model=MODEL, run=run_name, layers=layers)
            for index, layers in enumerate([[1, -1], [1, -1], [2, -1]])]
    results = client.wait(run_name, [job.job_id for job in jobs], timeout=60)
    assert all(result.ok for result in results.values())
    entries = [entry_from_file(job_id, result.path) for job_id, result in results.items()]
    with pytest.raises(ValueError, match=r"pass layers=\[...\]"):
        HiddenStatesDataset(entries)
    top = entries[0].num_hidden_layers
    batch = collate([item for item in HiddenStatesDataset(entries, layers=[top])])
    assert batch["hidden_states"].shape[:3] == (3, max(entry.num_tokens for entry in entries), 1)

    env = {**os.environ, "LAYERTAP_REDIS_URL": redis_server.url}
    out = tmp_path / "export"
    for _ in range(2):  # the same answer again: nothing was left behind to make it "not empty"
        refused = subprocess.run(cli("export", "--run", run_name, "--out", str(out)), env=env,
                                 capture_output=True, text=True, timeout=120)
        assert refused.returncode == 1 and "speculators needs the same layers in every file" in refused.stderr
        assert not out.exists()
