"""The worked example (examples/eagle_toy.py) runs end to end on the CPU: 200 ShareGPT-style
conversations through a real worker, a manifest consistent with the files, and a toy draft
head whose loss goes down."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
from safetensors import safe_open

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "eagle_toy.py"


def test_eagle_toy_example(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAYERTAP_")}
    metrics_path = tmp_path / "metrics.json"
    out = subprocess.run([sys.executable, str(EXAMPLE), "--workdir", str(tmp_path / "work"), "--steps", "30",
                          "--json", str(metrics_path)], env=env, capture_output=True, text=True, timeout=420)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    metrics = json.loads(metrics_path.read_text())
    losses = metrics["losses"]
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5, losses

    rows = pq.read_table(metrics["manifest"]).to_pylist()
    assert metrics["jobs"] == len(rows) == 200
    assert sorted(row["job_id"] for row in rows) == [f"toy-{i:04d}" for i in range(200)]
    assert sum(row["num_tokens"] for row in rows) == metrics["tokens"]
    files = sorted((tmp_path / "work" / "files" / "eagle-toy").glob("*/*.safetensors"))
    assert sorted(row["path"] for row in rows) == [str(f) for f in files]
    for row in rows:
        with safe_open(row["path"], framework="numpy") as handle:
            assert handle.metadata()["job_id"] == row["job_id"]
            hidden = handle.get_slice("hidden_states").get_shape()
            assert hidden == [row["num_tokens"], 4, row["hidden_size"]]
            assert row["layers"] == [1, 2, 3, 4]
            mask = handle.get_tensor("loss_mask")
            assert 0 < mask.sum() < row["num_tokens"]


def test_eagle_toy_example_online(tmp_path):
    """--online: the worker, the enqueue and the training run at once; the loss goes down as offline,
    the files stay under the in-flight limit and none is left."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAYERTAP_")}
    metrics_path = tmp_path / "metrics.json"
    out = subprocess.run([sys.executable, str(EXAMPLE), "--online", "--workdir", str(tmp_path / "work"), "--steps",
                          "20", "--json", str(metrics_path)], env=env, capture_output=True, text=True, timeout=420)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    metrics = json.loads(metrics_path.read_text())
    losses = metrics["losses"]
    assert metrics["jobs"] == 320 and len(losses) == 20  # each conversation once, in batches of 16
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5, losses
    assert 0 < metrics["peak_files"] <= metrics["max_inflight"]
    assert f"peak on disk: {metrics['peak_bytes']} bytes" in out.stdout
    assert metrics["files_left"] == 0
    assert [path for path in (tmp_path / "work" / "files").rglob("*") if path.is_file()] == []
