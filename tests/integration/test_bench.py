"""`layertap bench` runs its four parts on the CPU and reports consistent numbers; the engine's
files equal the naive HF loop's (float32)."""

from __future__ import annotations

import json
import os
import subprocess

from tests.support.processes import cli


def test_bench_runs_all_parts_on_cpu(tmp_path):
    report_path = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "LAYERTAP_REDIS_URL"}
    out = subprocess.run(cli("bench", "--model", "shape:qwen3-tiny", "--device", "cpu", "--layers", "0,2,-1",
                             "--prompts", "12", "--min-len", "8", "--max-len", "48", "--storage",
                             str(tmp_path / "files"), "--report", str(report_path)),
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    report = json.loads(report_path.read_text())
    assert set(report["parts"]) == {"a", "b", "c", "d"}
    assert report["layer_ids"] == [0, 2, 4]
    for part in report["parts"].values():
        assert part["errors"] == 0 and part["tokens"] == report["tokens"] and part["tokens_per_s"] > 0
    assert set(report["ratios"]) == {"c/a", "d/a", "d/b", "c/b"}
    assert report["exactness_vs_unbatched_hf"]["max_abs_error"] <= 1e-5
    assert "| d: queue end to end |" in out.stdout
    assert report["parts"]["d"]["notes"]["batches"] >= 1


def test_bench_backlog_drains_a_full_queue(tmp_path):
    """``--backlog``: every job is queued before the worker starts; all come back, counted once."""
    report_path = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "LAYERTAP_REDIS_URL"}
    out = subprocess.run(cli("bench", "--model", "shape:qwen3-tiny", "--device", "cpu", "--layers", "1,-1",
                             "--prompts", "40", "--min-len", "8", "--max-len", "24", "--parts", "d", "--backlog",
                             "--storage", str(tmp_path / "files"), "--report", str(report_path)),
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    report = json.loads(report_path.read_text())
    queue = report["parts"]["d"]
    assert set(report["parts"]) == {"d"} and report["config"]["backlog"] is True
    assert queue["name"] == "d: queue end to end, draining a backlog"
    assert queue["jobs"] == 40 and queue["errors"] == 0 and queue["tokens"] == report["tokens"]
    assert queue["bytes_written"] > 0  # (the bench removes each part's files after measuring them)
    assert 1 <= queue["notes"]["batches"] <= 40


def test_bench_refuses_a_folder_it_did_not_make(tmp_path):
    """``--storage`` copied from ``worker --storage``: a folder with data in it is refused, not emptied."""
    data = tmp_path / "real-data"
    data.mkdir()
    (data / "keep.safetensors").write_bytes(b"precious")
    out = subprocess.run(cli("bench", "--model", "shape:qwen3-tiny", "--device", "cpu", "--prompts", "2",
                             "--storage", str(data)), capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert "is not empty and was not made by layertap bench" in out.stderr
    assert (data / "keep.safetensors").read_bytes() == b"precious"
