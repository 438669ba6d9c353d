"""Messages that once got no result: deep nesting, and Celery's scheduling fields on raw
messages. Each now ends in exactly one result, and the worker goes on serving."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone

from layertap.protocol import keys
from layertap.protocol.schema import ErrorType
from tests.support.jobs import results_for, wait_for

QUEUE = keys.model_queue("tiny-qwen3")


def payload(run: str, **fields) -> dict:
    return {"model": "tiny-qwen3", "run": run, "job_id": f"m-{uuid.uuid4().hex[:10]}", "prompt": "hi", **fields}


def nested(depth: int) -> dict:
    value: dict = {"type": "string"}
    for _ in range(depth):
        value = {"type": "object", "properties": {"x": value}}
    return value


def one_result(client, job: dict, timeout: float = 30):
    wait_for(lambda: results_for(client, job["run"], job["job_id"]), timeout, f"a result for {job['job_id']}")
    return results_for(client, job["run"], job["job_id"])


def test_deep_nesting_and_scheduling_fields_end_in_one_result_each(make_worker, private_client):
    make_worker("strict@localhost")
    run = "malformed"
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    deep = payload(run, prompt=None, messages=chat, tools=[{"type": "function", "function": nested(150)}])
    del deep["prompt"]
    far_eta, expired, soon, not_expired = payload(run), payload(run), payload(run), payload(run)
    send = private_client.celery.send_task
    send(keys.EXTRACT_TASK, args=[deep], queue=QUEUE)
    send(keys.EXTRACT_TASK, args=[far_eta], queue=QUEUE, countdown=3600)
    send(keys.EXTRACT_TASK, args=[expired], queue=QUEUE, expires=datetime.now(timezone.utc) - timedelta(seconds=5))
    send(keys.EXTRACT_TASK, args=[soon], queue=QUEUE, countdown=1)
    send(keys.EXTRACT_TASK, args=[not_expired], queue=QUEUE, expires=datetime.now(timezone.utc) + timedelta(hours=1))

    [deep_result] = one_result(private_client, deep)
    assert deep_result.error_type == ErrorType.invalid_job and "nested more than" in deep_result.error
    assert private_client.redis.xlen(keys.DEAD_LETTER_STREAM) == 0
    [far_result] = one_result(private_client, far_eta)
    assert far_result.error_type == ErrorType.invalid_job and "eta/countdown" in far_result.error
    [expired_result] = one_result(private_client, expired)
    assert expired_result.error_type == ErrorType.invalid_job and "expired" in expired_result.error
    [soon_result] = one_result(private_client, soon)
    assert soon_result.ok  # a short countdown (what the worker's own retries use) is honoured
    [not_expired_result] = one_result(private_client, not_expired)
    assert not_expired_result.ok
    wait_for(lambda: private_client.redis.hlen(keys.UNACKED_HASH) == 0, 10, "every message to be acknowledged")
    later = private_client.submit({"prompt": "still serving"}, model="tiny-qwen3", run=run)
    assert private_client.wait(run, [later.job_id], timeout=30)[later.job_id].ok
