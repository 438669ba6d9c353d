"""A Sentinel set that fails over and then back (a flap) loses no send reported sent. Real Redis
servers and sentinels (``layertap.producer.dev.sentinel_set``), the Client on the ``sentinel://``
URL (``redis_wait_replicas`` 1, its default there).

The sequence a busy machine once produced on its own, made deterministic: the primary is
SIGKILLed and its replica promoted, alone; sends go to it; it then stops answering (SIGSTOP, past
``down-after-milliseconds``) as the old primary restarts from its append-only file, and the
sentinels fail over back to that one; the stopped server, resumed, is made its replica and drops
all it took. Sends that had gone on unconfirmed were lost with their ledger records (a silent
loss). Now each waits until a replica holds it, and one whose primary turned replica is sent again;
what the ledger must hold of a send (its jobs' send times; for a job sent again, its old result
cleared) is written in the step that queues the message, so the send made again writes it too."""

from __future__ import annotations

import os
import signal
import threading
import time
import warnings
from collections.abc import Callable

from layertap.producer.client.client import Client, NoWorkerWarning
from layertap.producer.dev.sentinel_set import SentinelSet
from layertap.producer.ingest.enqueue import Enqueuer, Outcome, Planned
from layertap.protocol import keys
from layertap.settings import Settings
from layertap.transport.celery_app import replicas_to_wait
from tests.integration.test_send_confirmed import PAST_THE_OLD_GIVE_UP_S
from tests.support.jobs import make_job

RUN = "flap"
GROUP = "trainer"


def flap_during(cluster: SentinelSet, send: Callable[[], None], returned: Callable[[], bool]) -> None:
    """Kill the primary P, let the sentinels promote its replica R (alone), run ``send`` against R in
    a thread, and once it has waited past the old give-up (``returned()`` must still be False: no
    replica holds what it sent), stop R, restart P from its append-only file and let the sentinels
    fail over back to P; R, resumed, becomes P's replica and drops what it took. Returns once
    ``send`` has finished. (The sentinels list P as R's replica from the first failover on; P,
    restarted as a primary from its file and answering again before R is found down, is the replica
    they select and promote, before they would have converted it: Redis 7.0.15's sentinel logs,
    ``+selected-slave`` for P about 1.5 s after its restart, ``+convert-to-slave`` only for R.)"""
    old = cluster.kill_primary()
    promoted = cluster.wait_failover(old.port)  # alone now: no replica to confirm a send
    sending = threading.Thread(target=send, daemon=True)
    sending.start()
    time.sleep(PAST_THE_OLD_GIVE_UP_S)
    assert not returned(), "a send returned with no replica holding it"
    os.kill(promoted.process.pid, signal.SIGSTOP)  # the promoted primary stops answering...
    try:
        old.start()  # ...as the old one restarts from its append-only file
        back = cluster.wait_failover(promoted.port)
    finally:
        os.kill(promoted.process.pid, signal.SIGCONT)  # made the new primary's replica, it drops what it took
    assert back.port == old.port
    sending.join(timeout=300)
    assert not sending.is_alive(), "the sends did not finish after the failover back"


def queued_messages(primary) -> int:
    return sum(primary.llen(key) for key in primary.scan_iter(keys.QUEUE_PATTERN))


def test_a_failover_there_and_back_loses_no_send_reported_sent(tmp_path):
    jobs = [make_job(RUN, f"sent to the promoted replica {i}") for i in range(4)]
    sent: list[str] = []
    with SentinelSet(tmp_path / "set") as cluster:
        settings = Settings(redis_url=cluster.url)
        assert replicas_to_wait(settings) == 1  # the default with Sentinel

        def send() -> None:
            with Client(settings) as client, warnings.catch_warnings():
                warnings.simplefilter("ignore", NoWorkerWarning)  # no worker: the jobs stay queued
                prepared = [client.prepare(job, check=False) for job in jobs]
                client.send([[pair] for pair in prepared])  # one message each, the ledger written first for all
                sent.extend(job.job_id for job, _ in prepared)

        flap_during(cluster, send, lambda: bool(sent))
        assert sent == [job.job_id for job in jobs]
        primary = cluster.client(cluster.primary_port())
        assert queued_messages(primary) == len(jobs)  # every send reported sent is on the primary, once
        assert set(primary.hkeys(keys.run_submitted_hash(RUN))) == set(sent)  # and so is its ledger record


def test_jobs_an_enqueue_sends_again_through_a_flap_are_not_final_with_their_old_results(tmp_path):
    """``layertap enqueue`` sends jobs that ended in error again, each first losing its error status
    and its consumption by the enqueue's group. Those writes once went to the promoted primary before
    the send, and the flap dropped them: the jobs were queued again but still final with their old
    errors, so a streaming trainer could end its pass without their rows. Now the step that queues
    the message clears them, on whichever primary holds it."""
    jobs = [make_job(RUN, f"failed before, sent again {i}").with_id() for i in range(4)]
    ids = [job.job_id or "" for job in jobs]
    outcomes: list[Outcome] = []
    with SentinelSet(tmp_path / "set") as cluster:
        settings = Settings(redis_url=cluster.url)
        first = cluster.client(cluster.primary_port())
        for job_id in ids:  # the jobs' first send ended in error, and the trainer's group took those results
            first.hset(keys.run_submitted_hash(RUN), job_id, 1.0)
            first.hset(keys.run_status_hash(RUN), job_id, "error")
            first.hset(keys.run_consumed_hash(RUN, GROUP), job_id, "error")
        first.set(keys.run_sealed_key(RUN), 1.0)
        assert first.wait(1, 10_000) == 1  # the replica that will be promoted holds them

        def enqueue() -> None:
            with Client(settings) as client, warnings.catch_warnings():
                warnings.simplefilter("ignore", NoWorkerWarning)  # no worker: the jobs stay queued
                enqueuer = Enqueuer(client, max_inflight=100, group=GROUP, check=False)
                outcomes.extend(outcome for outcome, _ in enqueuer.run(Planned(job.job_id or "", job) for job in jobs))
                finished.set()  # every job yielded as submitted is sent (and the run sealed) once run() ends

        finished = threading.Event()
        flap_during(cluster, enqueue, finished.is_set)
        assert finished.is_set() and outcomes == [Outcome.submitted] * len(jobs)
        primary = cluster.client(cluster.primary_port())
        assert queued_messages(primary) >= 1
        assert primary.hmget(keys.run_status_hash(RUN), ids) == [None] * len(ids)  # not final until run again
        assert primary.hmget(keys.run_consumed_hash(RUN, GROUP), ids) == [None] * len(ids)
        assert primary.exists(keys.run_sealed_key(RUN))  # the run is whole, and waits for these jobs
