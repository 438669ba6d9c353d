"""speculators' own EAGLE-3 trainer (0.9, in a venv of its own: ``tests/support/speculators_env.py``;
its CLI unchanged, run on the CPU through ``tests/support/speculators_cpu.py``) reads layertap data
through hs-connectors' backend ``layertap`` (``--hidden-states-backend layertap``): (a) an export,
(b) a run that the worker extracts while the trainer reads it. Each: the checkpoint's layer ids are
the extracted ones, every row is trained once, and wrong ``--target-layer-ids`` stop the trainer
before a step with both lists. Float8 states reach speculators decoded, within float8's bound. In
object storage the backend's transfer (in this venv: hs-connectors without speculators) reads and
removes only the jobs' own objects under its roots. speculators' own data folder of files from runs
whose certificates disagree in their states is refused before the first step, naming the field.
Real Redis, the real tiny-qwen3 worker, speculators' real trainer, a real S3-protocol server."""

from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import shutil
import subprocess
from pathlib import Path

import datasets
import pytest
import torch
from safetensors.torch import load_file

from layertap.producer.dev.s3_server import S3Server
from layertap.producer.files.certify import certify
from layertap.producer.trainers.hs_backend import LayertapBackend
from layertap.protocol import keys
from layertap.protocol.schema import Job
from layertap.storage.registry import storage_for
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
    """``speculators train`` (eagle3, one epoch, on the CPU, rows read in its own process: the transfer's pickling
    for DataLoader workers is tested below) with the layertap backend; the backend's log to ``log``."""
    argv = speculators_argv(
        "train", "--verifier-name-or-path", str(model), "--speculator-type", "eagle3", "--draft-attn-impl", "sdpa",
        "--loss-implementation", "eager", "--hidden-states-dtype", "float32", "--epochs", "1", "--num-workers", "0",
        "--total-seq-len", "512", "--save-path", str(save), "--hidden-states-backend", "layertap", *args)
    return subprocess.Popen(argv, cwd=save.parent, env={**env, "TRAINER_LOG": str(log), "COLUMNS": "300"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finished(process: subprocess.Popen) -> tuple[int, str]:
    output, _ = process.communicate(timeout=TRAINER_TIMEOUT_S)
    return process.returncode, output


def text(path: Path) -> str:
    return path.read_text() if path.exists() else ""


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
    code, output = finished(trainer(save, "--config", str(folder / "speculators.yaml"), model=tiny_models["qwen3"],
                                    env=env, log=log))
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
                                    *WRONG_IDS, model=tiny_models["qwen3"], env=env, log=tmp_path / "backend.log"))
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
    wrong = trainer(tmp_path / "wrong", *common, "--target-layer-ids", *WRONG_IDS, model=tiny_models["qwen3"],
                    env=env, log=wrong_log)
    wait_for(lambda: "waiting for the first ok result" in text(wrong_log) or wrong.poll() is not None, 300,
             "the trainer to wait for the run")
    client.submit(Job(model="tiny-qwen3", run=run_name, **jobs[0]))  # one row's job; the run is not sealed
    assert_refused_with_both_lists(*finished(wrong), tmp_path / "wrong")

    # the trainer reads the run while the rest is extracted: each row handed over once, then its file removed
    log, save = tmp_path / "backend.log", tmp_path / "ckpt"
    live = trainer(save, *common, "--target-layer-ids", *map(str, TARGET_IDS), "--layertap-delete-after", "true",
                   "--on-missing", "raise", model=tiny_models["qwen3"], env=env, log=log)
    wait_for(lambda: "target layer ids" in text(log) or live.poll() is not None, 300, "the trainer to read the run")
    layertap(env, "enqueue", "--model", "tiny-qwen3", "--run", run_name, "--file", str(tmp_path / "jobs.jsonl"))
    code, output = finished(live)
    assert code == 0, output[-4000:]

    results = client.latest(run_name)
    assert sorted(results) == sorted(job_ids) and all(result.ok and result.layers == LAYERS
                                                       for result in results.values())
    assert checkpoint_layer_ids(save) == TARGET_IDS
    # every row handed over once (the backend's log), recorded by the group, its file then removed: a second
    # read of any row would have found no file and stopped the trainer (--on-missing raise)
    handed = [(int(row), job) for row, job in HANDED_OVER.findall(log.read_text())]
    assert sorted(handed) == [(row, job_ids[row]) for row in range(ROWS)]
    consumed = client.redis.hgetall(keys.run_consumed_hash(run_name, "speculators"))
    assert consumed == dict.fromkeys(job_ids, "ok")
    assert not [path for path in (storage_root / run_name).rglob("*") if path.is_file()]


