"""speculators' own EAGLE-3 trainer (0.9, in a venv of its own: ``tests/support/speculators_env.py``;
its CLI unchanged, run on the CPU through ``tests/support/speculators_cpu.py``) reads layertap data
through hs-connectors' backend ``layertap`` (``--hidden-states-backend layertap``): (a) an export,
(b) a run that the worker extracts while the trainer reads it. Each: the checkpoint's layer ids are
the extracted ones, every row is trained once, and wrong ``--target-layer-ids`` stop the trainer
before a step with both lists. Float8 states reach speculators decoded, within float8's bound.
Real Redis, the real tiny-qwen3 worker, speculators' real trainer."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import datasets
import pytest
import torch
from safetensors.torch import load_file

from layertap.protocol import keys
from layertap.protocol.schema import Job
from tests.integration.test_training_record import FLOAT32_ATOL, FP8_RELATIVE, FP8_SUBNORMAL
from tests.support.jobs import wait_for
from tests.support.processes import cli
from tests.support.reference import load, reference_states
from tests.support.speculators_env import speculators_argv, speculators_env, speculators_python

ROWS = 24
LAYERS = [1, 2, 4]  # the worker's default for the 4-layer tiny model: EAGLE-3's [2, L//2, L-3, L] clamped
TARGET_IDS = LAYERS[:-1]
WRONG_IDS = ["0", "3"]
TRAINER_TIMEOUT_S = 600
HANDED_OVER = re.compile(r"row (\d+): job (\S+) handed over")


def chats(prefix: str) -> list[dict]:
    return [{"id": f"{prefix}-{i}", "messages": [
        {"role": "user", "content": f"Question {i}: what is {i} plus {i}?"},
        {"role": "assistant", "content": f"It is {2 * i}. " * (1 + i % 4)}]} for i in range(ROWS)]


@pytest.fixture(scope="module")
def venv_python() -> Path:
    return speculators_python()


def layertap(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    done = subprocess.run(cli(*args), env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done


def trainer(save: Path, *args: str, model: Path, env: dict[str, str], log: Path) -> subprocess.Popen:
    """``speculators train`` (eagle3, one epoch, on the CPU) with the layertap backend; the backend's log to ``log``."""
    argv = speculators_argv(
        "train", "--verifier-name-or-path", str(model), "--speculator-type", "eagle3", "--draft-attn-impl", "sdpa",
        "--loss-implementation", "eager", "--hidden-states-dtype", "float32", "--epochs", "1",
        "--total-seq-len", "512", "--save-path", str(save), "--hidden-states-backend", "layertap", *args)
    return subprocess.Popen(argv, cwd=save.parent, env={**env, "TRAINER_LOG": str(log), "COLUMNS": "300"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finished(process: subprocess.Popen) -> tuple[int, str]:
    output, _ = process.communicate(timeout=TRAINER_TIMEOUT_S)
    return process.returncode, output


def checkpoint_layer_ids(save: Path) -> list[int]:
    return json.loads((save / "0" / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"]


def assert_refused_with_both_lists(code: int, output: str, save: Path) -> None:
    assert code != 0, output[-3000:]
    assert (f"LayerIdError: target layer ids differ: --target-layer-ids names [{', '.join(WRONG_IDS)}] but the "
            f"data's auxiliary layers are {TARGET_IDS}") in output, output[-3000:]
    assert not (save / "0").exists()  # stopped before a step: no checkpoint


@pytest.fixture(scope="module")
def export(workers, redis_server, storage_root, tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """A finished run of :data:`ROWS` chats on tiny-qwen3, exported for speculators; returns (folder, env)."""
    root = tmp_path_factory.mktemp("speculators-export")
    run = f"spec-export-{os.getpid()}"
    (root / "chats.jsonl").write_text("".join(json.dumps(chat) + "\n" for chat in chats("chat")))
    env = speculators_env(LAYERTAP_REDIS_URL=redis_server.url, LAYERTAP_STORAGE_ROOT=str(storage_root))
    layertap(env, "enqueue", "--model", "tiny-qwen3", "--run", run, "--file", str(root / "chats.jsonl"))
    layertap(env, "results", "--run", run, "--follow", "--timeout", "120")  # until every job has a result
    layertap(env, "export", "--run", run, "--format", "speculators", "--out", str(root / "ds"))
    return root / "ds", env


def test_trainer_reads_an_export(venv_python, export, tiny_models, tmp_path):
    folder, env = export
    locks = sorted((folder / "hidden_states").glob("*.lock"))
    assert len(locks) == ROWS
    save, log = tmp_path / "ckpt", tmp_path / "backend.log"
    code, output = finished(trainer(save, "--config", str(folder / "speculators.yaml"), "--num-workers", "0",
                                    model=tiny_models["qwen3"], env=env, log=log))
    assert code == 0, output[-4000:]

    assert checkpoint_layer_ids(save) == TARGET_IDS
    assert json.loads((folder / "layertap-export.json").read_text())["layers"] == LAYERS
    check = subprocess.run(cli("check-draft", "--config", str(save / "0"), "--export", str(folder)), env=env,
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stderr

    # every row once (train split, then validation), each the export's own row: its job, its file
    handed = [(int(row), job) for row, job in HANDED_OVER.findall(log.read_text())]
    job_ids = datasets.load_from_disk(str(folder))["job_id"]
    assert sorted(handed) == [(row, job_ids[row]) for row in range(ROWS)]
    # nothing of layertap's removed or unlocked: every file and its lock file are still there
    assert sorted((folder / "hidden_states").glob("*.lock")) == locks
    assert all(Path(str(lock).removesuffix(".lock")).exists() for lock in locks)


def test_wrong_target_layer_ids_stop_the_trainer_on_an_export(venv_python, export, tiny_models, tmp_path):
    folder, env = export
    save = tmp_path / "ckpt"
    code, output = finished(trainer(save, "--config", str(folder / "speculators.yaml"), "--target-layer-ids",
                                    *WRONG_IDS, "--num-workers", "0", model=tiny_models["qwen3"], env=env,
                                    log=tmp_path / "backend.log"))
    assert_refused_with_both_lists(code, output, save)


def test_trainer_reads_a_run_while_the_worker_extracts_it(venv_python, workers, redis_server, storage_root, client,
                                                          tiny_models, run_name, tmp_path):
    """Rows whose token ids are known first (a speculators data folder with a ``job_id`` column); their jobs
    go to the worker only once the trainer reads the run, so every file is written while it trains."""
    _, tokenizer = load(str(tiny_models["qwen3"]))
    token_ids = [tokenizer(tokenizer.apply_chat_template(chat["messages"], tokenize=False),
                           add_special_tokens=False)["input_ids"] for chat in chats("live")]
    job_ids = [f"row-{index}" for index in range(ROWS)]
    folder = tmp_path / "rows"
    datasets.Dataset.from_dict({"input_ids": token_ids, "loss_mask": [[1] * len(ids) for ids in token_ids],
                                "seq_len": [len(ids) for ids in token_ids], "job_id": job_ids},
                               ).with_format("torch").save_to_disk(str(folder))
    jobs = [{"job_id": job_id, "token_ids": ids, "loss_mask": [1] * len(ids)}
            for job_id, ids in zip(job_ids, token_ids, strict=True)]
    (tmp_path / "jobs.jsonl").write_text("".join(json.dumps(job) + "\n" for job in jobs))
    env = speculators_env(LAYERTAP_REDIS_URL=redis_server.url, LAYERTAP_STORAGE_ROOT=str(storage_root))
    common = ("--data-path", str(folder), "--layertap-run", run_name)

    # wrong ids: the trainer waits for the run's first file, then stops with both lists
    wrong_log = tmp_path / "wrong.log"
    wrong = trainer(tmp_path / "wrong", *common, "--target-layer-ids", *WRONG_IDS, "--num-workers", "0",
                    model=tiny_models["qwen3"], env=env, log=wrong_log)
    wait_for(lambda: "waiting for the first ok result" in text(wrong_log) or wrong.poll() is not None, 300,
             "the trainer to wait for the run")
    client.submit(Job(model="tiny-qwen3", run=run_name, **jobs[0]))  # one row's job; the run is not sealed
    assert_refused_with_both_lists(*finished(wrong), tmp_path / "wrong")

    # the trainer reads the run while the rest is extracted: each row handed over once, then its file removed
    log, save = tmp_path / "backend.log", tmp_path / "ckpt"
    live = trainer(save, *common, "--target-layer-ids", *map(str, TARGET_IDS), "--layertap-delete-after", "true",
                   "--on-missing", "raise", "--num-workers", "1", model=tiny_models["qwen3"], env=env, log=log)
    wait_for(lambda: "target layer ids" in text(log) or live.poll() is not None, 300, "the trainer to read the run")
    layertap(env, "enqueue", "--model", "tiny-qwen3", "--run", run_name, "--file", str(tmp_path / "jobs.jsonl"))
    code, output = finished(live)
    assert code == 0, output[-4000:]

    results = client.latest(run_name)
    assert sorted(results) == sorted(job_ids) and all(result.ok and result.layers == LAYERS
                                                       for result in results.values())
    assert checkpoint_layer_ids(save) == TARGET_IDS
    # every row handed over: recorded once by the group, its file then removed; a second read of any row
    # would have found no file and stopped the trainer (--on-missing raise)
    consumed = client.redis.hgetall(keys.run_consumed_hash(run_name, "speculators"))
    assert consumed == dict.fromkeys(job_ids, "ok")
    assert not [path for path in (storage_root / run_name).rglob("*") if path.is_file()]


def text(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def test_float8_states_reach_speculators_decoded(venv_python, workers, redis_server, storage_root, client,
                                                 tiny_models, run_name, tmp_path):
    """The backend hands over a float8 run's states decoded (float32), within float8's bound of plain
    transformers' states; hs-connectors' own fp8 backend reads the export's bfloat16 copy within that
    bound plus bfloat16's rounding."""
    env = speculators_env(LAYERTAP_REDIS_URL=redis_server.url, LAYERTAP_STORAGE_ROOT=str(storage_root))
    sent = layertap(env, "enqueue", "--model", "tiny-qwen3", "--run", run_name, "--dtype", "float8", "--prompt",
                    "a float8 prompt for the draft trainer")
    (job_id,) = sent.stdout.split()
    result = client.wait(run_name, [job_id], timeout=60)[job_id]
    assert result.ok and result.dtype == "float8_e4m3"
    layertap(env, "export", "--run", run_name, "--format", "speculators", "--out", str(tmp_path / "ds"))
    read = subprocess.run([str(venv_python), "-c", FP8_READ, str(tmp_path / "ds"), run_name, str(tmp_path / "read")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert read.returncode == 0, read.stderr[-3000:]
    got = load_file(str(tmp_path / "read"))

    exact = reference_states(str(tiny_models["qwen3"]), got["token_ids"].tolist(), LAYERS)
    scale = load_file(result.path)["hidden_states_scale"]  # [T, n_layers]: one scale per token per layer
    float8_bound = FP8_RELATIVE * exact.abs() + FP8_SUBNORMAL * scale[..., None] + 2 * FLOAT32_ATOL
    assert got["run"].dtype == torch.float32
    assert torch.all((got["run"] - exact).abs() <= float8_bound)
    assert torch.equal(got["export"], got["run"].to(torch.bfloat16))  # the export's copy: those values, rounded
    assert torch.equal(got["hs_connectors_fp8"], got["export"])
    rounded_bound = float8_bound + 2.0**-8 * got["run"].abs()
    assert torch.all((got["hs_connectors_fp8"].float() - exact).abs() <= rounded_bound)


#: Run by the venv's python: ``argv`` = export folder, run, output file. Reads row 0 through the layertap
#: backend from the run (the job's own float8 file) and from the export (its bfloat16 copy), and through
#: hs-connectors' own fp8 backend from the export.
FP8_READ = """
import argparse, sys
from pathlib import Path
from safetensors.torch import save_file
from hs_connectors import FP8Transfer, HiddenStatesBackend

folder, run, out = sys.argv[1:]
backend = HiddenStatesBackend.registry["layertap"]
def read(run):
    args = argparse.Namespace(layertap_run=run, layertap_group="fp8-check", layertap_delete_after=False,
                              layertap_redis_url=None, target_layer_ids=[1, 2], speculator_type="eagle3")
    return backend.from_train_args(args, folder).get_cached(0)
from_run, from_export = read(run), read(None)
fp8 = FP8Transfer(Path(folder) / "hidden_states").get_cached(0)
save_file({"run": from_run["hidden_states"], "export": from_export["hidden_states"],
           "hs_connectors_fp8": fp8["hidden_states"], "token_ids": from_run["token_ids"]}, out)
"""
