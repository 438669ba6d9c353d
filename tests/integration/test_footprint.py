"""A bounded Redis footprint (issue 12, item 2): a run's results stream is trimmed (``layertap
run trim``, the workers' retention sweep) while a real worker runs, and manifest, the resume
of ``enqueue``, ``runs`` counts and ``Client.wait`` stay exact from the compact ledger (status
and submitted hashes, storage roots) and the files; ``run delete`` leaves no key of the run."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from pathlib import Path

from layertap.producer.client import runs
from layertap.protocol import keys
from layertap.protocol.naming import job_path
from layertap.protocol.schema import Result, Status
from layertap.settings import Settings
from layertap.worker.queue.publisher import ResultPublisher
from layertap.worker.queue.retention import RetentionSweep
from tests.support.processes import cli

RUN = "kept"
FIRST, SECOND = 30, 20


def layertap(redis_url: str, *args: str, storage_root: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "LAYERTAP_REDIS_URL": redis_url,
           **({"LAYERTAP_STORAGE_ROOT": str(storage_root)} if storage_root else {})}
    done = subprocess.run(cli(*args), env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done


def manifest_rows(redis_url: str, out, storage_root: Path) -> dict[str, dict]:
    layertap(redis_url, "manifest", "--run", RUN, "--out", str(out), storage_root=storage_root)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == len({row["job_id"] for row in rows})
    return {row["job_id"]: row for row in rows}


def test_trim_while_a_worker_runs_keeps_manifest_resume_counts_and_wait_exact(make_worker, private_client,
                                                                              private_redis, tmp_path):
    make_worker("trimmer@localhost")
    url, client = private_redis.url, private_client
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"row number {i}", "metadata": f"row-{i}"}) + "\n"
                            for i in range(FIRST)))
    first = layertap(url, "enqueue", "--model", "tiny-qwen3", "--run", RUN, "--file", str(rows)).stdout.split()
    assert len(first) == FIRST
    client.wait(RUN, first, timeout=120)

    # more jobs while `run trim` runs again and again: the worker keeps publishing into the run
    second: list[str] = []

    def feed() -> None:
        for i in range(SECOND):
            second.append(client.submit({"prompt": f"later {i}", "metadata": f"later-{i}"}, model="tiny-qwen3",
                                        run=RUN).job_id)
            time.sleep(0.1)

    feeder = threading.Thread(target=feed)
    feeder.start()
    dropped = 0
    while feeder.is_alive():
        dropped += runs.trim(client.redis, RUN)
    feeder.join()
    assert dropped >= FIRST
    assert "dropped" in layertap(url, "run", "trim", RUN).stdout
    waited = client.wait(RUN, second, timeout=120)  # some of them trimmed already: read from the ledger
    assert all(result.ok and os.path.exists(result.path) for result in waited.values())
    mixed = manifest_rows(url, tmp_path / "mixed.jsonl", make_worker.storage)

    layertap(url, "run", "trim", RUN)
    assert client.redis.xlen(keys.results_stream(RUN)) == 0
    assert client.redis.hlen(keys.run_result_ids_hash(RUN)) == 0
    trimmed = manifest_rows(url, tmp_path / "trimmed.jsonl", make_worker.storage)
    assert trimmed == mixed  # the same rows, metadata included (from the files' headers)
    expected = {**{job_id: f"row-{i}" for i, job_id in enumerate(first)},
                **{job_id: f"later-{i}" for i, job_id in enumerate(second)}}
    assert {job_id: row["metadata"] for job_id, row in trimmed.items()} == expected
    storage = make_worker.storage.resolve()
    assert all(row["path"] == str(job_path(storage, RUN, job_id)) for job_id, row in trimmed.items())

    # Client.wait answers every trimmed job from the ledger and the file
    results = client.wait(RUN, list(expected), timeout=30)
    assert {job_id: (result.status, result.path, result.metadata, result.num_tokens)
            for job_id, result in results.items()} == {
        job_id: (Status.ok, row["path"], row["metadata"], row["num_tokens"]) for job_id, row in trimmed.items()}

    queue = keys.model_queue("tiny-qwen3")
    assert client.redis.llen(keys.inflight_list(queue)) == 0  # every fetched message was recorded, none copied
    assert list(client.redis.scan_iter(match="layertap:pending:payload*")) == []

    latest = client.latest(RUN)
    assert {job_id: (result.path, result.metadata) for job_id, result in latest.items()} == {
        job_id: (row["path"], row["metadata"]) for job_id, row in trimmed.items()}

    # resume: the same file again sends nothing, and the counts stay exact
    again = subprocess.run(cli("enqueue", "--model", "tiny-qwen3", "--run", RUN, "--file", str(rows)),
                           env={**os.environ, "LAYERTAP_REDIS_URL": url}, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and again.stdout.split() == [], again.stderr
    assert f"0 job(s) sent, {FIRST} already ok" in again.stderr
    listed = layertap(url, "runs").stdout
    total = FIRST + SECOND
    held = runs.redis_bytes(client.redis, RUN)
    assert f"{RUN}  {total}/{total} finished  complete  {held:,} B in Redis" in listed
    assert 0 < held <= 300 * total  # the ledger, after retention

    deleted = layertap(url, "run", "delete", RUN, "--files", "--yes", "--storage", str(storage))
    assert f"and {total} file(s)" in deleted.stdout
    assert not any(os.path.exists(row["path"]) for row in trimmed.values())
    assert [key for key in client.redis.scan_iter(match=f"*{RUN}*")] == []


def ok_result(run: str, index: int, root) -> Result:
    job_id = f"job-{index:03d}"
    return Result(job_id=job_id, run=run, status=Status.ok, path=str(job_path(root, run, job_id)), model="m")


def test_retention_sweep_drops_old_entries_but_none_a_consumer_group_still_needs(private_redis, tmp_path):
    settings = Settings(redis_url=private_redis.url)
    from layertap.transport.redis_conn import connect

    client = connect(settings)
    stream = keys.results_stream("old")
    publisher = ResultPublisher(client)
    client.hset(keys.run_submitted_hash("old"), mapping={f"job-{i:03d}": 0 for i in range(6)})
    for index in range(6):
        publisher.publish(ok_result("old", index, tmp_path))
    client.xgroup_create(stream, "train", id="0")
    taken = client.xreadgroup("train", "t1", {stream: ">"}, count=3)[0][1]
    client.xack(stream, "train", taken[0][0])  # the group acknowledged one and holds two
    time.sleep(0.3)
    client.delete(keys.RETENTION_LOCK)
    sweep = RetentionSweep(client, "sweeper@host", retention_s=0.2, interval=1.0)
    assert sweep.sweep() == 1
    assert client.xlen(stream) == 5 and client.xrange(stream)[0][0] == taken[1][0]  # the held two stay
    assert sweep.sweep() == 0  # the lock: one sweep per interval
    client.xack(stream, "train", *[entry_id for entry_id, _ in taken[1:]])
    client.xreadgroup("train", "t1", {stream: ">"}, count=10)
    client.delete(keys.RETENTION_LOCK)
    assert sweep.sweep() == 2  # the last three are read but not acknowledged: they stay
    client.xack(stream, "train", *[entry_id for entry_id, _ in client.xrange(stream)])
    client.delete(keys.RETENTION_LOCK)
    assert sweep.sweep() == 3 and client.xlen(stream) == 0
    assert client.hlen(keys.run_result_ids_hash("old")) == 0
    assert client.smembers(keys.run_roots_set("old")) == {str(tmp_path).encode()}
    assert client.hlen(keys.run_status_hash("old")) == 6
    client.close()