def backend_args(run: str | None, *, delete_after: bool = False) -> argparse.Namespace:
    """What speculators' trainer gives the backend (its flattened config), for this data's target ids."""
    return argparse.Namespace(layertap_run=run, layertap_group="speculators", layertap_delete_after=delete_after,
                              layertap_redis_url=None, target_layer_ids=TARGET_IDS, speculator_type="eagle3")


def test_float8_states_reach_speculators_decoded(venv_python, workers, redis_server, storage_root, client,
                                                 tiny_models, run_name, tmp_path):
    """The backend hands over a float8 run's states decoded (float32), within float8's bound of plain
    transformers' states, and the export's bfloat16 copy of them; hs-connectors' own fp8 backend reads that
    copy too. The transfers are made in a fresh process of the speculators venv from the trainer's flags,
    as speculators makes them."""
    env = speculators_env(LAYERTAP_REDIS_URL=redis_server.url, LAYERTAP_STORAGE_ROOT=str(storage_root))
    sent = layertap(env, "enqueue", "--model", "tiny-qwen3", "--run", run_name, "--dtype", "float8", "--prompt",
                    "a float8 prompt for the draft trainer")
    (job_id,) = sent.stdout.split()
    result = client.wait(run_name, [job_id], timeout=60)[job_id]
    assert result.ok and result.dtype == "float8_e4m3"
    folder = tmp_path / "ds"
    layertap(env, "export", "--run", run_name, "--format", "speculators", "--out", str(folder))
    read = subprocess.run([str(venv_python), "-c", FP8_READ, run_name, str(folder), str(tmp_path / "read")], env=env,
                          capture_output=True, text=True, timeout=300)
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


def test_files_of_runs_whose_certificates_disagree_stop_the_trainer(workers, client, storage_root, run_name, tmp_path):
    """speculators' own data folder holding ``layertap serve``-style files (each its run's, moved out of the run's
    folder as generate-offline-data moves them; copied here) of two certified runs whose files store the same
    prompt's states in other dtypes: the backend refuses it before the first step, naming the field; the files
    of one run are read."""
    runs = [f"{run_name}-a", f"{run_name}-b"]
    folder = tmp_path / "data" / "hidden_states"
    folder.mkdir(parents=True)
    for index, (run, dtype) in enumerate(zip(runs, ("float32", "bfloat16"), strict=True)):
        job = client.submit({"prompt": "one prompt, two runs"}, model="tiny-qwen3", run=run, dtype=dtype)
        result = client.wait(run, [job.job_id], timeout=60)[job.job_id]
        assert result.ok, result.error
        certify(client.redis, run, storage_for(str(storage_root)))
        shutil.copy(result.path, folder / f"hs_{index}.safetensors")
    with pytest.raises(ValueError, match=re.escape(f"runs {runs[0]} and {runs[1]} differ in dtype ('float32' vs "
                                                   "'bfloat16'): their states do not mix")):
        LayertapBackend.from_train_args(backend_args(None), str(tmp_path / "data"))

    (folder / "hs_1.safetensors").unlink()
    transfer = LayertapBackend.from_train_args(backend_args(None), str(tmp_path / "data"))
    assert transfer.get_cached(0)["hidden_states"].dtype == torch.float32 and transfer.get_cached(1) is None


