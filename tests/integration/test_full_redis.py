"""A Redis at ``maxmemory`` (issue 22, item 10): what frees memory works there (the retention
sweep, ``layertap run trim``, ``layertap run delete``), ``layertap enqueue`` waits it out and
says so, and a worker's connections stay bounded. Real Redis put at ``maxmemory`` (``noeviction``)."""

from __future__ import annotations

import os
import subprocess
import time

import pytest
import redis

from layertap.producer.client import runs
from layertap.protocol import keys
from layertap.protocol.naming import job_path
from layertap.protocol.schema import Result, Status
from layertap.worker.queue.publisher import ResultPublisher
from layertap.worker.queue.retention import RetentionSweep
from tests.support.processes import cli, run_through_full_redis

ENTRIES = 200


def publish_ok_results(client: redis.Redis, run: str, root: str) -> None:
    publisher = ResultPublisher(client)
    results = [Result(job_id=f"job-{i:04d}", run=run, status=Status.ok, path=str(job_path(root, run, f"job-{i:04d}")),
                      num_tokens=100, layers=[1, 2], model="tiny-qwen3", worker="w@host", metadata="m" * 2000)
               for i in range(ENTRIES)]
    for start in range(0, ENTRIES, 50):
        publisher.publish_many(results[start:start + 50], None, None)
    client.hset(keys.run_submitted_hash(run), mapping={result.job_id: 1.0 for result in results})


def keys_bytes(client: redis.Redis) -> int:
    """What every key holds, by ``MEMORY USAGE`` (exact: ``SAMPLES 0``). INFO's ``used_memory_dataset``
    is no measure of it: it is ``used_memory`` less an overhead that moves with client buffers by
    tens of kB between two reads, and it counted 740 kB with 14 kB in keys."""
    return sum(client.memory_usage(key, samples=0) for key in client.scan_iter())


def layertap(url: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(cli(*args), env={**os.environ, "LAYERTAP_REDIS_URL": url}, capture_output=True,
                          text=True, timeout=120)


def test_trim_sweep_and_delete_free_memory_at_maxmemory(private_redis, tmp_path):
    raw = redis.Redis.from_url(private_redis.url, decode_responses=True)
    for run in ("swept", "trimmed", "deleted"):
        publish_ok_results(raw, run, str(tmp_path))
    used = int(raw.info("memory")["used_memory"])
    data = keys_bytes(raw)
    raw.config_set("maxmemory", used // 2)  # far past the limit: every denyoom write is refused
    with pytest.raises(redis.exceptions.OutOfMemoryError):
        raw.set("probe", "x")

    trimmed = layertap(private_redis.url, "run", "trim", "trimmed")
    assert trimmed.returncode == 0 and f"dropped {ENTRIES} result stream entries" in trimmed.stdout, trimmed.stderr
    sweep = RetentionSweep(raw, "sweeper@host", retention_s=0.001, interval=1.0)
    assert sweep.sweep() == 2 * ENTRIES  # the other two runs' entries
    for run in ("swept", "trimmed"):
        assert raw.xlen(keys.results_stream(run)) == 0
        assert set(runs.ok_files(raw, run)) == {f"job-{i:04d}" for i in range(ENTRIES)}  # the ledger holds
    deleted = layertap(private_redis.url, "run", "delete", "deleted", "--yes")
    assert deleted.returncode == 0, deleted.stderr
    assert not runs.exists(raw, "deleted")
    assert keys_bytes(raw) < data / 20  # the streams' bytes are freed
    raw.close()


def test_enqueue_waits_out_a_full_redis(private_redis):
    raw = redis.Redis.from_url(private_redis.url, decode_responses=True)
    enqueue = run_through_full_redis(cli("enqueue", "--model", "tiny-nobody-full", "--run", "full", "--prompt", "a",
                                         "--prompt", "b"), {**os.environ, "LAYERTAP_REDIS_URL": private_redis.url}, raw)
    err = enqueue.stderr
    assert enqueue.returncode == 0, err
    assert "Redis refuses writes" in err and "trying again" in err
    assert raw.llen(keys.model_queue("tiny-nobody-full")) == 1 and raw.hlen(keys.run_submitted_hash("full")) == 2
    raw.close()


def test_a_worker_keeps_its_connections_bounded_at_maxmemory(make_worker, private_client):
    """A worker's Celery consumer meets ``OOM`` on every write (its acks, its events, its fetch
    bookkeeping) for a while: it opens no connection per failure, and holds no more once freed."""
    worker = make_worker("bounded@localhost")
    jobs = [private_client.submit({"prompt": f"before the limit {i}"}, model="tiny-qwen3", run="bounded")
            for i in range(3)]
    private_client.wait("bounded", [job.job_id for job in jobs], timeout=60)
    raw = private_client.redis
    before = len(raw.client_list())
    raw.config_set("maxmemory", 1)
    try:
        counts = []
        for _ in range(20):
            time.sleep(1)
            counts.append(len(raw.client_list()))
    finally:
        raw.config_set("maxmemory", 0)
    late = private_client.submit({"prompt": "after the limit"}, model="tiny-qwen3", run="bounded")
    assert private_client.wait("bounded", [late.job_id], timeout=60)[late.job_id].ok
    after = len(raw.client_list())
    assert worker.process.poll() is None
    assert max(counts) <= before + 5 and after <= before + 5, (before, counts, after)
