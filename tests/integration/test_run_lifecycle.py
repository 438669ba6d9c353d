"""A run's lifecycle: ``layertap runs``, ``run cancel`` (wins against the queue and the
reconciler: every job gets one ``cancelled`` result, none runs, none is sent again) and
``run delete``; ``results`` and ``manifest`` of a run that does not exist; ``results --follow``
stops when the run is complete; ``Client.submit`` warns or refuses without a worker."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from producer.client.client import Client, JobFailed, NoWorker, NoWorkerWarning
from producer.client.runs import RunCancelled
from producer.dev.redis_server import RedisServer
from producer.protocol import keys
from producer.protocol.schema import ErrorType
from producer.settings import Settings
from tests.support.processes import WorkerProcess, cli

ORPHAN_TIMEOUT = 2.0


@pytest.fixture
def private_redis(tmp_path):
    with RedisServer(data_dir=tmp_path / "redis") as server:
        yield server


def layertap(redis_url: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "LAYERTAP_REDIS_URL": redis_url}
    return subprocess.run(cli(*args), env=env, capture_output=True, text=True, timeout=60)


def test_cancel_wins_against_queue_and_reconciler(private_redis, tiny_models, tmp_path):
    storage = tmp_path / "files"
    with Client(Settings(redis_url=private_redis.url)) as client:
        warned = layertap(private_redis.url, "enqueue", "--model", "tiny-qwen3", "--run", "early", "--prompt", "x")
        assert warned.returncode == 0 and ("warning: no live worker serves model 'tiny-qwen3'; its jobs wait in the "
                                           "queue until one does") in warned.stderr
        client.redis.delete(keys.model_queue("tiny-qwen3"), keys.PENDING_HASH,
                            keys.run_submitted_hash("early"))  # (not part of this test's run)
        with pytest.warns(NoWorkerWarning, match="no live worker serves model 'tiny-qwen3'"):
            jobs = [client.submit({"prompt": f"doomed {i}"}, model="tiny-qwen3", run="doomed") for i in range(3)]
        with pytest.raises(NoWorker):
            Client(Settings(redis_url=private_redis.url)).submit({"prompt": "x"}, model="tiny-qwen3", check=True)
        queue = keys.model_queue("tiny-qwen3")
        client.redis.rpop(queue)  # the oldest message is lost (as between kombu's pop and its unacked record)
        assert client.redis.llen(queue) == 2

        cancelled = layertap(private_redis.url, "run", "cancel", "doomed")
        assert cancelled.returncode == 0, cancelled.stderr
        assert "3 job(s) without a result" in cancelled.stdout
        with pytest.raises(RunCancelled):
            Client(Settings(redis_url=private_redis.url)).submit({"prompt": "more"}, model="tiny-qwen3", run="doomed")

        worker = WorkerProcess(tiny_models["qwen3"], "tiny-qwen3", private_redis.url, storage, node="canceller@localhost",
                               env={"LAYERTAP_ORPHAN_TIMEOUT": str(ORPHAN_TIMEOUT)}, log_path=tmp_path / "w.log")
        try:
            worker.start()
            # the two queued jobs are answered by the worker, the lost one by the reconciler
            results = client.wait("doomed", [job.job_id for job in jobs], timeout=60)
            with pytest.raises(JobFailed, match="3 of 3 job"):
                client.wait("doomed", [job.job_id for job in jobs], timeout=5, raise_on_error=True)
        finally:
            worker.stop()
        assert {result.error_type for result in results.values()} == {ErrorType.cancelled}
        assert client.redis.xlen(keys.results_stream("doomed")) == 3  # exactly one result each
        assert client.redis.get(keys.RECOVERED_COUNTER) is None  # nothing was sent again
        assert client.redis.hlen(keys.PENDING_HASH) == 0
        assert not (storage / "doomed").exists()  # nothing ran
        assert "ended with an error result, cancelled" in worker.log_text()

        listed = layertap(private_redis.url, "runs")
        assert "doomed  3/3 finished  cancelled" in listed.stdout
        deleted = layertap(private_redis.url, "run", "delete", "doomed", "--yes")
        assert deleted.returncode == 0, deleted.stderr
        assert [key for key in client.redis.scan_iter(match="layertap:*doomed*")] == []
        assert "0 run(s)" in layertap(private_redis.url, "runs").stdout


def test_delete_refuses_unfinished_run_and_removes_files(workers, redis_server, client, run_name):
    job = client.submit({"prompt": "delete my file"}, model="tiny-qwen3", run=run_name)
    follow = layertap(redis_server.url, "results", "--run", run_name, "--follow")  # stops once complete
    assert follow.returncode == 0 and follow.stdout.startswith(f"ok     {job.job_id}"), follow.stderr
    client.submit(job)  # again: a second (cached) entry on the stream for the same job
    deadline = time.monotonic() + 30
    while client.redis.xlen(keys.results_stream(run_name)) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert len(layertap(redis_server.url, "results", "--run", run_name).stdout.splitlines()) == 1  # collapsed
    assert len(layertap(redis_server.url, "results", "--run", run_name, "--every-entry").stdout.splitlines()) == 2
    path = client.latest(run_name)[job.job_id].path
    assert os.path.isabs(path) and os.path.exists(path)
    deleted = layertap(redis_server.url, "run", "delete", run_name, "--files", "--yes")
    assert deleted.returncode == 0 and "1 file(s)" in deleted.stdout, deleted.stderr
    assert not os.path.exists(path)

    unserved = f"{run_name}-unserved"
    with pytest.warns(NoWorkerWarning):
        client.submit({"prompt": "nobody serves me"}, model="tiny-nobody-lifecycle", run=unserved,
                      check=False)  # (others are live: the default would refuse)
    with pytest.raises(subprocess.TimeoutExpired) as watching:  # watch waits for the run to complete
        subprocess.run(cli("watch", "--run", unserved), env={**os.environ, "LAYERTAP_REDIS_URL": redis_server.url},
                       capture_output=True, text=True, timeout=10)
    assert ("warning: no live worker serves tiny-nobody-lifecycle: the run's jobs wait in the queue (no ETA) until one does"
            in (watching.value.stdout or b"").decode())  # (bytes: the run was cut short)
    refused = layertap(redis_server.url, "run", "delete", unserved, "--yes")
    assert refused.returncode == 1 and "1 job(s) without a result" in refused.stderr
    forced = layertap(redis_server.url, "run", "delete", unserved, "--yes", "--force")
    assert forced.returncode == 0, forced.stderr
    assert client.redis.llen(keys.model_queue("tiny-nobody-lifecycle")) == 0


def test_results_and_manifest_of_a_missing_run_fail(redis_server):
    for command in (["results", "--run", "no-such-run"], ["manifest", "--run", "no-such-run"]):
        out = layertap(redis_server.url, *command)
        assert out.returncode == 1
        assert out.stderr.startswith("error: no run named 'no-such-run'"), out.stderr