def test_the_backend_reads_and_removes_only_its_own_objects_in_s3(make_worker, private_client, private_redis,
                                                                  tiny_models, run_name, tmp_path, monkeypatch):
    """A run written to ``s3://``: the transfer (pickled, as speculators' DataLoader workers get it) hands over
    each row's states from its object, equal to plain transformers', and with delete_after removes that object;
    a ``layertap serve``-style answer naming the job's object is read and then removed, and the same object
    under another prefix (not the reader's root) is neither read nor removed."""
    import s3fs

    prompts = ["an object per job", "read from the bucket", "and removed once handed over"]
    job_ids = [f"row-{index}" for index in range(len(prompts))]
    with S3Server() as s3:
        s3.make_bucket("layertap")
        root, options = f"s3://layertap/spec-{run_name[-12:]}", s3.storage_options
        env = {"LAYERTAP_REDIS_URL": private_redis.url, "LAYERTAP_STORAGE_ROOT": root,
               "LAYERTAP_STORAGE_OPTIONS": json.dumps(options)}
        make_worker("s3@localhost", env=env)
        jobs = [private_client.submit({"prompt": text, "job_id": job_id}, model="tiny-qwen3", run=run_name)
                for text, job_id in zip(prompts, job_ids, strict=True)]
        results = private_client.wait(run_name, [job.job_id for job in jobs], timeout=120)
        paths = [results[job_id].path for job_id in job_ids]
        assert all(path.startswith(f"{root}/{run_name}/") for path in paths), paths
        _, tokenizer = load(str(tiny_models["qwen3"]))
        token_ids = [tokenizer(text)["input_ids"] for text in prompts]
        datasets.Dataset.from_dict({"input_ids": token_ids, "loss_mask": [[1] * len(ids) for ids in token_ids],
                                    "seq_len": [len(ids) for ids in token_ids], "job_id": job_ids},
                                   ).with_format("torch").save_to_disk(str(tmp_path / "rows"))
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        # torch's DataLoader hands the transfer to its worker processes by pickling it (in the trainer's own
        # processes, nothing on any wire): it must survive that
        transfer = pickle.loads(pickle.dumps(LayertapBackend.from_train_args(backend_args(run_name, delete_after=True),
                                                                             str(tmp_path / "rows"))))
        fs = s3fs.S3FileSystem(skip_instance_cache=True, **options)

        for row in (0, 1):
            states = transfer.get_cached(row)
            assert states["token_ids"].tolist() == token_ids[row]
            expected = reference_states(str(tiny_models["qwen3"]), token_ids[row], LAYERS)
            torch.testing.assert_close(states["hidden_states"].float(), expected, atol=FLOAT32_ATOL, rtol=1e-5)
            assert not fs.exists(paths[row])  # handed over, then removed
        consumed = private_client.redis.hgetall(keys.run_consumed_hash(run_name, "speculators"))
        assert consumed == {"row-0": "ok", "row-1": "ok"}

        elsewhere = paths[2].replace(f"{root}/", "s3://layertap/elsewhere/")
        fs.copy(paths[2], elsewhere)
        with pytest.raises(ValueError, match="not the own file of a layertap run's job under this trainer's"):
            transfer.get_generated({"hidden_states_path": elsewhere})
        transfer.delete(elsewhere)
        assert fs.exists(elsewhere)  # not under the reader's storage root: left
        generated = transfer.get_generated({"hidden_states_path": paths[2]})
        assert generated["token_ids"].tolist() == token_ids[2]
        transfer.delete(paths[2])
        assert not fs.exists(paths[2])


#: Run by the venv's python: ``argv`` = run, export folder, output file. Makes the layertap backend's transfers of
#: the run and of the export from the trainer's flags, reads row 0 through each (the run's float8 file, the
#: export's bfloat16 copy), and through hs-connectors' own fp8 backend from the export.
FP8_READ = """
import argparse, sys
from pathlib import Path

from hs_connectors import FP8Transfer
from safetensors.torch import save_file

from layertap.producer.trainers.hs_backend import LayertapBackend

def transfer(run):
    args = argparse.Namespace(layertap_run=run, layertap_group="speculators", layertap_delete_after=False,
                              layertap_redis_url=None, target_layer_ids=[1, 2], speculator_type="eagle3")
    return LayertapBackend.from_train_args(args, sys.argv[2])

from_run, from_export = transfer(sys.argv[1]).get_cached(0), transfer(None).get_cached(0)
fp8 = FP8Transfer(Path(sys.argv[2]) / "hidden_states").get_cached(0)
save_file({"run": from_run["hidden_states"], "export": from_export["hidden_states"],
           "hs_connectors_fp8": fp8["hidden_states"], "token_ids": from_run["token_ids"]}, sys.argv[3])
"""
