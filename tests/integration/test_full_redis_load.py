"""A load sent through a ``maxmemory`` episode (issue 45, item 1): every job a producer was told
is sent ends ok exactly once, with its file, whatever Redis refused in between; and the three
mechanisms that lost jobs, each alone: a start count retried whole, a record written before its
message was queued, a queued message called lost.

Real Redis put at ``maxmemory`` (``noeviction``) while ``layertap enqueue`` sends bundles and two
real workers run them, then the limit raised in small steps (each step frees a little room, so
some writes of a multi-write step go through and others do not), then lifted. The workers'
reconciler sweeps every 2 s meanwhile (``ORPHAN_TIMEOUT``), so a message it wrongly calls lost
is published ``lost`` during the episode.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
import warnings
from collections import Counter

import pytest
import redis

from layertap.producer.client.client import Client, NoWorkerWarning
from layertap.protocol import keys
from layertap.protocol.schema import Job, Result
from layertap.settings import Settings
from layertap.transport.ledger import Ledger, pending_record
from layertap.worker.queue.reconciler import Reconciler
from tests.support.jobs import RELIABILITY_ENV
from tests.support.processes import cli

ROWS = 3000
HOLD_S = 10.0  # full, across several reconcile sweeps and redeliveries
STEPS, STEP_BYTES, STEP_S = 80, 1024, 0.5  # then a little room at a time
RUN = "full-load"


def stream_results(raw: redis.Redis, run: str) -> list[Result]:
    return [Result.model_validate_json(fields[keys.RESULT_FIELD]) for _, fields in raw.xrange(keys.results_stream(run))]


def wait_for(condition, what: str, deadline_s: float = 600.0) -> None:
    deadline = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def test_a_load_through_a_full_redis_ends_every_job_ok_once(make_worker, private_redis, private_client, tmp_path):
    for node in ("full-a@localhost", "full-b@localhost"):
        make_worker(node)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"id": f"row-{i:05d}", "prompt": f"row {i} " + "word " * (i % 7)}) + "\n"
                            for i in range(ROWS)))
    raw = redis.Redis.from_url(private_redis.url, decode_responses=True)
    env = {**os.environ, **RELIABILITY_ENV, "LAYERTAP_REDIS_URL": private_redis.url}
    enqueue = subprocess.Popen(cli("enqueue", "--model", "tiny-qwen3", "--run", RUN, "--file", str(rows)),
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    errors: list[str] = []
    reader = threading.Thread(target=lambda: errors.extend(enqueue.stderr), daemon=True)  # type: ignore[arg-type]
    reader.start()
    try:
        wait_for(lambda: raw.xlen(keys.results_stream(RUN)) >= 50 or enqueue.poll() is not None, "no results")
        assert enqueue.poll() is None, "".join(errors)[-2000:]  # still sending when the limit comes
        used = int(raw.info("memory")["used_memory"])
        raw.config_set("maxmemory", used)
        wait_for(lambda: any("Redis refuses writes" in line for line in errors) or enqueue.poll() is not None,
                 "enqueue never met the limit")
        time.sleep(HOLD_S)
        for step in range(1, STEPS + 1):
            raw.config_set("maxmemory", used + step * STEP_BYTES)
            time.sleep(STEP_S)
    finally:
        raw.config_set("maxmemory", 0)
    assert enqueue.wait(timeout=600) == 0, "".join(errors)[-3000:]
    reader.join(timeout=30)
    ids = [f"row-{i:05d}" for i in range(ROWS)]
    done = private_client.wait(RUN, ids, timeout=600)
    not_ok = {job_id: f"{result.error_type}: {result.error}" for job_id, result in done.items() if not result.ok}
    assert not not_ok, f"{len(not_ok)} job(s) not ok: {list(not_ok.items())[:4]}"
    published = Counter(result.job_id for result in stream_results(raw, RUN))
    assert set(published) == set(ids) and max(published.values()) == 1, published.most_common(3)
    for result in done.values():
        assert result.path and os.path.exists(result.path), result
    raw.close()


def test_a_delivery_counts_its_starts_once_however_often_redis_makes_it_retry(private_redis):
    """The count is one step (all or nothing at ``maxmemory``) and a call repeated with the
    delivery's token counts nothing again: before, a pipeline partly applied at the limit was
    retried whole, counted its jobs twice and split a bundle that had never started."""
    raw = redis.Redis.from_url(private_redis.url, decode_responses=True)
    jobs = [("counted", f"job-{i}") for i in range(64)]
    raw.config_set("maxmemory", 1)
    try:
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            Ledger(raw, give_up_s=0).count_starts(jobs, ["counted"], "delivery-1")
    finally:
        raw.config_set("maxmemory", 0)
    assert not any(raw.exists(keys.attempts_key(run, job_id)) for run, job_id in jobs)  # nothing applied
    assert Ledger(raw, give_up_s=0).count_starts(jobs, ["counted"], "delivery-1") == ([1] * 64, set())
    assert Ledger(raw, give_up_s=0).count_starts(jobs, ["counted"], "delivery-1") == ([1] * 64, set())  # the retry
    raw.set(keys.run_cancelled_key("counted"), 1)
    assert Ledger(raw, give_up_s=0).count_starts(jobs, ["counted"], "delivery-2") == ([2] * 64, {"counted"})
    raw.close()


def test_a_message_and_its_record_are_queued_together_or_not_at_all(private_redis):
    raw = redis.Redis.from_url(private_redis.url, decode_responses=True)
    queue = keys.model_queue("tiny-nobody")
    record = pending_record(queue, "together:job", 1.0)
    raw.config_set("maxmemory", 1)
    try:
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            Ledger(raw, give_up_s=0).push_recorded(queue, "{}", "together:job", record)
    finally:
        raw.config_set("maxmemory", 0)
    assert raw.llen(queue) == 0 and raw.hlen(keys.PENDING_HASH) == 0 and raw.zcard(keys.pending_sent_zset(queue)) == 0
    before = raw.time()
    Ledger(raw, give_up_s=0).push_recorded(queue, "{}", "together:job", record)
    assert raw.lrange(queue, 0, -1) == ["{}"] and raw.hget(keys.PENDING_HASH, "together:job") == record
    assert raw.zscore(keys.pending_sent_zset(queue), "together:job") >= before[0]  # the push time, the server's clock
    raw.close()


def sweep(reconciler: Reconciler, raw: redis.Redis, times: int) -> None:
    for _ in range(times):
        raw.delete(keys.RECONCILE_LOCK)
        reconciler.sweep()


def test_a_message_queued_behind_a_newer_one_is_never_called_lost(private_redis, run_name):
    """A message sent before the queue's head but still queued behind it (a restore put the head
    back in front of it) is found by the reconciler's last step and not ended."""
    with Client(Settings(redis_url=private_redis.url)) as client, warnings.catch_warnings():
        warnings.simplefilter("ignore", NoWorkerWarning)
        queue = keys.model_queue("tiny-nobody")
        older, newer = (Job(model="tiny-nobody", run=run_name, prompt=text).with_id() for text in ("older", "newer"))
        client.submit(newer)
        client.submit(older)  # queued behind newer...
        sent = keys.pending_sent_zset(queue)
        raw = redis.Redis.from_url(private_redis.url, decode_responses=True)
        older_id = keys.task_id(run_name, older.job_id)
        raw.zadd(sent, {older_id: float(raw.zscore(sent, keys.task_id(run_name, newer.job_id))) - 10})  # ...sent first
        sweep(Reconciler(raw, client.celery, "sweeper@host", interval=1.0, grace=0.0), raw, 3)
        assert raw.hexists(keys.PENDING_HASH, older_id) and raw.llen(queue) == 2
        assert raw.xlen(keys.results_stream(run_name)) == 0
        raw.close()


