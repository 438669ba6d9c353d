"""A new user's first day (issue 26): one naming rule on both sides, one check default with a
"did you mean", the ``runs`` group, enqueue's habits (flags checked once, ``--file -``, empty
input, Ctrl-C), ``status`` and ``watch`` figures, ``inspect`` on a file another tool wrote.

One worker, started as a user would: ``layertap worker --model ./models/blocky`` (no --name)
from a working folder; its model waits while a gate file exists, so a job can be caught running.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from layertap.producer.client.client import Client, NoWorker
from layertap.producer.dev.redis_server import RedisServer
from layertap.protocol import keys
from layertap.settings import Settings
from tests.support.blocking import hang_env
from tests.support.processes import cli

NODE = "firstday@localhost"
SERVED = "blocky"  # the basename of ./models/blocky: what the worker serves without --name


@dataclass
class Day:
    redis_url: str
    work: Path  # the user's working folder: ./models/blocky, ./files
    gate: Path  # while it exists, the worker's forward pass waits

    def layertap(self, *args: str, stdin: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
        env = {**os.environ, "LAYERTAP_REDIS_URL": self.redis_url, "COLUMNS": "200"}
        return subprocess.run(cli(*args), cwd=self.work, env=env, input=stdin, capture_output=True, text=True,
                              timeout=timeout)

    def client(self) -> Client:
        return Client(Settings(redis_url=self.redis_url))


@pytest.fixture(scope="module")
def day(blocking_model, tmp_path_factory):
    work = tmp_path_factory.mktemp("first-day")
    shutil.copytree(blocking_model, work / "models" / SERVED)
    gate = work / "gate"
    with RedisServer(data_dir=work / "redis") as server:
        env = {**os.environ, "LAYERTAP_REDIS_URL": server.url, "LAYERTAP_STORAGE_ROOT": str(work / "files"),
               **hang_env(gate, hang_timeout=600)}
        with open(work / "worker.log", "wb") as log:
            worker = subprocess.Popen(cli("worker", "--model", f"./models/{SERVED}", "--device", "cpu",
                                          "--node-name", NODE), cwd=work, env=env, stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True)
        try:
            with Client(Settings(redis_url=server.url)) as client:
                deadline = time.monotonic() + 180
                while NODE not in client.workers():
                    assert worker.poll() is None and time.monotonic() < deadline, (work / "worker.log").read_text()
                    time.sleep(0.1)
            yield Day(server.url, work, gate)
        finally:
            gate.unlink(missing_ok=True)
            os.killpg(worker.pid, signal.SIGTERM)
            worker.wait(60)


def test_the_same_model_string_meets_on_both_sides(day):
    """`worker --model ./models/blocky` and `enqueue --model ./models/blocky` (and the Python API
    given the folder) use one queue."""
    sent = day.layertap("enqueue", "--model", f"./models/{SERVED}", "--run", "same-string", "--prompt", "hello")
    assert sent.returncode == 0, sent.stderr
    (cli_job,) = sent.stdout.split()
    with day.client() as client:
        job = client.submit({"prompt": "hello from python"}, model=str(day.work / "models" / SERVED), run="same-string")
        assert job.model == SERVED
        results = client.wait("same-string", [cli_job, job.job_id], timeout=120, raise_on_error=True)
    assert {result.model for result in results.values()} == {SERVED}


def test_a_near_miss_is_refused_with_did_you_mean_by_both_doors(day):
    refused = day.layertap("enqueue", "--model", "BLOCKY", "--run", "typo", "--prompt", "hello")
    assert refused.returncode == 1
    assert refused.stderr.strip() == ("error: no live worker serves model 'BLOCKY' (served: blocky; did you mean "
                                      "'blocky'?); use --no-check to enqueue anyway")
    with day.client() as client:
        with pytest.raises(NoWorker, match=r"did you mean 'blocky'\?"):
            client.submit({"prompt": "hello"}, model="blockyy", run="typo")  # the default check, as the CLI's
        assert client.redis.llen(keys.model_queue("blockyy")) == 0
        assert not client.redis.exists(keys.run_submitted_hash("typo"))


def test_runs_group_watch_rate_and_delete_removes_emptied_folders(day):
    run = "lifecycle"
    sent = day.layertap("enqueue", "--model", SERVED, "--run", run, "--file", "-",
                        stdin='{"prompt": "one two three"}\n{"prompt": "four five six seven"}\n')
    assert sent.returncode == 0 and len(sent.stdout.split()) == 2, sent.stderr
    watched = day.layertap("watch", "--run", run)  # ends once the run is complete
    assert watched.returncode == 0, watched.stderr
    rate = re.search(r"run lifecycle complete: 2 ok, 0 failed, 2 jobs, ([\d,]+) tokens/s overall", watched.stdout)
    assert rate and int(rate.group(1).replace(",", "")) > 0, watched.stdout

    for form in (("runs",), ("runs", "list")):
        listed = day.layertap(*form)
        assert listed.returncode == 0 and f"{run}  2/2 finished  complete" in listed.stdout, listed.stderr
    for group in ("runs", "run"):  # `run` is the older form, kept as an alias
        shown = day.layertap(group, "show", run)
        assert shown.returncode == 0, shown.stderr
        assert shown.stdout.startswith(f"run {run}: complete; 2 submitted, 2 ok, 0 failed, 0 cancelled, 0 waiting; ")
    assert "show" in day.layertap("runs", "--help").stdout
    assert not re.search(r"^\s+run\s", day.layertap("--help").stdout, re.M)  # the alias is hidden

    run_folder = day.work / "files" / run
    assert len(list(run_folder.rglob("*.safetensors"))) == 2
    deleted = day.layertap("runs", "delete", run, "--files", "--yes", "--storage", str(day.work / "files"))
    assert deleted.returncode == 0 and "2 file(s)" in deleted.stdout, deleted.stderr
    assert not run_folder.exists()  # its fan-out folders went with their files
    assert (day.work / "files").is_dir()  # the storage root stays


def test_enqueue_checks_flags_once_before_reading_any_row(day):
    (day.work / "rows.jsonl").write_text("".join(f'{{"prompt": "row {i}"}}\n' for i in range(50)))
    bad = day.layertap("enqueue", "--model", SERVED, "--run", "../escape", "--file", "rows.jsonl")
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [
        "error: --run '../escape' is not allowed: use 1-128 characters from A-Z a-z 0-9 . _ -, starting with a "
        "letter or digit, without '..'"]
    bad_dtype = day.layertap("enqueue", "--model", SERVED, "--dtype", "float7", "--file", "rows.jsonl")
    assert bad_dtype.returncode == 2 and len(bad_dtype.stderr.strip().splitlines()) == 1, bad_dtype.stderr
    assert bad_dtype.stderr.startswith("error: invalid flags: dtype")


def test_empty_input_warns_and_fails(day):
    empty = day.layertap("enqueue", "--model", SERVED, "--run", "empty", "--file", "-", stdin="")
    assert empty.returncode == 1
    assert "warning: standard input has no rows: nothing was sent" in empty.stderr
    (day.work / "empty.jsonl").write_text("\n")
    empty_file = day.layertap("enqueue", "--model", SERVED, "--run", "empty", "--file", "empty.jsonl")
    assert empty_file.returncode == 1 and "warning: empty.jsonl has no rows" in empty_file.stderr


def test_ctrl_c_says_what_was_sent_and_how_to_resume(day):
    """Interrupted while it reads stdin: exit 130, the count sent (all of them in Redis), how to resume."""
    run, model = "interrupted", "nobody-serves-this"
    env = {**os.environ, "LAYERTAP_REDIS_URL": day.redis_url}
    enqueue = subprocess.Popen(cli("enqueue", "--model", model, "--no-check", "--run", run, "--file", "-"),
                               cwd=day.work, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        assert enqueue.stdin and enqueue.stdout
        enqueue.stdin.write("".join(f'{{"prompt": "row {i}"}}\n' for i in range(300)))  # one batch is 256
        enqueue.stdin.flush()
        assert enqueue.stdout.readline().strip()  # a first job id: the first batch is going out
        enqueue.send_signal(signal.SIGINT)  # stdin is still open: it waits for more rows
        out, err = enqueue.communicate(timeout=120)
    finally:
        if enqueue.poll() is None:
            enqueue.kill()
    assert enqueue.returncode == 130, err
    found = re.search(rf"interrupted: run {run}: (\d+) job\(s\) sent, 0 already ok\. Run the same command again to "
                      "resume", err)
    assert found, err
    with day.client() as client:
        # each one counted is sent
        assert client.redis.hlen(keys.run_submitted_hash(run)) >= int(found.group(1)) >= 1, err
    assert day.layertap("runs", "delete", run, "--force", "--yes").returncode == 0


def test_status_shows_running_jobs_and_no_live_workers(day, tmp_path):
    day.gate.touch()
    try:
        with day.client() as client:
            job = client.submit({"prompt": "caught running"}, model=SERVED, run="running")
            deadline = time.monotonic() + 120
            while not re.search(rf"│ {SERVED}\s+│ 0\s+│ 1\s+│", (status := day.layertap("status")).stdout):
                assert status.returncode == 0 and time.monotonic() < deadline, status.stdout + status.stderr
                time.sleep(0.2)
            assert "no live workers" not in status.stdout
    finally:
        day.gate.unlink()
    with day.client() as client:
        client.wait("running", [job.job_id], timeout=120, raise_on_error=True)
    with RedisServer(data_dir=tmp_path / "redis") as empty:
        alone = subprocess.run(cli("status"), env={**os.environ, "LAYERTAP_REDIS_URL": empty.url},
                               capture_output=True, text=True, timeout=60)
    assert alone.returncode == 0 and "no live workers" in alone.stdout, alone.stderr


def test_inspect_reads_a_vllm_file_and_suggests_no_verify_for_another_tools(day):
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((5, 2, 8)).astype(np.float32)
    path = day.work / "vllm-request.safetensors"  # as vLLM's connector writes: two tensors, no metadata
    save_file({"hidden_states": hidden, "token_ids": np.arange(5, dtype=np.int64)}, str(path))
    checked = day.layertap("inspect", str(path))  # its dtypes and shapes checked: it has no checksums
    assert checked.returncode == 0, checked.stderr
    assert "mean token L2 norm" in checked.stdout
    first_layer = next(line for line in checked.stdout.splitlines() if re.match(r"│ 0\s+│", line))
    expected = np.linalg.norm(hidden[:, 0, :], axis=-1).mean()
    assert f"{expected:.4g}" in first_layer

    other = day.work / "other-tool.safetensors"  # metadata of its own: neither a layertap nor a vLLM file
    save_file({"hidden_states": hidden, "token_ids": np.arange(5, dtype=np.int64)}, str(other),
              metadata={"format": "pt"})
    refused = day.layertap("inspect", str(other))
    assert refused.returncode == 1
    assert "not a layertap file" in refused.stderr and "layertap inspect --no-verify" in refused.stderr
    unchecked = day.layertap("inspect", str(other), "--no-verify")
    assert unchecked.returncode == 0 and f"{expected:.4g}" in unchecked.stdout, unchecked.stderr
