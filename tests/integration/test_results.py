"""Results reach the stream, the pub/sub channel, Celery's backend and the CLI; readers
wait for writers through the lock file."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import threading
import time

from layertap.producer.files.reader import cleanup_hidden_states, load_hidden_states
from layertap.protocol import keys
from tests.support.processes import cli


def test_results_on_stream_pubsub_backend_and_cli(workers, client, run_name, redis_server):
    received = []
    listening = threading.Event()

    def listen():
        pubsub = client.redis.pubsub(ignore_subscribe_messages=True)
        pubsub.subscribe(keys.results_stream(run_name))
        listening.set()
        deadline = time.monotonic() + 60
        while len(received) < 2 and time.monotonic() < deadline:
            message = pubsub.get_message(timeout=1.0)
            if message:
                received.append(json.loads(message["data"]))
        pubsub.close()

    thread = threading.Thread(target=listen)
    thread.start()
    listening.wait(10)
    jobs = [client.submit({"prompt": text}, model="tiny-qwen3", run=run_name, metadata=f"row-{i}")
            for i, text in enumerate(["one two three", "four five six"])]
    results = client.wait(run_name, [j.job_id for j in jobs], timeout=60)
    thread.join(60)
    assert sorted(r["job_id"] for r in received) == sorted(j.job_id for j in jobs)
    for job in jobs:
        result = results[job.job_id]
        assert result.ok and os.path.exists(result.path)
        assert result.metadata == f"row-{jobs.index(job)}"
        assert result.worker == "test-qwen3@localhost" and result.model == "tiny-qwen3"
        assert result.timings.compute is not None and result.timings.write is not None
        assert result.timings.queued is not None
    # Celery's result backend is off by default: the stream is a result's only copy
    assert not client.celery.conf.result_backend
    assert list(client.redis.scan_iter(match="celery-task-meta-*")) == []
    entries = client.redis.xrange(keys.results_stream(run_name))
    assert {json.loads(fields["result"])["job_id"] for _, fields in entries} == {j.job_id for j in jobs}

    env = {**os.environ, "LAYERTAP_REDIS_URL": redis_server.url}
    out = subprocess.run(cli("results", "--run", run_name, "--json"), env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    printed = [json.loads(line) for line in out.stdout.splitlines()]
    assert {p["job_id"] for p in printed} == {j.job_id for j in jobs}
    assert all(p["status"] == "ok" for p in printed)


def test_same_job_twice_has_same_id_and_file(workers, client, run_name):
    first = client.submit({"prompt": "same prompt twice"}, model="tiny-qwen3", run=run_name)
    second = client.submit({"prompt": "same prompt twice"}, model="tiny-qwen3", run=run_name)
    assert first.job_id == second.job_id
    result = client.wait(run_name, [first.job_id], timeout=60)[first.job_id]
    assert result.ok


def test_reader_blocks_while_writer_holds_lock(workers, client, run_name):
    job = client.submit({"prompt": "lock me"}, model="tiny-qwen3", run=run_name)
    path = client.wait(run_name, [job.job_id], timeout=60)[job.job_id].path
    events = []
    fd = os.open(f"{path}.lock", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)  # as a writer holds it
    reader = threading.Thread(target=lambda: (load_hidden_states(path), events.append("loaded")))
    reader.start()
    reader.join(0.5)
    assert reader.is_alive() and events == []  # still waiting on the lock
    events.append("released")
    os.close(fd)
    reader.join(10)
    assert events == ["released", "loaded"]


def test_cleanup_then_load_without_lock_file(workers, client, run_name):
    job = client.submit({"prompt": "clean me up"}, model="tiny-qwen3", run=run_name)
    path = client.wait(run_name, [job.job_id], timeout=60)[job.job_id].path
    cleanup_hidden_states(path, keep_data=True)
    assert not os.path.exists(f"{path}.lock")
    assert load_hidden_states(path)["hidden_states"].shape[1] == 3  # the worker default for 4 layers: [1, 2, 4]
    cleanup_hidden_states(path)
    assert not os.path.exists(path)
