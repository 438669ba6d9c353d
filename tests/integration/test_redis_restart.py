"""Redis restarts, a full Redis and a failover to a real replica under busy workers: the worker
rides them out.

A job is held "running" by the test holding its file's lock (see ``test_reliability``); Redis
is killed and restarted while the worker holds it; the worker must stay alive, finish and
publish the held job, and take new ones.
"""

from __future__ import annotations

import os
import subprocess
import time

from layertap.command import layertap_argv
from layertap.protocol import keys
from layertap.protocol.naming import job_path
from tests.support.jobs import (
    ORPHAN_TIMEOUT,
    attempts,
    hold_lock,
    make_job,
    results_for,
    wait_for,
)


def test_busy_worker_survives_a_redis_restart(make_worker, private_client, private_redis):
    worker = make_worker("busy@localhost")
    held = make_job("restart", "held while Redis restarts")
    with hold_lock(job_path(make_worker.storage, held.run, held.job_id)):
        private_client.submit(held)
        wait_for(lambda: attempts(private_client, held) == 1, 30, "the job to start")
        private_redis.restart()
        time.sleep(3)
        assert worker.process.poll() is None, worker.log_text()[-3000:]
    result = private_client.wait(held.run, [held.job_id], timeout=60)[held.job_id]
    assert result.ok
    later = make_job("restart", "a job sent after the restart")
    private_client.submit(later)
    assert private_client.wait(later.run, [later.job_id], timeout=60)[later.job_id].ok
    assert worker.process.poll() is None, worker.log_text()[-3000:]
    time.sleep(2 * ORPHAN_TIMEOUT)
    assert len(results_for(private_client, held.run, held.job_id)) == 1  # held, not put back and run again
    assert private_client.redis.hlen(keys.UNACKED_HASH) == 0  # kombu's record: the held job's ack reached Redis


def test_redis_at_maxmemory_is_waited_out_and_shown_in_status(make_worker, private_client, private_redis):
    """Redis refuses writes (``maxmemory`` reached, ``noeviction``) while a job is running and
    while a second worker starts: both stay up, say so, and carry on once memory is freed."""
    busy = make_worker("full-a@localhost", extra_args=["--concurrency", "1"])
    held, queued = make_job("full", "finishing while Redis is full"), make_job("full", "queued behind it")
    redis = private_client.redis
    with hold_lock(job_path(make_worker.storage, held.run, held.job_id)):
        private_client.submit(held)
        wait_for(lambda: attempts(private_client, held) == 1, 30, "the job to start")
        private_client.submit(queued)
        redis.config_set("maxmemory", 1)  # every write is now refused: OOM command not allowed
    late = make_worker("full-b@localhost", wait=False)  # starts while Redis is full
    time.sleep(6)
    assert busy.process.poll() is None and late.process.poll() is None, busy.log_text()[-2000:]
    assert results_for(private_client, held.run, held.job_id) == []  # its publish is being retried
    env = {**os.environ, "LAYERTAP_REDIS_URL": private_redis.url}
    shown = subprocess.run(layertap_argv("status"), env=env, capture_output=True,
                           text=True, timeout=60)
    assert "REDIS IS FULL" in shown.stdout, shown.stdout + shown.stderr
    assert "Redis refuses writes" in busy.log_text()
    redis.config_set("maxmemory", 0)
    results = private_client.wait(held.run, [held.job_id, queued.job_id], timeout=30)
    assert all(result.ok for result in results.values())
    late.wait_ready(timeout=30)
    assert busy.process.poll() is None and late.process.poll() is None
    assert len(results_for(private_client, held.run, held.job_id)) == 1


def test_worker_rides_out_a_failover_to_a_real_replica_and_back(make_worker, private_client, private_redis, tmp_path):
    """The primary the worker uses is demoted to a replica of a real ``--replicaof`` server
    (it answers READONLY, then resyncs) while a job is in flight, and promoted back: the
    worker stays up, and the job's result and later jobs arrive. The worker's orphan timeout
    is longer than the failover window here (as in production, 60 s against seconds): with
    the suite's 2 s, leases that cannot be renewed while Redis is read-only lapse, and the
    reconciler rightly sends the job again (answered from disk: a second, agreeing result)."""
    from layertap.producer.dev.redis_server import RedisServer

    worker = make_worker("failover@localhost", env={"LAYERTAP_ORPHAN_TIMEOUT": "30"})
    primary = private_client.redis
    with RedisServer(data_dir=tmp_path / "replica", extra_args=["--replicaof", "127.0.0.1",
                                                                str(private_redis.port)]) as replica_server:
        replica = redis_client(replica_server.url)
        wait_for(lambda: replica.info("replication").get("master_link_status") == "up", 30, "the replica to sync")
        held = make_job("failover", "held across the failover")
        with hold_lock(job_path(make_worker.storage, held.run, held.job_id)):
            private_client.submit(held)
            wait_for(lambda: attempts(private_client, held) == 1, 30, "the job to start")
            replica.replicaof("no", "one")  # failover: the replica is the primary now ...
            primary.replicaof("127.0.0.1", replica_server.port)  # ... and the old primary follows it (READONLY)
            wait_for(lambda: primary.info("replication").get("master_link_status") == "up", 30, "the demoted sync")
        time.sleep(3)  # the job finishes; its publish meets READONLY and is retried
        assert worker.process.poll() is None, worker.log_text()[-3000:]
        assert "READONLY" in worker.log_text() or "read only replica" in worker.log_text()
        primary.replicaof("no", "one")  # fail back: the worker's address takes writes again
        replica.replicaof("127.0.0.1", private_redis.port)
        result = private_client.wait(held.run, [held.job_id], timeout=30)[held.job_id]
        assert result.ok
        later = make_job("failover", "sent after the failback")
        private_client.submit(later)
        assert private_client.wait(later.run, [later.job_id], timeout=30)[later.job_id].ok
        assert worker.process.poll() is None
        assert len(results_for(private_client, held.run, held.job_id)) == 1


def redis_client(url: str):
    import redis

    return redis.Redis.from_url(url, decode_responses=True)