def test_messages_put_back_by_the_reconciler_keep_their_send_order(private_redis, run_name):
    """Two messages left in the in-flight list by a fetcher that died go back to the head of the
    queue oldest first in line, whatever their task ids' order."""
    with Client(Settings(redis_url=private_redis.url)) as client, warnings.catch_warnings():
        warnings.simplefilter("ignore", NoWorkerWarning)
        queue = keys.model_queue("tiny-nobody")
        jobs = [Job(model="tiny-nobody", run=run_name, job_id=job_id, prompt=job_id)
                for job_id in ("a-first", "z-then")]
        for job in jobs:
            client.submit(job)
        raw = redis.Redis.from_url(private_redis.url, decode_responses=True)
        for _ in jobs:  # a fetcher took both and died before holding them
            raw.lmove(queue, keys.inflight_list(queue), "RIGHT", "LEFT")
        sweep(Reconciler(raw, client.celery, "sweeper@host", interval=1.0, grace=0.0), raw, 2)
        heads = [raw.lindex(queue, index) for index in (-1, -2)]  # the head is the list's right end
        assert [keys.task_id_of_delivery_tag(json.loads(message)["properties"]["delivery_tag"]) for message in heads] \
            == [keys.task_id(run_name, "a-first"), keys.task_id(run_name, "z-then")]
        raw.close()
