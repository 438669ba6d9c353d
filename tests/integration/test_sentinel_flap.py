"""A Sentinel set that fails over and then back (a flap) loses no send reported sent. Real Redis
servers and sentinels (``layertap.producer.dev.sentinel_set``), the Client on the ``sentinel://``
URL (``redis_wait_replicas`` 1, its default there).

The sequence a busy machine once produced on its own, made deterministic: the primary is
SIGKILLed and its replica promoted, alone; sends go to it; it then stops answering (SIGSTOP, past
``down-after-milliseconds``) as the old primary restarts from its append-only file, and the
sentinels fail over back to that one; the stopped server, resumed, is made its replica and drops
all it took. Sends that had gone on unconfirmed were lost with their ledger records (a silent
loss). Now each waits until a replica holds it, and one whose primary turned replica is sent again."""

from __future__ import annotations

import os
import signal
import threading
import time
import warnings

from layertap.producer.client.client import Client, NoWorkerWarning
from layertap.producer.dev.sentinel_set import SentinelSet
from layertap.protocol import keys
from layertap.settings import Settings
from layertap.transport.celery_app import replicas_to_wait
from tests.integration.test_send_confirmed import PAST_THE_OLD_GIVE_UP_S
from tests.support.jobs import make_job

RUN = "flap"


def test_a_failover_there_and_back_loses_no_send_reported_sent(tmp_path):
    jobs = [make_job(RUN, f"sent to the promoted replica {i}") for i in range(4)]
    sent: list[str] = []
    with SentinelSet(tmp_path / "set") as cluster:
        settings = Settings(redis_url=cluster.url)
        assert replicas_to_wait(settings) == 1  # the default with Sentinel
        old = cluster.kill_primary()
        promoted = cluster.wait_failover(old.port)  # alone now: no replica to confirm a send

        def send() -> None:
            with Client(settings) as client, warnings.catch_warnings():
                warnings.simplefilter("ignore", NoWorkerWarning)  # no worker: the jobs stay queued
                prepared = [client.prepare(job, check=False) for job in jobs]
                client.send([[pair] for pair in prepared])  # one message each, the ledger written first for all
                sent.extend(job.job_id for job, _ in prepared)

        sending = threading.Thread(target=send, daemon=True)
        sending.start()
        time.sleep(PAST_THE_OLD_GIVE_UP_S)
        assert not sent, "a send returned with no replica holding it"
        os.kill(promoted.process.pid, signal.SIGSTOP)  # the promoted primary stops answering...
        try:
            old.start()  # ...as the old one restarts from its append-only file
            back = cluster.wait_failover(promoted.port)
        finally:
            os.kill(promoted.process.pid, signal.SIGCONT)  # made the new primary's replica, it drops what it took
        assert back.port == old.port
        sending.join(timeout=300)
        assert not sending.is_alive(), "the sends did not finish after the failover back"
        assert sent == [job.job_id for job in jobs]
        primary = cluster.client(cluster.primary_port())
        queued = sum(primary.llen(key) for key in primary.scan_iter(keys.QUEUE_PATTERN))
        assert queued == len(jobs)  # every send reported sent is on the primary, once
        assert set(primary.hkeys(keys.run_submitted_hash(RUN))) == set(sent)  # and so is its ledger record
