"""Consuming a run: the manifest lists each ok job once with its file's facts; HiddenStatesDataset
yields the documented tensors and collate pads them; the speculators export loads with
datasets.load_from_disk and its files with vLLM's reader protocol, carries the layer ids where
speculators reads them (checked by check-draft), and writes float8 files as bfloat16 states."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess

import datasets
import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from safetensors.torch import load_file
from torch.utils.data import DataLoader

from layertap.producer.dataset import HiddenStatesDataset, collate
from layertap.producer.files.manifest import iter_manifest
from layertap.producer.files.reader import load_hidden_states
from layertap.protocol.fileformat import MetaKey, metadata_of
from tests.integration.test_training_record import FLOAT32_ATOL, FP8_RELATIVE, FP8_SUBNORMAL
from tests.support.processes import cli
from tests.support.reference import load, reference_states

CHATS = [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."},
     {"role": "assistant", "content": "Blue."}],
    [{"role": "user", "content": "What is a token?"}, {"role": "assistant", "content": "A piece of text."},
     {"role": "user", "content": "And a layer?"}, {"role": "assistant", "content": "A step of the model."}],
    [{"role": "user", "content": "Say yes."}, {"role": "assistant", "content": "yes"}],
]
PROMPT = "a plain prompt without a loss mask"
LAYERS = [1, 2, 4]  # the worker's default for a 4-layer model: EAGLE-3's [2, L//2, L-3, L] clamped


def run_cli(env, *args, timeout=120):
    return subprocess.run(cli(*args), env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def finished_run(workers, redis_server, client, run_name, tmp_path):
    """A run of three chats and one prompt on tiny-qwen3, all finished ok; returns (run, job id -> chat)."""
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"id": f"chat-{i}", "messages": chat}) + "\n" for i, chat in enumerate(CHATS))
                    + json.dumps({"id": "prompt-0", "text": PROMPT}) + "\n")
    env = {**os.environ, "LAYERTAP_REDIS_URL": redis_server.url}
    out = run_cli(env, "enqueue", "--model", "tiny-qwen3", "--run", run_name, "--file", str(path), "--format",
                  "messages")
    assert out.returncode == 2 and "line 4: no 'messages' or 'conversations' or 'conversation' column" in out.stderr
    out = run_cli(env, "enqueue", "--model", "tiny-qwen3", "--run", run_name, "--prompt", PROMPT)
    assert out.returncode == 0, out.stderr
    prompt_id = out.stdout.split()[0]
    expected = {f"chat-{i}": chat for i, chat in enumerate(CHATS)} | {prompt_id: None}
    results = client.wait(run_name, list(expected), timeout=120)
    assert all(result.ok for result in results.values())
    return run_name, expected, env


def reference_tokens(tokenizer, chat):
    """Token ids from plain transformers: the chat template's text, tokenized."""
    if chat is None:
        return tokenizer(PROMPT)["input_ids"]
    return tokenizer(tokenizer.apply_chat_template(chat, tokenize=False), add_special_tokens=False)["input_ids"]


