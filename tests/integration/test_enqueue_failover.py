"""``layertap enqueue`` rides out a Sentinel failover: each batch's reads of the run ledger (which
jobs are done, sent, or changed; how many are in flight) wait while no primary answers, as its
sends do, so a long enqueue goes on from where it was instead of exiting. Real Redis servers and
sentinels (``layertap.producer.dev.sentinel_set``), the Client on the ``sentinel://`` URL."""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterator

from layertap.producer.client.client import Client, NoWorkerWarning
from layertap.producer.dev.sentinel_set import SentinelSet
from layertap.producer.ingest.enqueue import Enqueuer, Outcome, Planned
from layertap.protocol import keys
from layertap.settings import BundleSettings, Settings
from tests.support.jobs import make_job, wait_for

RUN = "enqueue-failover"
BATCH = 4


def test_an_enqueue_reads_its_ledger_through_a_failover(tmp_path):
    before = [make_job(RUN, f"read and sent before the failover {i}").with_id() for i in range(BATCH)]
    during = [make_job(RUN, f"read while no primary answers {i}").with_id() for i in range(BATCH)]
    killed = threading.Event()
    outcomes: list[Outcome] = []
    failures: list[BaseException] = []

    def rows() -> Iterator[Planned]:
        for job in before:
            yield Planned(job.job_id or "", job)
        killed.wait()  # the next batch is read, and looked up in the ledger, right after the kill
        for job in during:
            yield Planned(job.job_id or "", job)

    with SentinelSet(tmp_path / "set") as cluster:
        settings = Settings(redis_url=cluster.url, bundle=BundleSettings(max_jobs=BATCH, max_wait_s=0.05))

        def enqueue() -> None:
            try:
                with Client(settings) as client, warnings.catch_warnings():
                    warnings.simplefilter("ignore", NoWorkerWarning)  # no worker: the jobs stay queued
                    enqueuer = Enqueuer(client, max_inflight=100, batch_size=BATCH, check=False)
                    outcomes.extend(outcome for outcome, _ in enqueuer.run(rows()))
            except BaseException as exc:  # noqa: BLE001 - the test reports it
                failures.append(exc)

        first = cluster.client(cluster.primary_port())
        enqueuing = threading.Thread(target=enqueue, daemon=True)
        enqueuing.start()
        wait_for(lambda: first.hlen(keys.run_submitted_hash(RUN)) == BATCH and first.wait(1, 1000) == 1, 60,
                 "the first batch's send times on the primary, a replica attached")  # its push may be on its way
        old = cluster.kill_primary()
        killed.set()
        cluster.wait_failover(old.port)
        old.start()  # made the new primary's replica: the sends after the failover are confirmed by it
        enqueuing.join(timeout=300)
        assert not enqueuing.is_alive(), "the enqueue did not finish after the failover"
        assert not failures, repr(failures)
        assert outcomes == [Outcome.submitted] * (2 * BATCH)
        primary = cluster.client(cluster.primary_port())
        assert set(primary.hkeys(keys.run_submitted_hash(RUN))) == {job.job_id for job in before + during}
        assert primary.exists(keys.run_sealed_key(RUN))
