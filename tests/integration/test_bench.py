"""`layertap bench` runs its four parts on the CPU and reports consistent numbers; the engine's
files equal the naive HF loop's (float32)."""

from __future__ import annotations

import json
import os
import subprocess

from tests.support.processes import cli


def bench_tiny_on_cpu(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    """``layertap bench`` of the tiny shape on the CPU (its embedded Redis): its output and JSON report."""
    report_path = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "LAYERTAP_REDIS_URL"}
    out = subprocess.run(cli("bench", "--model", "shape:qwen3-tiny", "--device", "cpu", *args, "--storage",
                             str(tmp_path / "files"), "--report", str(report_path)),
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return out, json.loads(report_path.read_text())


def test_bench_runs_all_parts_on_cpu(tmp_path):
    out, report = bench_tiny_on_cpu(tmp_path, "--layers", "0,2,-1", "--prompts", "12", "--min-len", "8",
                                    "--max-len", "48")
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
    _, report = bench_tiny_on_cpu(tmp_path, "--layers", "1,-1", "--prompts", "40", "--min-len", "8", "--max-len", "24",
                                  "--parts", "d", "--backlog")
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
                             "--storage", str(data)), capture_output=True, text=True, timeout=450)
    assert out.returncode == 1
    assert "is not empty and was not made by layertap bench" in out.stderr
    assert (data / "keep.safetensors").read_bytes() == b"precious"


def test_bench_on_a_cpu_defaults_layers_and_its_ceiling_is_a_ceiling(tmp_path):
    """No --layers: EAGLE-3's [2, L//2, L-3, L] of the loaded model (L = 4: [1, 2, 4]). The bare
    forward (b) runs as the engine's forwards do, so it is above the engine (c), which does
    the same forwards and more; it was 3-4x below when timed on the main thread."""
    out, report = bench_tiny_on_cpu(tmp_path, "--parts", "b,c", "--prompts", "16", "--min-len", "64",
                                    "--max-len", "512")
    assert report["layer_ids"] == [1, 2, 4] and report["config"]["layers"] is None
    ceiling, engine = report["parts"]["b"]["tokens_per_s"], report["parts"]["c"]["tokens_per_s"]
    print(f"b {ceiling:,.0f} tokens/s, c {engine:,.0f} tokens/s")
    assert ceiling >= 0.6 * engine  # (a generous share: both ran under the same load)
    assert "GFLOP/s" in out.stdout and "0.0 TFLOP/s" not in out.stdout  # a CPU's rate in a unit that shows it


def test_bench_refuses_a_big_shape_on_a_cpu_before_building_it(tmp_path):
    out = subprocess.run(cli("bench", "--device", "cpu", "--storage", str(tmp_path / "files")),
                         capture_output=True, text=True, timeout=450)
    assert out.returncode == 1
    assert out.stderr.strip() == ("error: --model shape:qwen3-8b has 8.2B parameters (33 GB of float32 weights): too "
                                  "big for a CPU bench; use --model shape:qwen3-tiny on a CPU, or --device cuda")
    assert not (tmp_path / "files").exists()  # refused before its storage was claimed or a model built


def test_bench_table_hides_mfu_without_a_matmul_rate():
    from layertap.worker.bench.report import format_flops, format_table

    part = {"name": "b: forward-only ceiling (packed)", "tokens_per_s": 1000.0, "gb_per_s": 0.0, "mfu": None,
            "device_idle_share": None, "seconds": 1.0, "errors": 0, "notes": {}}
    assert "| b: forward-only ceiling (packed) | 1,000 | 0.00 | - |  | 1.00 | 0 |" in format_table(
        {"parts": {"b": part}, "ratios": {}})
    assert format_flops(0.0) == "unknown FLOP/s" and format_flops(5.2e10) == "52.0 GFLOP/s"
    assert format_flops(9.9e14) == "990.0 TFLOP/s"