def test_manifest_dataset_and_collate(finished_run, tiny_models, tmp_path):
    run, expected, env = finished_run
    _, tokenizer = load(str(tiny_models["qwen3"]))
    for suffix in ("parquet", "jsonl"):
        out = run_cli(env, "manifest", "--run", run, "--out", str(tmp_path / f"m.{suffix}"), "--verify")
        assert out.returncode == 0, out.stderr
    rows = pq.read_table(tmp_path / "m.parquet").to_pylist()
    assert rows == [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert sorted(row["job_id"] for row in rows) == sorted(expected)
    for row in rows:
        reference = reference_tokens(tokenizer, expected[row["job_id"]])
        assert row["num_tokens"] == len(reference)
        assert row["layers"] == LAYERS and row["num_hidden_layers"] == 4 and row["hidden_size"] == 64
        header_checksums = json.loads(row["checksums"])
        assert set(header_checksums) == set(row["tensors"]) >= {"hidden_states", "token_ids"}
        assert ("loss_mask" in row["tensors"]) == (expected[row["job_id"]] is not None)
        assert os.path.exists(row["path"])

    dataset = HiddenStatesDataset(tmp_path / "m.parquet")
    assert len(dataset) == len(rows) and dataset.lengths == [row["num_tokens"] for row in rows]
    for index, row in enumerate(rows):
        item, raw = dataset[index], load_file(row["path"])
        tokens = row["num_tokens"]
        assert item["job_id"] == row["job_id"]
        assert item["input_ids"].dtype == torch.int64 and item["input_ids"].tolist() == reference_tokens(
            tokenizer, expected[row["job_id"]])
        assert item["hidden_states"].shape == (tokens, 3, 64)
        assert torch.equal(item["hidden_states"], raw["hidden_states"])
        assert item["loss_mask"].dtype == torch.int64 and item["loss_mask"].shape == (tokens,)
        if "loss_mask" in raw:
            assert item["loss_mask"].tolist() == raw["loss_mask"].tolist() and 0 < item["loss_mask"].sum() < tokens
        else:
            assert item["loss_mask"].tolist() == [1] * tokens

    picked = HiddenStatesDataset(tmp_path / "m.jsonl", layers=[4, 1], dtype=torch.float16, max_length=5)[0]
    full = load_file(rows[0]["path"])["hidden_states"]
    assert picked["hidden_states"].shape == (5, 2, 64) and picked["hidden_states"].dtype == torch.float16
    assert torch.equal(picked["hidden_states"], full[:5][:, [2, 0]].half())

    pad = tokenizer.pad_token_id
    batches = list(DataLoader(dataset, batch_size=4, collate_fn=lambda items: collate(items, pad_token_id=pad)))
    assert len(batches) == 1
    batch, lengths = batches[0], [row["num_tokens"] for row in rows]
    longest = max(lengths)
    assert batch["job_ids"] == [row["job_id"] for row in rows] and batch["lengths"].tolist() == lengths
    assert batch["input_ids"].shape == (4, longest) and batch["hidden_states"].shape == (4, longest, 3, 64)
    assert batch["attention_mask"].shape == batch["loss_mask"].shape == (4, longest)
    for b, length in enumerate(lengths):
        assert batch["attention_mask"][b].tolist() == [1] * length + [0] * (longest - length)
        assert batch["loss_mask"][b, length:].sum() == 0 and batch["input_ids"][b, length:].eq(pad).all()
        assert batch["hidden_states"][b, length:].abs().sum() == 0
        assert torch.equal(batch["hidden_states"][b, :length], dataset[b]["hidden_states"])


def vllm_load_hidden_states(path):
    """vLLM's reader protocol, as its ``load_hidden_states``: open ``<path>.lock`` (it must exist), take a
    shared flock, then safetensors' ``load_file``."""
    with open(f"{path}.lock") as lock:
        fcntl.flock(lock, fcntl.LOCK_SH)
        return load_file(str(path), device="cpu")


def test_speculators_export(finished_run, tmp_path, client):
    run, expected, env = finished_run
    out_dir = tmp_path / "speculators"
    done = run_cli(env, "export", "--run", run, "--format", "speculators", "--out", str(out_dir))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("layers [1, 2, 4] (vLLM ids, L = 4): target layer ids [1, 2] in ")
    assert "--target-layer-ids 1 2" in done.stdout
    record = json.loads((out_dir / "layertap-export.json").read_text())
    assert record == {"layers": LAYERS, "num_hidden_layers": 4, "target_layer_ids": [1, 2], "model": "tiny-qwen3",
                      "hidden_size": 64, "rows": len(expected), "tokens": record["tokens"]}
    assert yaml.safe_load((out_dir / "speculators.yaml").read_text()) == {  # speculators train --config's layout
        "train": {"data": {"data_path": str(out_dir.resolve())}, "draft": {"target_layer_ids": [1, 2]}}}
    exported = datasets.load_from_disk(str(out_dir))
    assert len(exported) == len(expected)
    assert {"input_ids", "loss_mask", "seq_len"} <= set(exported.column_names)
    assert exported.format["type"] == "torch"  # speculators compares rows to tensors
    paths = {result.job_id: result.path for result in client.latest(run).values()}
    token_freq: dict[int, int] = {}
    for index, row in enumerate(exported):
        hs_path = out_dir / "hidden_states" / f"hs_{index}.safetensors"
        files = load_hidden_states(hs_path)
        original = load_file(paths[row["job_id"]])
        assert torch.equal(vllm_load_hidden_states(hs_path)["hidden_states"], original["hidden_states"])
        assert os.stat(hs_path).st_ino == os.stat(paths[row["job_id"]]).st_ino  # a hard link, no copy
        assert torch.equal(files["hidden_states"], original["hidden_states"])
        assert torch.equal(row["input_ids"], files["token_ids"])
        assert row["seq_len"] == len(files["token_ids"]) == files["hidden_states"].shape[0]
        mask = original["loss_mask"].long() if "loss_mask" in original else torch.ones_like(row["input_ids"])
        assert torch.equal(row["loss_mask"], mask)
        ids, counts = np.unique(files["token_ids"].numpy()[mask.numpy() == 1], return_counts=True)
        for token, count in zip(ids.tolist(), counts.tolist()):
            token_freq[token] = token_freq.get(token, 0) + count
    assert torch.load(out_dir / "token_freq.pt") == token_freq

    assert record["tokens"] == sum(int(length) for length in exported["seq_len"])

    # a draft config naming other layers than the data's fails before any training, with both lists
    checked = run_cli(env, "check-draft", "--config", str(out_dir / "speculators.yaml"), "--export", str(out_dir))
    assert checked.returncode == 0 and checked.stdout.startswith("ok: target layer ids [1, 2]"), checked.stderr
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps({"eagle_aux_hidden_state_layer_ids": [2, 3]}))
    wrong = run_cli(env, "check-draft", "--config", str(draft), "--run", run)
    assert wrong.returncode == 1
    assert f"{draft / 'config.json'} names [2, 3] but the data's auxiliary layers are [1, 2]" in wrong.stderr
    (draft / "config.json").write_text(json.dumps({"architectures": ["Eagle3Speculator"]}))  # names none
    default = run_cli(env, "check-draft", "--config", str(draft), "--export", str(out_dir))
    assert default.returncode == 1 and "names none, so the default [2, 2, 1]" in default.stderr
    reordered = run_cli(env, "check-draft", "--target-layer-ids", "2 1", "--export", str(out_dir))
    assert reordered.returncode == 0, reordered.stderr  # vLLM serves them ascending: the same states

    again = run_cli(env, "export", "--run", run, "--format", "speculators", "--out", str(out_dir))
    assert again.returncode == 1 and again.stderr.startswith(f"error: {out_dir} is not empty")

    # the manifest reports an ok result whose file is gone, and lists the rest
    gone = paths[next(iter(expected))]
    os.unlink(gone)
    manifest = tmp_path / "after.jsonl"
    done = run_cli(env, "manifest", "--run", run, "--out", str(manifest))
    assert (done.returncode == 2 and "No such file" in done.stderr
            and "1 ok result(s) have no valid file and are left out" in done.stderr)
    listed = [entry.job_id for entry in iter_manifest(manifest)]
    assert len(listed) == len(expected) - 1 and gone not in [paths[job_id] for job_id in listed]
    from_manifest = run_cli(env, "export", "--manifest", str(manifest), "--out", str(tmp_path / "from-manifest"))
    assert from_manifest.returncode == 0, from_manifest.stderr
    assert datasets.load_from_disk(str(tmp_path / "from-manifest"))["job_id"] == listed
    from_run = run_cli(env, "export", "--run", run, "--out", str(tmp_path / "from-run"))
    assert from_run.returncode == 2 and "No such file" in from_run.stderr
    assert datasets.load_from_disk(str(tmp_path / "from-run"))["job_id"] == listed


