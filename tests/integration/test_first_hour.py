"""What a new user meets first: startup refusals, the default served name, absolute result
paths, configuration warnings, one dtype vocabulary, and the CLI's habits (help, --version,
--dry-run, --limit, asking before requeueing everything)."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from layertap.producer.client.client import Client
from layertap.settings import Settings
from tests.support.processes import cli

UNREACHABLE = "redis://127.0.0.1:1/0"


def layertap(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None,
             stdin: str | None = None) -> subprocess.CompletedProcess:
    base = {key: value for key, value in os.environ.items() if not key.startswith("LAYERTAP_")}
    return subprocess.run(cli(*args), env={**base, **(env or {})}, cwd=cwd, input=stdin, capture_output=True,
                          text=True, timeout=120)


def test_worker_refuses_layers_the_model_lacks(tiny_models, redis_server):
    """A reachable Redis: a worker checks it before it loads its model."""
    out = layertap("worker", "--model", str(tiny_models["qwen3"]), "--layers", "2,18", "--device", "cpu",
                   env={"LAYERTAP_REDIS_URL": redis_server.url})
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1] == (
        "error: --layers 2,18: layer id 18 is out of range for a model with 4 decoder layers: valid ids are -5..4")


def test_worker_refuses_a_missing_folder_without_asking_a_hub(tmp_path):
    """A local path that is not there is refused at once: no hub round trip (it was 9 s of retries).
    The hub endpoint is a real listener on loopback that counts the connections it is offered."""
    with socket.socket() as hub:
        hub.bind(("127.0.0.1", 0))
        hub.listen(8)
        hub.setblocking(False)
        out = layertap("worker", "--model", str(tmp_path / "no" / "model"),
                       env={"LAYERTAP_REDIS_URL": UNREACHABLE, "HF_ENDPOINT": f"http://127.0.0.1:{hub.getsockname()[1]}"})
        with pytest.raises(BlockingIOError):
            hub.accept()  # nobody knocked
    assert out.returncode == 1
    assert out.stderr.strip() == (f"error: --model {tmp_path / 'no' / 'model'}: no such folder, "
                                  "and not a hub id (org/name)")


def test_default_name_and_absolute_paths_from_a_relative_root(tiny_models, redis_server, tmp_path):
    """No --name: the folder's name is served (and logged); a relative storage root gives absolute paths."""
    log = tmp_path / "worker.log"
    env = {**os.environ, "LAYERTAP_REDIS_URL": redis_server.url, "LAYERTAP_STORAGE_ROOT": "relative-data"}
    with open(log, "wb") as handle:
        worker = subprocess.Popen(cli("worker", "--model", str(tiny_models["llama"]), "--device", "cpu",
                                      "--node-name", "noname@localhost"), cwd=tmp_path, env=env, stdout=handle,
                                  stderr=subprocess.STDOUT, start_new_session=True)
    try:
        with Client(Settings(redis_url=redis_server.url)) as client:
            deadline = time.monotonic() + 120
            while "noname@localhost" not in client.workers():
                assert worker.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.1)
            assert client.workers()["noname@localhost"]["model"] == "llama"  # the folder's basename
            job = client.submit({"prompt": "where am I written?"}, model="llama", run="relative-root", check=True)
            result = client.wait("relative-root", [job.job_id], timeout=60, raise_on_error=True)[job.job_id]
    finally:
        worker.terminate()
        worker.wait(60)
    assert os.path.isabs(result.path) and Path(result.path).is_relative_to(tmp_path / "relative-data")
    assert Path(result.path).exists()
    assert "jobs use --model llama" in log.read_text()


def test_extractor_relative_out_dir_gives_absolute_paths(tiny_models, tmp_path, monkeypatch):
    from layertap.worker import Extractor

    monkeypatch.chdir(tmp_path)
    with Extractor(str(tiny_models["qwen3"]), layers=[1, -1], device="cpu") as extractor:
        (result,) = extractor.extract(["a notebook prompt"], "out/")
    assert result.ok and Path(result.path).is_absolute() and Path(result.path).is_relative_to(tmp_path / "out")
    os.chdir("/")  # another working folder: the path still names the file
    assert Path(result.path).exists()


