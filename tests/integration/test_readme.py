"""The README's examples run as written: every ``python`` block, and the training-data
commands (enqueue, watch, manifest, export) the DataLoader example reads from, in the order
they appear, in one working folder. The model is a tiny random qwen3 with 36 layers saved
in a local Hugging Face cache as ``Qwen/Qwen3-8B`` (read offline), served by a real worker
under that name, so the examples' model names and layer ids are valid unchanged."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.processes import WorkerProcess

README = Path(__file__).resolve().parents[2] / "README.md"
HUB_ID = "Qwen/Qwen3-8B"
BLOCK = re.compile(r"^```(python|bash)\n(.*?)^```", re.MULTILINE | re.DOTALL)


def readme_blocks() -> list[tuple[str, str]]:
    """``(language, code)`` of the blocks that run here: every python block, the five-minute
    walkthrough (it holds ``make-tiny-model``), and the bash blocks that make the training data
    (they hold ``layertap manifest``)."""
    return [(language, code) for language, code in BLOCK.findall(README.read_text())
            if language == "python" or "layertap manifest" in code or "make-tiny-model" in code]


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``HF_HOME`` holding a tiny 36-layer model as the snapshot of ``Qwen/Qwen3-8B``."""
    from worker.model.tiny_model import make_tiny_model

    home = tmp_path_factory.mktemp("hf-home")
    repo = home / "hub" / f"models--{HUB_ID.replace('/', '--')}"
    revision = "0" * 40
    make_tiny_model(repo / "snapshots" / revision, "qwen3", num_layers=36)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return home


def sharegpt_rows(count: int) -> str:
    return "".join(json.dumps({"id": f"chat-{i}", "conversations": [
        {"from": "human", "value": f"Question number {i}: what is {i} plus {i}?"},
        {"from": "gpt", "value": f"It is {2 * i}."}]}) + "\n" for i in range(count))


def test_readme_examples_run_as_written(hub_cache, redis_server, tmp_path):
    blocks = readme_blocks()
    assert [language for language, _ in blocks] == ["bash", "python", "python", "python", "python", "bash",
                                                    "python"], blocks
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("LAYERTAP_")},
           "LAYERTAP_REDIS_URL": redis_server.url, "HF_HOME": str(hub_cache), "HF_HUB_OFFLINE": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    workdir = tmp_path / "work"
    workdir.mkdir()
    (workdir / "sharegpt.jsonl").write_text(sharegpt_rows(10))
    worker = WorkerProcess(HUB_ID, HUB_ID, redis_server.url, tmp_path / "files", node="readme@localhost",  # type: ignore[arg-type]
                           env={"HF_HOME": str(hub_cache), "HF_HUB_OFFLINE": "1"}, log_path=tmp_path / "worker.log")
    outputs = []
    try:
        worker.start()
        for language, code in blocks:
            command = [sys.executable, "-c", code] if language == "python" else ["bash", "-e", "-c", code]
            out = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True, timeout=180)
            assert out.returncode == 0, f"{code}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}\n{worker.log_text()[-2000:]}"
            outputs.append(out.stdout)
    finally:
        worker.stop()
    walkthrough_out, walkthrough_read_out, client_out, bundles_out, extractor_out, _, loader_out = outputs
    assert "run walkthrough complete: 2 ok, 0 failed" in walkthrough_out, walkthrough_out
    assert re.fullmatch(r"(ok torch\.Size\(\[\d+, 3, 64\]\)\n){2}", walkthrough_read_out), walkthrough_read_out
    assert re.fullmatch(r"torch\.Size\(\[\d+, 3, 64\]\)\n", client_out), client_out
    assert bundles_out == "200 jobs done\n", bundles_out
    paths = ast.literal_eval(extractor_out)  # a printed list of str
    assert len(paths) == 2 and all(Path(p).is_absolute() and Path(p).is_relative_to(workdir / "out") for p in paths)
    assert (workdir / "sharegpt.parquet").exists() and (workdir / "ds").is_dir()
    assert re.fullmatch(r"torch\.Size\(\[8, \d+, 4, 64\]\)\n", loader_out), loader_out
