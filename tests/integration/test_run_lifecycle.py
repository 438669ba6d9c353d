"""A run's lifecycle: ``layertap runs``, ``run cancel`` (wins against the queue and the
reconciler: every job gets one ``cancelled`` result, none runs, none is sent again) and
``run delete``; ``results`` and ``manifest`` of a run that does not exist; ``results --follow``
stops when the run is complete; ``Client.submit`` warns or refuses without a worker."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from layertap.producer.client.client import Client, JobFailed, NoWorker, NoWorkerWarning
from layertap.producer.client.runs import RunCancelled
from layertap.producer.dev.redis_server import RedisServer
from layertap.protocol import keys
from layertap.protocol.schema import ErrorType
from layertap.settings import Settings
from tests.support.blocking import hang_env
from tests.support.jobs import wait_for
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

        worker = WorkerProcess(tiny_models["qwen3"], "tiny-qwen3", private_redis.url, storage,
                               node="canceller@localhost", env={"LAYERTAP_ORPHAN_TIMEOUT": str(ORPHAN_TIMEOUT)},
                               log_path=tmp_path / "w.log")
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


def test_delete_refuses_unfinished_run_and_removes_files(workers, redis_server, client, run_name, storage_root):
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
    deleted = layertap(redis_server.url, "run", "delete", run_name, "--files", "--yes", "--storage", str(storage_root))
    assert deleted.returncode == 0 and "1 file(s)" in deleted.stdout, deleted.stderr
    assert not os.path.exists(path)

    unserved = f"{run_name}-unserved"
    with pytest.warns(NoWorkerWarning):
        client.submit({"prompt": "nobody serves me"}, model="tiny-nobody-lifecycle", run=unserved,
                      check=False)  # (others are live: the default would refuse)
    with pytest.raises(subprocess.TimeoutExpired) as watching:  # watch waits for the run to complete
        subprocess.run(cli("watch", "--run", unserved), env={**os.environ, "LAYERTAP_REDIS_URL": redis_server.url},
                       capture_output=True, text=True, timeout=10)
    assert ("warning: no live worker serves tiny-nobody-lifecycle: the run's jobs wait in the queue (no ETA) "
            "until one does"
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


def test_cancel_reports_true_counts_and_stops_held_jobs_before_compute(make_worker, private_client, private_redis,
                                                                       blocking_model, tmp_path):
    """Every message of a run is held by a worker whose engine is stuck on its first batch; the run
    is cancelled. Jobs not yet handed to the engine end ``cancelled`` (checked just before), the
    others ok; ``run cancel`` promises nothing, ``--wait`` prints the true counts, and ``runs``,
    ``runs show`` and ``watch`` show ``cancelled`` apart from ``failed``. A run cancelled after all
    its jobs ended ok is listed ``complete``."""
    run_name, gate = f"truth-{os.getpid()}", tmp_path / "gate"  # (a short name: watch's line fits)
    make_worker("cancel-truth@localhost", model_dir=blocking_model,
                env={**hang_env(gate, 300), "LAYERTAP_WORKER__TOKEN_BUDGET": "64",
                     "LAYERTAP_WORKER__PREPARE_AHEAD_BATCHES": "1"})
    gate.touch()  # (after its start: its load-time self-check runs the model)
    with private_client.bundler(max_jobs=4) as bundler:
        jobs = [bundler.add({"prompt": f"held job {i} " + "word " * 25}, model="tiny-qwen3", run=run_name)
                for i in range(48)]
    ids = [job.job_id for job in jobs]
    wait_for(lambda: private_client.redis.llen(keys.model_queue("tiny-qwen3")) == 0
             and private_client.redis.hlen(keys.UNACKED_HASH) == len(ids) // 4, 60, "every message to be held")
    first = layertap(private_redis.url, "run", "cancel", run_name)
    assert first.returncode == 0, first.stderr
    assert "0 ok, 0 failed, 0 cancelled so far; 48 job(s) without a result yet" in first.stdout, first.stdout
    gate.unlink()
    waited = layertap(private_redis.url, "run", "cancel", run_name, "--wait")
    results = private_client.wait(run_name, ids, timeout=60)
    ok = sum(result.ok for result in results.values())
    cancelled = sum(result.error_type is ErrorType.cancelled for result in results.values())
    assert ok + cancelled == 48 and ok >= 1 and cancelled >= 24, (ok, cancelled)
    assert waited.stdout.strip() == f"run {run_name} cancelled: {ok} ok, 0 failed, {cancelled} cancelled"
    assert (f"{run_name}  48/48 finished  cancelled ({cancelled} cancelled)"
            in layertap(private_redis.url, "runs").stdout)
    watched = layertap(private_redis.url, "watch", "--run", run_name)
    assert f"run {run_name} complete: {ok} ok, 0 failed, {cancelled} cancelled, 48 jobs" in watched.stdout
    shown = layertap(private_redis.url, "runs", "show", run_name).stdout
    assert shown.startswith(f"run {run_name}: cancelled; 48 submitted, {ok} ok, 0 failed, {cancelled} cancelled"), shown

    all_ok = f"{run_name}-ok"
    done = [private_client.submit({"prompt": f"finished before the cancel {i}"}, model="tiny-qwen3", run=all_ok)
            for i in range(2)]
    assert all(result.ok for result in private_client.wait(all_ok, [job.job_id for job in done], timeout=60).values())
    late = layertap(private_redis.url, "run", "cancel", all_ok)
    assert late.stdout.strip() == f"run {all_ok} cancelled: 2 ok, 0 failed, 0 cancelled"
    assert f"{all_ok}  2/2 finished  complete (0 cancelled)" in layertap(private_redis.url, "runs").stdout


def test_force_delete_waits_for_held_messages_and_leaves_nothing(make_worker, private_client, private_redis,
                                                                 blocking_model, tmp_path):
    """``run delete --force --files`` while a worker holds the run's bundles (its engine stuck): it
    cancels the run and waits for them to end, then deletes; no file is left and no key of the run
    comes back (before: the held bundles published into the deleted run and wrote their files)."""
    run_name, gate = f"doomed-{os.getpid()}", tmp_path / "gate"
    make_worker("deleted-under@localhost", model_dir=blocking_model, env=hang_env(gate, 300))
    gate.touch()
    with private_client.bundler(max_jobs=4) as bundler:
        jobs = [bundler.add({"prompt": f"held while deleted {i}"}, model="tiny-qwen3", run=run_name) for i in range(16)]
    wait_for(lambda: all(private_client.redis.exists(keys.attempts_key(run_name, job.job_id)) for job in jobs), 60,
             "every message to be held")
    env = {**os.environ, "LAYERTAP_REDIS_URL": private_redis.url}
    deleting = subprocess.Popen(cli("run", "delete", run_name, "--force", "--files", "--yes",
                                    "--storage", str(make_worker.storage)), env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: private_client.redis.exists(keys.run_cancelled_key(run_name)), 30, "the run to be cancelled")
    time.sleep(2)
    assert deleting.poll() is None  # waiting for the held messages
    gate.unlink()
    out, err = deleting.communicate(timeout=120)
    assert deleting.returncode == 0, err
    assert "waiting for" in out
    time.sleep(3)  # a late publish would land now
    assert list(private_client.redis.scan_iter(match=f"*{run_name}*")) == []
    files = make_worker.storage / run_name
    assert not files.exists() or not any(path.is_file() for path in files.rglob("*.safetensors"))
