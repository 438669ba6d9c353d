"""The documentation's examples run as written: every ``python`` and ``bash`` block of README.md
and docs/*.md, in the order it appears, one working folder per document, against a real Redis
and a real worker. The worker serves a tiny random qwen3 with 36 layers saved in a local Hugging
Face cache as ``Qwen/Qwen3-8B`` (read offline), so the examples' model names and layer ids are
valid unchanged; its storage root is the folder's ``layertap-data``, the default the examples
assume. The inputs the examples name (``sharegpt.jsonl``, ShareGPT's JSON array, a saved
UltraChat ``DatasetDict``) are written into the folder first.

A block that cannot run here says so on its fence, visibly, with the reason:
```` ```bash not-run: needs GPUs ````. :func:`test_block_not_run` lists each of them as a skip
with its reason (``pytest -ra`` prints them)."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.processes import WorkerProcess

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
HUB_ID = "Qwen/Qwen3-8B"
FENCE = re.compile(r"^```(python|bash)([^\n]*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
NOT_RUN = "not-run:"
# A block whose own comment says it runs beside the next one (a producer beside its trainer)
# starts in the background; the test waits for it after the next block.
BESIDE_NEXT = "# beside the trainer"
# What the test does before a block that reads something the text says was made earlier (not in a block).
BEFORE = {"sharegpt-v1.manifest.parquet":
          "layertap watch --run sharegpt-v1 && layertap manifest --run sharegpt-v1 --out sharegpt-v1.manifest.parquet"}


@dataclass(frozen=True)
class Block:
    document: str  # path relative to the repository
    line: str  # of the opening fence
    language: str
    code: str
    not_run: str | None  # the fence's reason, for a block that cannot run here

    @property
    def where(self) -> str:
        return f"{self.document}:{self.line}"


def blocks() -> list[Block]:
    """Every python and bash block of the documents, in order."""
    found = []
    for document in DOCUMENTS:
        text = document.read_text()
        for match in FENCE.finditer(text):
            where = f"{document.relative_to(ROOT)}:{text.count(chr(10), 0, match.start()) + 1}"
            info = match.group(2).strip()
            reason = info.removeprefix(NOT_RUN).strip() if info.startswith(NOT_RUN) else None
            if info and not reason:
                raise ValueError(f"{where}: fence info {info!r}: only `{NOT_RUN} <reason>` is understood")
            found.append(Block(*where.rsplit(":", 1), match.group(1), match.group(3), reason))
    return found


BLOCKS = blocks()
RUN_DOCUMENTS = sorted({block.document for block in BLOCKS if block.not_run is None})


@pytest.mark.parametrize("block", [block for block in BLOCKS if block.not_run is not None],
                         ids=lambda block: block.where)
def test_block_not_run(block: Block):
    """Lists the blocks left out, with the reason their fence gives (``blocks`` refuses a fence without one)."""
    pytest.skip(f"{block.where} not run: {block.not_run}")


@pytest.fixture(scope="session")
def hub_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``HF_HOME`` holding a tiny 36-layer model as the snapshot of ``Qwen/Qwen3-8B`` (per session,
    not per module: under pytest-xdist the documents then run in separate processes, at once)."""
    from layertap.worker.model.tiny_model import make_tiny_model

    home = tmp_path_factory.mktemp("hf-home")
    repo = home / "hub" / f"models--{HUB_ID.replace('/', '--')}"
    revision = "0" * 40
    make_tiny_model(repo / "snapshots" / revision, "qwen3", num_layers=36)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return home


def sharegpt_rows(count: int) -> list[dict]:
    return [{"id": f"chat-{i}", "conversations": [
        {"from": "human", "value": f"Question number {i}: what is {i} plus {i}?"},
        {"from": "gpt", "value": f"It is {2 * i}."}]} for i in range(count)]


