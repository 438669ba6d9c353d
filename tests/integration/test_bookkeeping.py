"""Bookkeeping whose cost does not grow with payload size or run length (issue 12, item 3):
the reconciler's sweep reads ids and times, not message bodies; ``Client.wait`` reads a
finished job's result by its stream id instead of reading the run's stream from the start.
Real Redis (a private server per test, so its byte counters count only this test's reads)."""

from __future__ import annotations

import json
import threading
import time
import warnings

import pytest
import redis

from layertap.producer.client.client import Client, NoWorkerWarning
from layertap.producer.dev.redis_server import RedisServer
from layertap.protocol import keys
from layertap.protocol.schema import ErrorType, Result, Status
from layertap.settings import Settings
from layertap.worker.queue.publisher import ResultPublisher
from layertap.worker.queue.reconciler import Reconciler

MODEL = "tiny-unserved"


@pytest.fixture
def own_redis(tmp_path):
    with RedisServer(data_dir=tmp_path / "redis", appendonly=False) as server:
        yield server


@pytest.fixture
def own_client(own_redis):
    with Client(Settings(redis_url=own_redis.url)) as value:
        yield value


def bytes_sent(client: redis.Redis) -> int:
    """Bytes the server has sent to its clients so far, less the reply that carries the figure."""
    return int(client.info("stats")["total_net_output_bytes"])


def read_by(client: redis.Redis, action) -> tuple[object, int]:
    """``action()``'s value, and how many bytes the server sent while it ran (INFO replies taken out)."""
    before = bytes_sent(client)
    value = action()
    after = bytes_sent(client)
    info_reply = bytes_sent(client) - after
    return value, after - before - info_reply


def ok_result(run: str, index: int) -> Result:
    return Result(job_id=f"job-{index:06d}", run=run, status=Status.ok, path=f"/data/{run}/job-{index:06d}.safetensors",
                  num_tokens=1000, layers=[1, 2], model=MODEL, worker="w@host")


def test_sweep_reads_no_message_body_and_resends_only_the_lost_job(own_client, own_redis):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NoWorkerWarning)
        jobs = [own_client.submit({"model": MODEL, "run": "sweep", "job_id": f"j{index}",
                                   "token_ids": list(range(20_000))}) for index in range(5)]
    queue = keys.model_queue(MODEL)
    message_bytes = len(own_client.redis.lindex(queue, -1))
    assert message_bytes > 100_000
    raw = redis.Redis.from_url(own_redis.url)
    with own_client.celery.connection_for_read() as connection:
        channel = connection.default_channel
        held = [channel.basic_get(queue, no_ack=False) for _ in range(3)]  # as a worker holds them
        assert all(message is not None for message in held)
        # fetched as a worker's transport fetches, and never recorded: its fetcher died
        assert raw.lmove(queue, keys.inflight_list(queue), "RIGHT", "LEFT") is not None
        assert raw.hlen(keys.UNACKED_HASH) == 3 and raw.llen(queue) == 1
        reconciler = Reconciler(raw, own_client.celery, "sweeper@host", interval=1.0, grace=0.0)
        resent, read = read_by(raw, reconciler.sweep)
        assert resent == 0  # first sighting: a suspect only
        assert raw.hkeys(keys.SUSPECT_HASH) == [keys.task_id("sweep", jobs[3].job_id).encode()]
        assert read < 4_000, f"a sweep read {read} bytes; one message is {message_bytes}"
        raw.delete(keys.RECONCILE_LOCK)
        assert reconciler.sweep() == 1
        # the lost job is back at the head of the queue, where it was; the held ones were not sent
        queued = [json.loads(message)["headers"]["id"] for message in raw.lrange(queue, 0, -1)]
        assert queued == [keys.task_id("sweep", jobs[4].job_id), keys.task_id("sweep", jobs[3].job_id)]
        assert raw.llen(keys.inflight_list(queue)) == 0
        held_ids = {keys.task_id_of_delivery_tag(tag.decode()) for tag in raw.hkeys(keys.UNACKED_HASH)}
        assert held_ids == {keys.task_id("sweep", job.job_id) for job in jobs[:3]}
        assert raw.hlen(keys.SUSPECT_HASH) == 0
        raw.delete(keys.RECONCILE_LOCK)
        assert reconciler.sweep() == 0  # nothing missing any more: the resent job is queued
    raw.close()


