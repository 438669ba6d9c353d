"""The pending ledger on a second run (issue 22, items 5 and 14; issue 45, item 1): a message
whose send Redis refused at ``maxmemory`` leaves no pending record (the record goes in the step
that queues the message), and its jobs sent again by a re-run of ``layertap enqueue`` end ok and
never ``lost``; the jobs a message sends again lose their old results in the step that queues it,
once; a lost bundle holding jobs of several runs ends each job in its own run. Real Redis, real
worker."""

from __future__ import annotations

import json
import os
import subprocess
import time
import warnings

import pytest
import redis
from kombu.exceptions import OperationalError

from layertap.producer.client.client import Client, NoWorkerWarning
from layertap.producer.client.dlq import requeue
from layertap.producer.ingest.enqueue import Enqueuer, Planned
from layertap.protocol import keys
from layertap.protocol.schema import ErrorType, Job, Result, Status
from layertap.settings import BundleSettings, Settings
from layertap.transport.ledger import Ledger, pending_record, record_pending
from layertap.transport.redis_conn import refuses_writes
from layertap.worker.queue.reconciler import Reconciler
from tests.support.jobs import ORPHAN_TIMEOUT, wait_for
from tests.support.processes import cli

MODEL = "tiny-qwen3"
ROWS = 40


def steady_memory(client: redis.Redis) -> int:
    """Redis's ``used_memory`` once two readings agree (a new connection's buffers settle)."""
    readings = [-1, int(client.info("memory")["used_memory"])]
    while readings[-1] != readings[-2]:
        time.sleep(0.1)
        readings.append(int(client.info("memory")["used_memory"]))
    return readings[-1]


def test_a_refused_send_leaves_no_record_and_the_resent_jobs_end_ok(make_worker, private_redis, run_name, tmp_path):
    """A real ``maxmemory`` refusal after the run's ledger write, of the send itself: no pending
    record is left for a message that was never queued (before issue 45 one was, and the
    reconciler published ``lost`` for a message whose push was still being retried); the
    documented resume (run the same ``layertap enqueue`` again) sends the jobs in a new bundle,
    they end ok, and none is ever published ``lost``."""
    rows = [{"id": f"row-{i:02d}", "text": f"prompt number {i} of a run that is resumed " + "word " * 80}
            for i in range(ROWS)]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    settings = Settings(redis_url=private_redis.url, redis_wait_s=1.0,
                        bundle=BundleSettings(max_jobs=ROWS, max_wait_s=60.0))
    queue = keys.model_queue(MODEL)
    with Client(settings) as client, warnings.catch_warnings():
        warnings.simplefilter("ignore", NoWorkerWarning)
        warm = [Job(model="tiny-elsewhere", run=f"{run_name}-warm", prompt=f"warm {i}").with_id() for i in range(3)]
        list(Enqueuer(client, max_inflight=1000).run(Planned(job.job_id, job) for job in warm))  # opens connections
        jobs = [Job(model=MODEL, run=run_name, job_id=row["id"], prompt=row["text"]).with_id() for row in rows]
        # Redis counts the commands' buffers: measured, the run's ledger write goes in under a limit
        # 36-54 kB above the steady use and passes it; the message (~30 kB) is then refused
        client.redis.config_set("maxmemory", steady_memory(client.redis) + 45_000)
        with pytest.raises((redis.exceptions.OutOfMemoryError, OperationalError)) as refused:
            list(Enqueuer(client, max_inflight=1000).run(Planned(job.job_id, job) for job in jobs))
        assert refuses_writes(refused.value)
        client.redis.config_set("maxmemory", 0)
        assert client.redis.llen(queue) == 0  # the bundle was never sent...
        assert client.redis.hget(keys.run_submitted_hash(run_name), rows[0]["id"])  # ...after the run's ledger write
        assert [task_id for task_id in client.redis.hkeys(keys.PENDING_HASH) if task_id.startswith(f"{run_name}:")] \
            == []  # ...and left no pending record

        # the resume is sent before the worker (and its reconciler) starts, so the order does not hang
        # on how fast a process starts: the sweep that follows meets the record and the newer send
        env = {**os.environ, "LAYERTAP_REDIS_URL": private_redis.url}
        again = subprocess.run(cli("enqueue", "--model", MODEL, "--run", run_name, "--file", str(path), "-q"),
                               env=env, capture_output=True, text=True, timeout=300)
        assert again.returncode == 0, again.stderr
        make_worker("resumer@localhost")
        results = client.wait(run_name, [row["id"] for row in rows], timeout=120)
        assert all(result.ok for result in results.values())
        wait_for(lambda: not [task_id for task_id in client.redis.hkeys(keys.PENDING_HASH)
                              if task_id.startswith(f"{run_name}:")], 30 * ORPHAN_TIMEOUT, "the run's records to end")
        statuses = client.redis.hgetall(keys.run_status_hash(run_name))
        assert statuses == {row["id"]: Status.ok.value for row in rows}
        assert [r for r in client.results(run_name) if r.error_type is ErrorType.lost] == []