def write_inputs(workdir: Path) -> None:
    """The input files the examples name."""
    from datasets import Dataset, DatasetDict

    rows = sharegpt_rows(10)
    (workdir / "sharegpt.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (workdir / "ShareGPT_V3_unfiltered_cleaned_split.json").write_text(json.dumps(rows))
    chats = [{"prompt_id": f"u{i}", "prompt": f"Say {i}.", "messages": [
        {"role": "user", "content": f"Say {i}."}, {"role": "assistant", "content": f"{i}."}]} for i in range(6)]
    DatasetDict({"train_sft": Dataset.from_list(chats), "test_sft": Dataset.from_list(chats[:2])}).save_to_disk(
        str(workdir / "ultrachat_200k"))


def run_blocks(document: str, workdir: Path, env: dict[str, str]) -> dict[Block, str]:
    """Run the document's blocks in order in ``workdir``; their stdout by block."""
    outputs: dict[Block, str] = {}
    beside: tuple[Block, subprocess.Popen] | None = None
    for block in [block for block in BLOCKS if block.document == document and block.not_run is None]:
        for needle, command in BEFORE.items():
            if needle in block.code:
                done = subprocess.run(["bash", "-e", "-c", command], cwd=workdir, env=env, capture_output=True,
                                      text=True, timeout=450)
                assert done.returncode == 0, (f"before {block.where}: {command}\n"
                                              f"{done.stdout[-2000:]}{done.stderr[-3000:]}")
        command = [sys.executable, "-c", block.code] if block.language == "python" else ["bash", "-e", "-c", block.code]
        process = subprocess.Popen(command, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True)
        if BESIDE_NEXT in block.code:
            beside = (block, process)
            continue
        for ran, started in [(block, process), *([beside] if beside else [])]:
            stdout, stderr = started.communicate(timeout=450)
            assert started.returncode == 0, f"{ran.where}\n{ran.code}\n{stdout[-2000:]}\n{stderr[-3000:]}"
            outputs[ran] = stdout
        beside = None
    assert beside is None, f"{beside[0].where} runs beside a next block, and there is none"
    return outputs


def output_of(outputs: dict[Block, str], needle: str) -> str:
    """The stdout of the one block that ran holding ``needle``."""
    found = [out for block, out in outputs.items() if needle in block.code]
    assert len(found) == 1, f"{len(found)} blocks ran holding {needle!r}"
    return found[0]


def check_readme(outputs: dict[Block, str], workdir: Path) -> None:
    walkthrough = output_of(outputs, "make-tiny-model tiny")
    assert "run walkthrough complete: 2 ok, 0 failed" in walkthrough, walkthrough
    walkthrough_read = output_of(outputs, 'client.latest("walkthrough")')
    assert re.fullmatch(r"(ok torch\.Size\(\[\d+, 3, 64\]\)\n){2}", walkthrough_read), walkthrough_read
    client = output_of(outputs, "client.submit({\"prompt\": \"Hello\"}")
    assert re.fullmatch(r"torch\.Size\(\[\d+, 3, 64\]\)\n", client), client
    assert (workdir / "sharegpt.parquet").exists() and (workdir / "ds").is_dir()
    loader = output_of(outputs, 'HiddenStatesDataset("sharegpt.parquet")')
    assert re.fullmatch(r"torch\.Size\(\[8, \d+, 4, 64\]\)\n", loader), loader


def check_client(outputs: dict[Block, str], workdir: Path) -> None:
    assert output_of(outputs, "client.bundler(") == "200 jobs done\n"
    paths = ast.literal_eval(output_of(outputs, "Extractor("))  # a printed list of str
    assert len(paths) == 2 and all(Path(p).is_absolute() and Path(p).is_relative_to(workdir / "out") for p in paths)


def check_operations(outputs: dict[Block, str], workdir: Path) -> None:
    assert "readme@localhost: OK" in output_of(outputs, "inspect ping"), outputs


def check_training_data(outputs: dict[Block, str], workdir: Path) -> None:
    assert (workdir / "sharegpt-v1.manifest.parquet").exists()
    # The streaming trainer deleted every file it trained on: none is left of its run.
    streamed = workdir / "layertap-data" / "sharegpt"
    assert streamed.is_dir() and [path for path in streamed.rglob("*") if path.is_file()] == []


CHECKS = {"README.md": check_readme, "docs/client.md": check_client, "docs/operations.md": check_operations,
          "docs/training-data.md": check_training_data}


def test_every_document_that_runs_has_its_outputs_checked():
    assert RUN_DOCUMENTS == sorted(CHECKS), RUN_DOCUMENTS


@pytest.mark.parametrize("document", RUN_DOCUMENTS)
def test_examples_run_as_written(document, hub_cache, private_redis, tmp_path):
    workdir = tmp_path / "work"
    workdir.mkdir()
    write_inputs(workdir)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("LAYERTAP_")},
           "LAYERTAP_REDIS_URL": private_redis.url, "HF_HOME": str(hub_cache), "HF_HUB_OFFLINE": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    worker = WorkerProcess(HUB_ID, HUB_ID, private_redis.url, workdir / "layertap-data",  # type: ignore[arg-type]
                           node="readme@localhost", env={"HF_HOME": str(hub_cache), "HF_HUB_OFFLINE": "1"},
                           log_path=tmp_path / "worker.log")
    try:
        worker.start()
        try:
            outputs = run_blocks(document, workdir, env)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\nworker log:\n{worker.log_text()[-2000:]}") from None
    finally:
        worker.stop()
    CHECKS[document](outputs, workdir)