def test_sweep_resends_a_lost_job_recorded_by_an_older_client(own_client, own_redis):
    """A pending record without its send-time member (as an older Client wrote them) is still swept."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NoWorkerWarning)
        job = own_client.submit({"model": MODEL, "run": "older", "job_id": "j0", "token_ids": [1, 2, 3]})
    queue, task_id = keys.model_queue(MODEL), keys.task_id("older", "j0")
    own_client.redis.delete(keys.pending_sent_zset(queue), keys.PENDING_QUEUES_SET)
    assert own_client.redis.lmove(queue, keys.inflight_list(queue), "RIGHT", "LEFT") is not None  # its fetcher died
    raw = redis.Redis.from_url(own_redis.url)
    reconciler = Reconciler(raw, own_client.celery, "sweeper@host", interval=1.0, grace=0.0)
    assert reconciler.sweep() == 0
    assert raw.zscore(keys.pending_sent_zset(queue), task_id) is not None
    raw.delete(keys.RECONCILE_LOCK)
    assert reconciler.sweep() == 1
    assert json.loads(raw.lindex(queue, -1))["headers"]["id"] == keys.task_id(job.run, job.job_id)
    raw.close()


def test_a_job_whose_message_is_gone_gets_a_lost_result(own_client, own_redis):
    """No copy of a queued job is kept: a message gone from every place (purged by hand) cannot be
    sent again, and its job ends with a ``lost`` error result instead of waiting forever."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NoWorkerWarning)
        job = own_client.submit({"model": MODEL, "run": "gone", "job_id": "j0", "token_ids": [1, 2, 3]})
    queue = keys.model_queue(MODEL)
    assert own_client.redis.delete(queue) == 1
    raw = redis.Redis.from_url(own_redis.url)
    reconciler = Reconciler(raw, own_client.celery, "sweeper@host", interval=1.0, grace=0.0)
    assert reconciler.sweep() == 0
    raw.delete(keys.RECONCILE_LOCK)
    assert reconciler.sweep() == 0
    result = own_client.wait("gone", [job.job_id], timeout=5)[job.job_id]
    assert result.error_type is ErrorType.lost and result.model == MODEL
    assert raw.hlen(keys.PENDING_HASH) == 0 and raw.zcard(keys.pending_sent_zset(queue)) == 0
    assert raw.get(keys.RECOVERED_COUNTER) is None
    raw.close()


def test_sweep_does_not_read_the_backlog(own_client, own_redis):
    """Jobs queued behind the head cannot be lost: a sweep reads none of their records."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NoWorkerWarning)
        for index in range(502):
            own_client.submit({"model": MODEL, "run": "backlog", "job_id": f"j{index}", "token_ids": [1, 2, 3]})
    raw = redis.Redis.from_url(own_redis.url)
    with own_client.celery.connection_for_read() as connection:
        channel = connection.default_channel
        assert all(channel.basic_get(keys.model_queue(MODEL), no_ack=False) is not None for _ in range(2))
        reconciler = Reconciler(raw, own_client.celery, "sweeper@host", interval=1.0, grace=0.0)
        resent, read = read_by(raw, reconciler.sweep)
        assert resent == 0 and raw.hlen(keys.SUSPECT_HASH) == 0
        assert raw.hlen(keys.PENDING_HASH) == 502 and raw.llen(keys.model_queue(MODEL)) == 500
    assert read < 1_000, f"a sweep read {read} bytes with 2 jobs held and 500 queued"
    raw.close()


def test_wait_returns_results_published_before_and_after_it_was_called(own_client):
    publisher = ResultPublisher(own_client.redis)
    for index in range(3):
        publisher.publish(ok_result("both", index))
    publisher.publish(ok_result("both", 1).model_copy(update={"worker": "again@host"}))  # a duplicate: the latest wins

    def publish_later() -> None:
        time.sleep(0.5)
        for index in (3, 4):
            publisher.publish(ok_result("both", index))

    thread = threading.Thread(target=publish_later)
    thread.start()
    found = own_client.wait("both", [f"job-{index:06d}" for index in range(5)], timeout=30)
    thread.join()
    assert sorted(found) == [f"job-{index:06d}" for index in range(5)]
    assert all(result.ok for result in found.values())
    assert found["job-000001"].worker == "again@host"
    assert found["job-000004"].path == "/data/both/job-000004.safetensors"


def test_wait_at_the_end_of_a_long_stream_reads_only_the_jobs_it_waits_for(own_client):
    publisher = ResultPublisher(own_client.redis)
    for index in range(3_000):
        publisher.publish(ok_result("long", index))
    stream_bytes = own_client.redis.memory_usage(keys.results_stream("long"))
    assert stream_bytes > 500_000
    assert own_client.redis.hget(keys.run_result_ids_hash("long"), "job-002999") == \
        own_client.redis.xrevrange(keys.results_stream("long"), count=1)[0][0]
    wanted = ["job-000000", "job-001500", "job-002999"]
    found, read = read_by(own_client.redis, lambda: own_client.wait("long", wanted, timeout=10))
    assert sorted(found) == wanted and all(result.ok for result in found.values())
    assert read < 4_000, f"wait read {read} bytes of a {stream_bytes}-byte stream"


def test_wait_finds_a_result_published_before_the_index_existed(own_client):
    """An entry without a stream id in the result-ids hash (an older worker's): read from the start."""
    old = ok_result("legacy", 7)
    own_client.redis.xadd(keys.results_stream("legacy"), {keys.RESULT_FIELD: old.model_dump_json()})
    own_client.redis.hset(keys.run_status_hash("legacy"), old.job_id, old.status.value)
    ResultPublisher(own_client.redis).publish(ok_result("legacy", 8))
    found = own_client.wait("legacy", [old.job_id, "job-000008"], timeout=10)
    assert found[old.job_id] == old and found["job-000008"].ok
