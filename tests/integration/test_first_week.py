"""The first week (issue 40, items 1, 2 and 6), through the CLI with real Redis and real workers:
a second enqueue with other options under the rows' own ids is refused, naming both settings and
the flags, and --replace extracts what is asked; `results` lists the jobs trimmed from the
stream; the files' size is printed before sending and refused past a small tmpfs's free space."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from layertap.producer.client import runs
from layertap.producer.files.reader import load_hidden_states
from layertap.producer.ingest.survey import describe_bytes
from layertap.protocol import keys
from layertap.protocol.fileformat import file_bytes
from tests.support.jobs import wait_for
from tests.support.processes import cli

MODEL = "tiny-qwen3"


def layertap(url: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(cli(*args), env={**os.environ, "LAYERTAP_REDIS_URL": url}, capture_output=True, text=True,
                          timeout=180)


def test_other_options_under_row_ids_are_refused_kept_or_replaced(workers, redis_server, client, run_name, tmp_path):
    rows = tmp_path / "chats.jsonl"
    ids = [f"c{i}" for i in range(3)]
    rows.write_text("".join(json.dumps({"id": job_id, "messages": [
        {"role": "user", "content": f"question {job_id}"}, {"role": "assistant", "content": "an answer"}]}) + "\n"
        for job_id in ids))
    url = redis_server.url

    def enqueue(*flags: str) -> subprocess.CompletedProcess:
        return layertap(url, "enqueue", "--model", MODEL, "--run", run_name, "--file", str(rows), *flags)

    assert enqueue().returncode == 0
    first = client.wait(run_name, ids, timeout=120, raise_on_error=True)
    again = enqueue()
    assert again.returncode == 0 and "0 job(s) sent, 3 already ok" in again.stderr, again.stderr
    before = (client.redis.hgetall(keys.run_submitted_hash(run_name)), client.redis.xlen(keys.results_stream(run_name)))

    there = first["c0"]
    for flags, named in ((["--layers", "1,3"], f"layers {there.layers} there, [1, 3] asked"),
                         (["--dtype", "bf16"], f"dtype {there.dtype} there, bfloat16 asked"),
                         (["--topk", "2"], "topk none there, 2 asked"),
                         (["--final-hidden-states"], "final_hidden_states off there, on asked"),
                         (["--loss-on", "last"], "loss_on all there, last asked")):
        refused = enqueue(*flags)
        assert refused.returncode == 1 and refused.stdout == "", refused.stderr
        assert named in refused.stderr and "--keep-existing" in refused.stderr and "--replace" in refused.stderr
        assert "3 row(s) ask for other content" in refused.stderr and "already ok" not in refused.stderr
    assert (client.redis.hgetall(keys.run_submitted_hash(run_name)),
            client.redis.xlen(keys.results_stream(run_name))) == before  # nothing was sent

    kept = enqueue("--layers", "1,3", "--keep-existing")
    assert kept.returncode == 0 and "0 job(s) sent, 0 already ok, 3 kept with other content" in kept.stderr

    replaced = enqueue("--layers", "1,3", "--replace")
    assert replaced.returncode == 0 and sorted(replaced.stdout.split()) == ids, replaced.stderr
    assert "3 job(s) sent (3 replacing files of other content)" in replaced.stderr
    wait_for(lambda: all(getattr(client.latest(run_name).get(job_id), "layers", None) == [1, 3] for job_id in ids),
             120, "every job extracted again with layers 1,3")
    latest = client.latest(run_name)
    assert all(result.ok and result.path == first[job_id].path for job_id, result in latest.items())
    assert load_hidden_states(latest["c0"].path)["hidden_states"].shape[1] == 2
    settled = enqueue("--layers", "1,3")
    assert settled.returncode == 0 and "0 job(s) sent, 3 already ok" in settled.stderr, settled.stderr


def test_results_lists_the_jobs_trimmed_from_the_stream(workers, redis_server, client, run_name):
    early = [client.submit({"prompt": f"early job {i}"}, model=MODEL, run=run_name).job_id for i in range(2)]
    client.wait(run_name, early, timeout=120, raise_on_error=True)
    assert runs.trim(client.redis, run_name) == 2  # what the retention does to entries past retention.results_s
    late = client.submit({"prompt": "a job after the trim"}, model=MODEL, run=run_name).job_id
    client.wait(run_name, [late], timeout=120, raise_on_error=True)

    listed = layertap(redis_server.url, "results", "--run", run_name)
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert sorted(line.split()[1] for line in lines) == sorted(early + [late])
    assert all(line.startswith("ok ") and line.endswith(".safetensors") for line in lines)
    assert "2 of these results come from the run's ledger" in listed.stderr
    as_json = [json.loads(line) for line in layertap(redis_server.url, "results", "--run", run_name,
                                                     "--json").stdout.splitlines()]
    assert {(row["job_id"], row["status"]) for row in as_json} == {(job_id, "ok") for job_id in early + [late]}
    watched = layertap(redis_server.url, "watch", "--run", run_name)  # the rate of the one result the stream kept
    assert watched.returncode == 0, watched.stderr
    printed = " ".join(watched.stdout.split())  # rich wraps at the terminal's width
    assert re.search(rf"run {run_name} complete: 3 ok, 0 failed, 3 jobs, [\d,]+ tokens/s over the results "
                     "retention kept", printed), printed


@pytest.fixture
def small_storage(tmp_path: Path):
    """A 1 MiB tmpfs where ``make_worker``'s workers write (asked for before ``make_worker``: its
    workers stop before it is unmounted)."""
    folder = tmp_path / "files"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", str(folder)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    yield folder
    subprocess.run(["umount", "-l", str(folder)], check=True)


def test_enqueue_prints_the_size_and_refuses_past_the_free_space(small_storage, make_worker, private_client,
                                                                  private_redis, run_name, tmp_path):
    make_worker("small@localhost", env={"LAYERTAP_WORKER__STORAGE_RETRY_S": "0.01"})
    client, url = private_client, private_redis.url
    small, big = tmp_path / "small.jsonl", tmp_path / "big.jsonl"
    small.write_text(json.dumps({"job_id": "small", "token_ids": [10 + i % 500 for i in range(50)]}) + "\n")
    big.write_text(json.dumps({"job_id": "big", "token_ids": [10 + i % 500 for i in range(2000)]}) + "\n")

    def enqueue(rows: Path, *flags: str) -> subprocess.CompletedProcess:
        return layertap(url, "enqueue", "--model", MODEL, "--run", run_name, "--file", str(rows), "--format", "jobs",
                        *flags)

    sent = enqueue(small)
    assert sent.returncode == 0, sent.stderr
    written = client.wait(run_name, ["small"], timeout=120, raise_on_error=True)["small"]
    size = os.path.getsize(written.path)
    expected = file_bytes(50, len(written.layers), 64, written.dtype)  # hidden 64: the tiny model's
    assert size <= expected <= size + 4096  # the estimate, against a real file
    assert f"1 job(s) to send, 50 tokens: about {describe_bytes(expected)} of files; " in sent.stderr
    assert f"free in {small_storage.resolve()}" in sent.stderr

    refused = enqueue(big)
    assert refused.returncode == 1 and refused.stdout == "", refused.stderr
    expected = file_bytes(2000, len(written.layers), 64, written.dtype)
    assert f"1 job(s) to send, 2,000 tokens: about {describe_bytes(expected)} of files" in refused.stderr
    assert "more than the" in refused.stderr and "nothing was sent" in refused.stderr and "--yes" in refused.stderr
    assert client.redis.hkeys(keys.run_submitted_hash(run_name)) == ["small"]

    anyway = enqueue(big, "--yes")
    assert anyway.returncode == 0 and anyway.stdout.split() == ["big"], anyway.stderr
    failed = client.wait(run_name, ["big"], timeout=120)["big"]
    assert not failed.ok and "storage fault" in (failed.error or "")  # the estimate was right: it did not fit