def test_a_lost_bundle_of_several_runs_ends_each_job_in_its_own_run(private_redis, run_name):
    """A producer other than the Client may bundle jobs of several runs (its record says each job's
    run); purged from its queue, the bundle's ``lost`` results go to each job's own run."""
    runs = [f"{run_name}-a", f"{run_name}-b"]
    with Client(Settings(redis_url=private_redis.url)) as client:
        pairs = [(runs[i % 2], f"job-{i}") for i in range(4)]
        task_id = keys.bundle_task_id(runs[0], "mixed")
        pipe = client.redis.pipeline(transaction=True)
        record_pending(pipe, keys.model_queue("tiny-nobody"), task_id, 1.0, pairs)
        pipe.execute()
        raw = redis.Redis.from_url(private_redis.url)
        reconciler = Reconciler(raw, client.celery, "sweeper@host", interval=1.0, grace=0.0)
        for _ in range(2):  # found missing, then due
            raw.delete(keys.RECONCILE_LOCK)
            reconciler.sweep()
        for run in runs:
            mine = [job_id for job_run, job_id in pairs if job_run == run]
            results = client.wait(run, mine, timeout=10)
            assert {result.error_type for result in results.values()} == {ErrorType.lost}
            assert client.redis.xlen(keys.results_stream(run)) == len(mine)
        assert client.redis.hlen(keys.PENDING_HASH) == 0
        raw.close()


def test_a_message_that_sends_jobs_again_clears_their_old_results_when_first_queued(private_redis, run_name):
    """The record's ``reopen`` (a job sent again) clears, in the push that queues the message, each
    such job's status, its latest-entry index and its consumption by the groups
    named for it, and nothing of the message's other jobs or of other groups; a second push of the
    same message (a worker's retry, which keeps its record) clears nothing, so a result published
    in between stays."""
    raw = redis.Redis.from_url(private_redis.url, decode_responses=True)
    status = keys.run_status_hash(run_name)
    trainer, evaluator = (keys.run_consumed_hash(run_name, group) for group in ("trainer", "evaluator"))
    raw.hset(status, mapping={"failed-1": "error", "kept-ok": "ok", "failed-2": "error", "dead": "error"})
    raw.hset(trainer, mapping={"failed-1": "error", "kept-ok": "ok", "failed-2": "error", "dead": "error"})
    raw.hset(evaluator, mapping={"failed-1": "error", "failed-2": "error", "dead": "error"})
    index = keys.run_result_ids_hash(run_name)
    raw.hset(index, mapping={"failed-1": "1-0", "kept-ok": "2-0", "failed-2": "3-0", "dead": "4-0"})
    queue = keys.model_queue("tiny-nobody")
    task_id = keys.bundle_task_id(run_name, "again")
    pairs = [(run_name, job_id) for job_id in ("failed-1", "kept-ok", "failed-2", "dead")]
    record = pending_record(queue, task_id, 5.0, pairs, {"failed-1": ["trainer"], "failed-2": ["trainer"],
                                                         "dead": ["trainer", "evaluator"]})
    ledger = Ledger(raw, give_up_s=0)
    ledger.push_recorded(queue, "{}", task_id, record)
    assert raw.hgetall(status) == {"kept-ok": "ok"}
    assert raw.hgetall(index) == {"kept-ok": "2-0"}
    assert raw.hgetall(trainer) == {"kept-ok": "ok"}
    assert raw.hgetall(evaluator) == {"failed-1": "error", "failed-2": "error"}  # not named for those two
    assert raw.hgetall(keys.run_submitted_hash(run_name)) == {job_id: "5.0" for _, job_id in pairs}
    raw.hset(status, "failed-1", "ok")  # its new result, published before the message is pushed again
    ledger.push_recorded(queue, "{}", task_id, record)
    assert raw.hgetall(status) == {"kept-ok": "ok", "failed-1": "ok"}
    assert raw.llen(queue) == 2
    raw.close()