def test_speculators_export_refuses_files_without_the_last_layer(workers, redis_server, client, run_name, tmp_path):
    env = {**os.environ, "LAYERTAP_REDIS_URL": redis_server.url}
    out = run_cli(env, "enqueue", "--model", "tiny-qwen3", "--run", run_name, "--layers", "1,2", "--prompt", "hi there")
    assert out.returncode == 0, out.stderr
    assert client.wait(run_name, out.stdout.split(), timeout=60)[out.stdout.split()[0]].ok
    refused = run_cli(env, "export", "--run", run_name, "--out", str(tmp_path / "a"))
    assert refused.returncode == 1
    assert "has layers [1, 2]: speculators reads the last one as the verifier's last layer, vLLM id 4" in refused.stderr
    allowed = run_cli(env, "export", "--run", run_name, "--out", str(tmp_path / "b"), "--any-layers")
    assert allowed.returncode == 0, allowed.stderr
    assert len(datasets.load_from_disk(str(tmp_path / "b"))) == 1
    assert "they do not end with 4: no speculators.yaml written" in allowed.stdout
    assert not (tmp_path / "b" / "speculators.yaml").exists()


def test_speculators_export_writes_float8_files_as_bfloat16_states(workers, tiny_models, redis_server, client,
                                                                   run_name, tmp_path):
    env = {**os.environ, "LAYERTAP_REDIS_URL": redis_server.url}
    out = run_cli(env, "enqueue", "--model", "tiny-qwen3", "--run", run_name, "--dtype", "float8", "--prompt", PROMPT)
    assert out.returncode == 0, out.stderr
    result = client.wait(run_name, out.stdout.split(), timeout=60)[out.stdout.split()[0]]
    assert result.ok and result.dtype == "float8_e4m3"
    done = run_cli(env, "export", "--run", run_name, "--out", str(tmp_path / "fp8"))
    assert done.returncode == 0, done.stderr
    assert "1 float8 written as bfloat16" in done.stderr

    hs_path = tmp_path / "fp8" / "hidden_states" / "hs_0.safetensors"
    plain = vllm_load_hidden_states(hs_path)  # what speculators' file backend and vLLM's reader get: states
    assert plain["hidden_states"].dtype == torch.bfloat16 and "hidden_states_scale" not in plain
    decoded = load_hidden_states(result.path)  # the float8 file, decoded with its scales
    assert torch.equal(plain["hidden_states"], decoded["hidden_states"].to(torch.bfloat16))
    assert torch.equal(load_hidden_states(hs_path)["hidden_states"], plain["hidden_states"])  # a verified layertap file
    meta = metadata_of(hs_path)
    assert (meta[MetaKey.DTYPE], meta[MetaKey.DEQUANTIZED_FROM]) == ("bfloat16", "float8_e4m3")

    # the documented error against the captured states: float8's bound plus bfloat16's rounding of the value
    token_ids = plain["token_ids"].tolist()
    exact = reference_states(str(tiny_models["qwen3"]), token_ids, LAYERS)
    scale = load_hidden_states(result.path, dequantize=False)["hidden_states_scale"]
    copy = plain["hidden_states"].float()
    bound = (FP8_RELATIVE * exact.abs() + FP8_SUBNORMAL * scale[..., None] + 2.0**-8 * decoded["hidden_states"].abs()
             + 2 * FLOAT32_ATOL)
    assert torch.all((copy - exact).abs() <= bound), f"worst excess {((copy - exact).abs() - bound).max().item():.3g}"