def test_configuration_traps(tmp_path):
    (tmp_path / "layertap.toml").write_text('storage_rot = "x"\n[worker]\ntoken_budgt = 5\n')
    out = layertap("status", cwd=tmp_path, env={"LAYERTAP_REDIS_URL": UNREACHABLE, "LAYERTAP_WORKER__LAYERS": "2,-1",
                                                "LAYERTAP_REDIS_ULR": "redis://typo"})
    assert "LAYERTAP_WORKER__LAYERS" not in out.stderr  # the --layers syntax is accepted
    lines = out.stderr.strip().splitlines()
    assert lines[:3] == [
        "warning: LAYERTAP_REDIS_ULR is not a layertap setting (did you mean LAYERTAP_REDIS_URL?); it is ignored",
        "warning: layertap.toml: storage_rot is not a layertap setting (did you mean storage_root?); it is ignored",
        "warning: layertap.toml: worker.token_budgt is not a layertap setting (did you mean worker.token_budget?); "
        "it is ignored"]
    assert lines[3].startswith("error: cannot reach Redis")
    bad = layertap("status", env={"LAYERTAP_REDIS_URL": UNREACHABLE, "LAYERTAP_WORKER__TOKEN_BUDGET": "lots"})
    assert bad.returncode == 1 and bad.stderr.startswith(
        "error: invalid setting worker.token_budget (LAYERTAP_WORKER__TOKEN_BUDGET, layertap.toml or its flag): ")
    assert Settings(worker={"layers": "2,-1", "dtype": "bf16"}).worker.model_dump(include={"layers", "dtype"}) == {
        "layers": [2, -1], "dtype": "bfloat16"}


def test_enqueue_dry_run_limit_dtype_alias_and_format_note(tmp_path):
    rows = tmp_path / "mixed.jsonl"
    rows.write_text('{"prompt": "one"}\n{"prompt": "two"}\n{"conversations": [{"from": "human", "value": "x"}]}\n'
                    '{"prompt": "four"}\n{"prompt": "five"}\n')
    env = {"LAYERTAP_REDIS_URL": UNREACHABLE}  # a dry run does not contact Redis
    short = layertap("enqueue", "--model", "m", "--file", str(rows), "--dry-run", "--limit", "2", "--dtype", "bf16",
                     env=env)
    assert short.returncode == 0, short.stderr
    long_name = layertap("enqueue", "--model", "m", "--file", str(rows), "--dry-run", "--limit", "2",
                         "--dtype", "bfloat16", env=env)
    assert short.stdout.split() == long_name.stdout.split() and len(short.stdout.split()) == 2  # one vocabulary
    assert "dry run, nothing sent): 2 job(s) would be sent" in short.stderr
    mixed = layertap("enqueue", "--model", "m", "--file", str(rows), "--dry-run", env=env)
    assert mixed.returncode == 2 and len(mixed.stdout.split()) == 4
    assert (f"error: {rows} line 3: conversations: is not a job field (format jobs, detected from line 1; "
            "use --format to choose another)") in mixed.stderr


def test_bad_chat_row_names_the_files_column(tmp_path):
    rows = tmp_path / "sharegpt.jsonl"
    rows.write_text('{"conversations": [{"from": "human", "value": "fine"}]}\n'
                    '{"conversations": [{"from": "human", "value": "bell \\u0007"}]}\n')
    out = layertap("enqueue", "--model", "m", "--file", str(rows), "--dry-run", env={"LAYERTAP_REDIS_URL": UNREACHABLE})
    assert out.returncode == 2
    assert (f"error: {rows} line 2: conversations turn 0: message text contains the control character '\\x07' "
            "(format sharegpt, detected from line 1; use --format to choose another)") in out.stderr


def test_hub_dataset_id_that_cannot_be_loaded_is_one_line(tmp_path):
    out = layertap("enqueue", "--model", "m", "--file", "layertap-test/no-such-dataset", "--dry-run", cwd=tmp_path,
                   env={"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")})
    assert out.returncode == 1
    assert out.stderr.startswith("error: layertap-test/no-such-dataset: no such file, and datasets could not load "
                                 "it as a hub dataset")
    assert len(out.stderr.strip().splitlines()) == 1


def test_help_is_whole_at_80_columns_and_version():
    env = {"COLUMNS": "80", "TERMINAL_WIDTH": "80"}
    for command in (["enqueue"], ["worker"], ["bench"], ["results"], ["dlq", "requeue"], ["run", "delete"]):
        text = layertap(*command, "--help", env=env).stdout
        assert "…" not in text and "<bool>" not in text, text
    enqueue_help = layertap("enqueue", "--help", env=env).stdout
    assert "--final-hidden-states" in enqueue_help and "enqueue.max_inflight" in enqueue_help
    assert "[default: default]" in enqueue_help
    version = layertap("--version")
    from layertap.producer import __version__

    assert version.stdout.strip() == f"layertap {__version__}"


def test_dlq_requeue_of_everything_asks(redis_server):
    out = layertap("dlq", "requeue", env={"LAYERTAP_REDIS_URL": redis_server.url}, stdin="n\n")
    assert out.returncode == 1 and "Requeue ALL dead letters?" in out.stdout
    assert "requeued" not in out.stdout


@pytest.mark.parametrize("folder", ["plain", "hub-cache"])
def test_default_served_name(tmp_path, folder):
    from layertap.protocol.naming import served_model_name as default_served_name

    path = tmp_path / "my-model" if folder == "plain" else tmp_path / "models--Qwen--Qwen3-8B" / "snapshots" / "abc"
    path.mkdir(parents=True)
    assert default_served_name(str(path)) == ("my-model" if folder == "plain" else "Qwen/Qwen3-8B")
    assert default_served_name("Qwen/Qwen3-8B") == "Qwen/Qwen3-8B"