def test_a_requeued_dead_letter_is_no_longer_final_nor_consumed(private_redis, run_name):
    """``layertap dlq requeue``: the job's dead-letter result stops being its final status, and being
    consumed by each consumer group of its run, in the step that queues its message; before, the
    job stayed final (``error``) until its new result landed, so a streaming trainer, ``watch`` or
    ``Client.wait`` could take the run as done without it."""
    job = Job(model="tiny-nobody", run=run_name, job_id="dead-one", prompt="failed three times").with_id()
    with Client(Settings(redis_url=private_redis.url)) as client, warnings.catch_warnings():
        warnings.simplefilter("ignore", NoWorkerWarning)  # no worker: the job stays queued
        raw = client.redis
        raw.hset(keys.run_submitted_hash(run_name), "dead-one", 1.0)
        raw.hset(keys.run_status_hash(run_name), "dead-one", "error")
        for group in ("trainer", "evaluator"):
            raw.xgroup_create(keys.results_stream(run_name), group, id="0", mkstream=True)
            raw.hset(keys.run_consumed_hash(run_name, group), "dead-one", "error")
        client.ledger.dead_letter({"job": json.dumps(job.model_dump(mode="json", exclude_none=True)), "run": run_name,
                                   "job_id": "dead-one", "attempts": "3", "error_type": "write_failed",
                                   "error": "disk full", "at": "1.0", "worker": "w@host"})
        assert requeue(client) == ["dead-one"]
        assert not raw.hexists(keys.run_status_hash(run_name), "dead-one")
        for group in ("trainer", "evaluator"):
            assert not raw.hexists(keys.run_consumed_hash(run_name, group), "dead-one")
        assert raw.llen(keys.model_queue("tiny-nobody")) == 1
        assert client.ledger.dead_letter_count() == 0


def test_a_job_submitted_again_by_hand_is_no_longer_final(private_redis, run_name):
    """``Client.submit`` and ``submit_many`` of a job sent before (the run's ledger has its send
    time) clear its old status and latest-entry index in the step that queues its message, as
    ``layertap enqueue`` does; before, a job re-submitted by hand after an error stayed final until
    its new result landed (a streaming trainer on the sealed run could end its pass without it),
    and ``wait`` returned the old result. A ``replace`` job (other content) is no longer consumed by
    any group of its run; another keeps its consumption (a group that trained on its ok result
    skips the new one as a duplicate). A job never sent reopens nothing; a sender naming the groups
    (``Client.send``'s ``reopen``, as the enqueue names its own) clears only those."""
    raw = redis.Redis.from_url(private_redis.url, decode_responses=True)
    groups = ("trainer", "evaluator")
    for group in groups:
        raw.xgroup_create(keys.results_stream(run_name), group, id="0", mkstream=True)
    before = {"failed": Status.error, "done": Status.ok, "replaced": Status.ok, "named": Status.error}
    ledger = Ledger(raw, give_up_s=0)
    raw.hset(keys.run_submitted_hash(run_name), mapping={"in-flight": 1.0, **{job_id: 1.0 for job_id in before}})
    ledger.publish([Result(job_id=job_id, run=run_name, status=status) for job_id, status in before.items()],
                   None, None)
    for group in groups:
        raw.hset(keys.run_consumed_hash(run_name, group), mapping={job: status.value for job, status in before.items()})

    def job(job_id: str, **fields: object) -> Job:
        return Job(model="tiny-nobody", run=run_name, job_id=job_id, prompt=f"the prompt of {job_id}", **fields)

    def reopened(task_id: str) -> dict[str, list[str]]:
        return json.loads(raw.hget(keys.PENDING_HASH, task_id) or "{}").get("reopen", {})

    with Client(Settings(redis_url=private_redis.url)) as client, warnings.catch_warnings():
        warnings.simplefilter("ignore", NoWorkerWarning)  # no worker: the messages stay queued
        assert client.wait(run_name, ["failed"], timeout=1)["failed"].status is Status.error
        client.submit(job("failed"))
        assert not raw.hexists(keys.run_status_hash(run_name), "failed")
        assert reopened(keys.task_id(run_name, "failed")) == {"failed": []}
        with pytest.raises(TimeoutError):  # it waits for the new message's result, not the old one
            client.wait(run_name, ["failed"], timeout=1)
        client.submit_many([job("done"), job("fresh"), job("in-flight"), job("replaced", replace=True)])
        records = [reopened(task_id) for task_id in raw.hkeys(keys.PENDING_HASH) if keys.is_bundle_task_id(task_id)]
        assert len(records) == 1 and sorted(records[0]) == ["done", "in-flight", "replaced"]
        assert sorted(records[0]["replaced"]) == sorted(groups)
        client.send([[client.prepare(job("named"))]], {(run_name, "named"): ["trainer"]})
        assert reopened(keys.task_id(run_name, "named")) == {"named": ["trainer"]}
    assert raw.hgetall(keys.run_status_hash(run_name)) == {}
    assert raw.hgetall(keys.run_result_ids_hash(run_name)) == {}
    assert raw.hgetall(keys.run_consumed_hash(run_name, "trainer")) == {"failed": "error", "done": "ok"}
    assert raw.hgetall(keys.run_consumed_hash(run_name, "evaluator")) == {"failed": "error", "done": "ok",
                                                                           "named": "error"}
    assert raw.llen(keys.model_queue("tiny-nobody")) == 3
    raw.close()
