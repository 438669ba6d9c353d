"""Bundles: several jobs in one message, against a real Redis and real worker processes (the
session's worker where a healthy one is all a test needs; a private Redis and workers of its own
where it kills, crashes or starts them).

Each job of a bundle keeps its own id, file, result and attempt count; a bad job gets its
own error result; a redelivered bundle answers its finished jobs from disk; a bundle whose
worker died is split on redelivery, so a job that kills its worker ends in the dead-letter
stream alone while every other job ends with exactly one ok result and a file.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import threading
import time

import pytest

from layertap.producer.client.client import Client, JobTooLarge, NoWorkerWarning
from layertap.protocol import keys
from layertap.protocol.fileformat import verify_file
from layertap.protocol.naming import job_path
from layertap.protocol.schema import ErrorType, Job
from layertap.settings import Limits, Settings
from layertap.transport.celery_app import send_extract
from layertap.transport.ledger import record_pending
from tests.support.blocking import POISON_TOKEN, crash_env
from tests.support.jobs import hold_lock, wait_for
from tests.support.processes import cli

MODEL = "tiny-qwen3"


def _queued_messages(client, model: str) -> list[dict]:
    return [json.loads(raw) for raw in reversed(client.redis.lrange(keys.model_queue(model), 0, -1))]


def _send_bundle(client, run: str, payloads: list, unique: str) -> str:
    """Send ``payloads`` as one bundle message with its pending record, as the Client does."""
    queue, task_id, now = keys.model_queue(MODEL), keys.bundle_task_id(run, unique), time.time()
    args, kwargs = [payloads], {"submitted_at": now}
    pipe = client.redis.pipeline()
    record_pending(pipe, queue, task_id, now, [(run, payload["job_id"]) for payload in payloads])
    pipe.execute()
    send_extract(client.celery, args, kwargs, queue, task_id, keys.EXTRACT_BUNDLE_TASK)
    return task_id


def _one_result_each(client, run: str, job_ids: list[str]) -> dict:
    """The run's results by job id, asserting that every job has exactly one."""
    seen = [result for result in client.results(run)]
    assert sorted(result.job_id for result in seen) == sorted(job_ids)
    return {result.job_id: result for result in seen}


def test_bundler_groups_by_size_tokens_and_latency(private_client):
    model, run = "tiny-nobody-bundles", "grouping"
    jobs = [{"token_ids": [1] * 100, "job_id": f"j{i}"} for i in range(10)]
    with private_client.bundler(max_jobs=4, max_tokens=10_000, max_wait_s=60) as bundler:
        with pytest.warns(NoWorkerWarning):
            sent = [bundler.add(job, model=model, run=run) for job in jobs]
        assert len(_queued_messages(private_client, model)) == 2  # two full bundles; two jobs held
        assert bundler.holds(run, "j9") and not bundler.holds(run, "j0")
    messages = _queued_messages(private_client, model)
    assert [m["headers"]["task"] for m in messages] == [keys.EXTRACT_BUNDLE_TASK] * 3
    assert [json.loads(m["headers"]["argsrepr"].replace("'", '"'))[0]["jobs"] for m in messages] == [4, 4, 2]
    assert [job.job_id for job in sent] == [f"j{i}" for i in range(10)]
    pending = private_client.redis.hgetall(keys.PENDING_HASH)
    assert sorted(pending) == sorted(m["headers"]["id"] for m in messages)  # one record per message
    assert private_client.redis.hlen(keys.run_submitted_hash(run)) == 10  # the ledger counts jobs

    private_client.redis.delete(keys.model_queue(model))
    with private_client.bundler(max_jobs=64, max_tokens=250, max_wait_s=60) as bundler:
        for job in jobs[:5]:
            bundler.add({**job, "job_id": job["job_id"] + "t"}, model=model, run=run)
    sizes = [json.loads(m["headers"]["argsrepr"].replace("'", '"'))[0].get("jobs", 1)
             for m in _queued_messages(private_client, model)]
    assert sizes == [2, 2, 1]  # 100 estimated tokens each, 250 per bundle

    private_client.redis.delete(keys.model_queue(model))
    bundler = private_client.bundler(max_jobs=64, max_wait_s=0.2)
    lone = bundler.add({"prompt": "a lone job", "model": model, "run": run})
    wait_for(lambda: len(_queued_messages(private_client, model)) == 1, 5, "the latency cap to send it")
    (message,) = _queued_messages(private_client, model)
    assert message["headers"]["task"] == keys.EXTRACT_TASK  # a bundle of one is a plain job message
    assert message["headers"]["id"] == keys.task_id(run, lone.job_id)
    bundler.close()


def _job_ids(message: dict) -> list[str]:
    """The job ids a queued message carries, in order (its body as kombu stores it)."""
    body = message["body"]
    if message["properties"].get("body_encoding") == "base64":
        body = base64.b64decode(body)
    args = json.loads(body)[0]
    jobs = args[0] if message["headers"]["task"] == keys.EXTRACT_BUNDLE_TASK else [args[0]]
    return [job["job_id"] for job in jobs]


def per_turn_rows(conversations: int, kind: str) -> list[dict]:
    """Each conversation's three per-turn rows in turn order (row k + 1 = row k and one more
    exchange), ids ``c<conversation>-<turn>``: as token ids, chats or prompt text."""
    rows = []
    for c in range(conversations):
        for turn in range(1, 4):
            if kind == "token_ids":
                row = {"token_ids": [100 * c + t for t in range(30 * turn)]}
            elif kind == "messages":
                row = {"messages": [{"role": role, "content": f"conversation {c} exchange {t} {role}"}
                                    for t in range(turn) for role in ("user", "assistant")]}
            else:
                row = {"prompt": "".join(f"conversation {c} exchange {t}. " for t in range(turn))}
            rows.append({**row, "job_id": f"c{c}-{turn}"})
    return rows


@pytest.mark.parametrize("kind", ["token_ids", "messages", "prompt"])
def test_a_conversations_rows_sent_turn_by_turn_stay_in_one_bundle(private_client, kind):
    """Bundles of 4 jobs over conversations of 3 rows: without keeping a conversation's rows
    together, 3 of 5 conversations would be split over two messages (two workers: the prefix
    computed twice). Unrelated jobs still fill their bundles."""
    model, run = "tiny-nobody-bundles", f"turns-{kind}"
    with private_client.bundler(max_jobs=4, max_tokens=100_000, max_wait_s=60) as bundler:
        with pytest.warns(NoWorkerWarning):
            for row in per_turn_rows(5, kind):
                bundler.add(row, model=model, run=run)
            for index in range(6):
                bundler.add({"prompt": f"an unrelated prompt {index}", "job_id": f"u{index}"}, model=model, run=run)
    messages = [_job_ids(message) for message in _queued_messages(private_client, model)]
    assert sorted(job_id for ids in messages for job_id in ids) == sorted(
        [f"c{c}-{turn}" for c in range(5) for turn in range(1, 4)] + [f"u{index}" for index in range(6)])
    assert all(len(ids) <= 4 for ids in messages)
    by_conversation = {f"c{c}": [index for index, ids in enumerate(messages)
                                 if any(job_id.startswith(f"c{c}-") for job_id in ids)] for c in range(5)}
    assert all(len(found) == 1 for found in by_conversation.values()), (by_conversation, messages)
    assert max(len(ids) for ids in messages) == 4  # unrelated jobs fill a bundle


def test_each_message_names_the_jobs_it_sends_again_through_kept_back_rows(private_client):
    """Jobs added with ``reopen_group`` (an enqueue sending them again) are named, with their group,
    in the pending record of the message that carries them and of no other, also where a
    conversation's rows were kept back to start the next bundle (the bundle split) and for a
    bundle of one job (a plain message)."""
    model, run = "tiny-nobody-bundles", "reopened"
    again = {"c0-2": "trainer", "c1-1": "trainer", "c1-3": "evaluator", "c2-3": "trainer"}
    with private_client.bundler(max_jobs=4, max_tokens=100_000, max_wait_s=60) as bundler:
        with pytest.warns(NoWorkerWarning):
            for row in per_turn_rows(3, "token_ids"):
                bundler.add(row, model=model, run=run, reopen_group=again.get(row["job_id"]))
            bundler.flush()
            bundler.add({"prompt": "alone", "job_id": "solo"}, model=model, run=run, reopen_group="trainer")
    messages = _queued_messages(private_client, model)
    named: dict[str, str] = {}
    for message in messages:
        record = json.loads(private_client.redis.hget(keys.PENDING_HASH, message["headers"]["id"]))
        reopen = record.get("reopen", {})
        assert set(reopen) <= set(_job_ids(message)), (reopen, _job_ids(message))
        named.update({job_id: group for job_id, (group,) in reopen.items()})
    assert named == {**again, "solo": "trainer"}
    assert len(messages) >= 3 and [_job_ids(m) for m in messages][-1] == ["solo"]


def test_rows_that_do_not_fit_one_bundle_are_split_as_before(private_client):
    """A conversation longer than a bundle, or one whose kept rows and next row would pass
    ``max_tokens``, is sent as bundles fill, never held back."""
    model, run = "tiny-nobody-bundles", "long-conversation"
    rows = [{"token_ids": list(range(10 * turn)), "job_id": f"t{turn}"} for turn in range(1, 7)]
    with private_client.bundler(max_jobs=4, max_tokens=100_000, max_wait_s=60) as bundler:
        with pytest.warns(NoWorkerWarning):
            for row in rows:
                bundler.add(row, model=model, run=run)
    assert [_job_ids(m) for m in _queued_messages(private_client, model)] == [["t1", "t2", "t3", "t4"], ["t5", "t6"]]

    private_client.redis.delete(keys.model_queue(model))
    rows = [{"token_ids": [7] * 50, "job_id": "a"}, {"token_ids": list(range(60)), "job_id": "b1"},
            {"token_ids": list(range(120)), "job_id": "b2"}]  # b1 and b2: 180 estimated tokens, over 160
    with private_client.bundler(max_jobs=64, max_tokens=160, max_wait_s=60) as bundler:
        for row in rows:
            bundler.add(row, model=model, run=run + "-tokens")
    assert [_job_ids(m) for m in _queued_messages(private_client, model)] == [["a", "b1"], ["b2"]]


def test_bundle_of_good_and_bad_jobs_gives_one_result_per_job(workers, client, storage_root, run_name):
    good = [Job(model=MODEL, run=run_name, prompt=f"good job {i}").with_id() for i in range(3)]
    payloads = [good[0].model_dump(mode="json", exclude_none=True),
                {"model": MODEL, "run": run_name, "job_id": "not-valid", "prompt": 5},
                good[1].model_dump(mode="json", exclude_none=True),
                {"model": MODEL, "run": run_name, "job_id": "empty", "prompt": ""},
                {"model": "tiny-other", "run": run_name, "job_id": "elsewhere", "prompt": "hi"},
                good[2].model_dump(mode="json", exclude_none=True)]
    task_id = _send_bundle(client, run_name, payloads, "mixed")
    ids = [job.job_id for job in good] + ["not-valid", "empty", "elsewhere"]
    client.wait(run_name, ids, timeout=60)
    results = _one_result_each(client, run_name, ids)
    for job in good:
        assert results[job.job_id].ok and results[job.job_id].attempt == 1
        verify_file(job_path(storage_root, run_name, job.job_id))
    assert results["not-valid"].error_type is ErrorType.invalid_job
    assert results["empty"].error_type is ErrorType.empty_input
    assert results["elsewhere"].error_type is ErrorType.unknown_model
    wait_for(lambda: not client.redis.hexists(keys.PENDING_HASH, task_id), 10, "the record to end")
    assert client.redis.zscore(keys.pending_sent_zset(keys.model_queue(MODEL)), task_id) is None
    assert not any(client.redis.exists(keys.attempts_key(run_name, job.job_id)) for job in good)


def test_redelivered_bundle_answers_finished_jobs_from_disk(workers, client, run_name):
    jobs = client.submit_many(({"prompt": f"bundled job {i}"} for i in range(5)), model=MODEL, run=run_name)
    first = client.wait(run_name, [job.job_id for job in jobs], timeout=60)
    assert all(result.ok and not result.cached for result in first.values())
    _send_bundle(client, run_name, [job.model_dump(mode="json", exclude_none=True) for job in jobs], "again")
    wait_for(lambda: client.redis.xlen(keys.results_stream(run_name)) == 2 * len(jobs), 60,
             "the repeat's results")
    again = client.latest(run_name)
    for job in jobs:
        assert again[job.job_id].ok and again[job.job_id].cached  # from its file, not computed again
        assert again[job.job_id].path == first[job.job_id].path


def test_worker_killed_mid_bundle_loses_nothing(make_worker, private_client, run_name):
    doomed = make_worker("doomed-bundle@localhost")
    jobs = [Job(model=MODEL, run=run_name, prompt=f"mid-bundle job {i}").with_id() for i in range(6)]
    held = jobs[3]
    with hold_lock(job_path(make_worker.storage, run_name, held.job_id)):
        with private_client.bundler(max_jobs=6, max_wait_s=60) as bundler:
            for job in jobs:
                bundler.add(job)
        wait_for(lambda: private_client.redis.get(keys.attempts_key(run_name, held.job_id)) == "1", 30,
                 "the bundle to start")
        time.sleep(1.0)  # the others are computed; the held job waits on its file's lock
        doomed.kill()
    rescuer = make_worker("rescuer-bundle@localhost")
    results = private_client.wait(run_name, [job.job_id for job in jobs], timeout=90)
    assert all(result.ok and result.worker == rescuer.node for result in results.values())
    assert "sent it again as two bundles of 3 and 3" in rescuer.log_text()  # it had started: split
    time.sleep(2.0)  # nothing more arrives
    _one_result_each(private_client, run_name, [job.job_id for job in jobs])
    for job in jobs:
        verify_file(job_path(make_worker.storage, run_name, job.job_id))
    assert private_client.redis.hlen(keys.PENDING_HASH) == 0
    assert private_client.redis.xlen(keys.DEAD_LETTER_STREAM) == 0


def test_poison_job_in_a_bundle_ends_alone_in_the_dead_letter_stream(make_worker, private_client, crashing_model,
                                                                     run_name):
    """The poison kills its worker for real each time it runs; a keeper restarts the worker.

    The worker takes one message at a time (concurrency 1): a worker that dies charges a start
    to every job it has started, so messages held beside the poison's would be charged too."""
    jobs = [Job(model=MODEL, run=run_name, token_ids=[11 + i, 12, 13, 14, 15, 16]).with_id() for i in range(7)]
    poison = Job(model=MODEL, run=run_name, token_ids=[3, POISON_TOKEN, POISON_TOKEN, POISON_TOKEN,
                                                       POISON_TOKEN, 3]).with_id()
    jobs.insert(2, poison)
    env = {**crash_env(), "LAYERTAP_WORKER__CONCURRENCY": "1"}
    workers = [make_worker("keeper-0@localhost", model_dir=crashing_model, env=env)]
    done = threading.Event()

    def keep_one_alive() -> None:
        while not done.wait(0.2):
            if workers[-1].process.poll() is not None:
                workers.append(make_worker(f"keeper-{len(workers)}@localhost", model_dir=crashing_model,
                                           env=env, wait=False))

    keeper = threading.Thread(target=keep_one_alive, daemon=True)
    keeper.start()
    try:
        with private_client.bundler(max_jobs=8, max_wait_s=60) as bundler:
            for job in jobs:
                bundler.add(job)
        results = private_client.wait(run_name, [job.job_id for job in jobs], timeout=240)
    finally:
        done.set()
        keeper.join()
    assert results[poison.job_id].error_type is ErrorType.dead_letter
    dead = private_client.redis.xrange(keys.DEAD_LETTER_STREAM)
    assert [entry["job_id"] for _, entry in dead] == [poison.job_id]
    for job in jobs:
        if job is not poison:
            assert results[job.job_id].ok
            verify_file(job_path(make_worker.storage, run_name, job.job_id))
    assert len(workers) > 3  # it did kill its worker: once in the bundle, more in halves, then alone
    time.sleep(2.0)
    _one_result_each(private_client, run_name, [job.job_id for job in jobs])


def test_enqueue_sends_bundles_and_back_pressure_stays_exact(make_worker, private_client, private_redis, run_name,
                                                             tmp_path):
    rows, limit = 30, 10
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": f"row-{i:02d}", "text": f"prompt {i} in a bundle"}) + "\n"
                            for i in range(rows)))
    env = {**os.environ, "LAYERTAP_REDIS_URL": private_redis.url}
    enqueue = subprocess.Popen(cli("enqueue", "--model", MODEL, "--run", run_name, "--file", str(path),
                                   "--max-inflight", str(limit)), env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    submitted = keys.run_submitted_hash(run_name)
    wait_for(lambda: private_client.redis.hlen(submitted) == limit, 30, "the first jobs")
    time.sleep(1.0)  # no worker: the enqueue waits at the limit, with its bundle sent
    assert private_client.redis.hlen(submitted) == limit and enqueue.poll() is None
    (message,) = _queued_messages(private_client, MODEL)
    assert message["headers"]["task"] == keys.EXTRACT_BUNDLE_TASK
    make_worker("back-pressure@localhost")
    out, err = enqueue.communicate(timeout=120)
    assert enqueue.returncode == 0, err
    assert len(out.split()) == rows
    results = private_client.wait(run_name, [f"row-{i:02d}" for i in range(rows)], timeout=60)
    assert all(result.ok for result in results.values())


def test_lost_bundle_is_put_back_as_one_message(make_worker, private_client, run_name):
    """The window a fetch leaves (message moved into the queue's in-flight list, fetcher dead before
    recording it), for a bundle: the ledger has one record for it and the reconciler puts the one
    message back; every job of it ends ok."""
    with pytest.warns(NoWorkerWarning):
        jobs = private_client.submit_many(({"prompt": f"lost bundle job {i}"} for i in range(5)), model=MODEL,
                                          run=run_name)
    assert private_client.redis.hlen(keys.PENDING_HASH) == 1
    queue = keys.model_queue(MODEL)
    assert private_client.redis.lmove(queue, keys.inflight_list(queue), "RIGHT", "LEFT") is not None
    make_worker("bundle-recoverer@localhost")
    results = private_client.wait(run_name, [job.job_id for job in jobs], timeout=60)
    assert all(result.ok for result in results.values())
    assert int(private_client.redis.get(keys.RECOVERED_COUNTER)) == 1  # one message put back
    wait_for(lambda: private_client.redis.hlen(keys.PENDING_HASH) == 0, 10, "the record to end")


def test_a_bundle_whose_message_is_nowhere_ends_each_job_lost(make_worker, private_client, run_name):
    """No copy of a message is kept: a bundle purged from its queue cannot be sent again, so each of
    its jobs gets exactly one ``lost`` error result (from the job ids in its pending record)."""
    with pytest.warns(NoWorkerWarning):
        jobs = private_client.submit_many(({"prompt": f"purged bundle job {i}"} for i in range(5)), model=MODEL,
                                          run=run_name)
    assert private_client.redis.delete(keys.model_queue(MODEL)) == 1
    make_worker("bundle-sweeper@localhost")
    results = private_client.wait(run_name, [job.job_id for job in jobs], timeout=60)
    assert {result.error_type for result in results.values()} == {ErrorType.lost}
    _one_result_each(private_client, run_name, [job.job_id for job in jobs])
    wait_for(lambda: private_client.redis.hlen(keys.PENDING_HASH) == 0, 10, "the record to end")


@pytest.mark.filterwarnings("ignore::layertap.producer.client.client.NoWorkerWarning")
def test_a_job_over_the_byte_limit_is_refused_by_the_client(private_redis, run_name):
    limits = Limits(max_job_bytes=500)
    with Client(Settings(redis_url=private_redis.url, limits=limits)) as client:
        small = {"model": "tiny-nobody-limits", "run": run_name, "prompt": "word " * 10}
        big = {**small, "prompt": "word " * 200}
        astral = {**small, "prompt": "\U0001f600" * 40}  # 40 characters, 480 bytes of escaped JSON, and more
        with client.bundler(max_wait_s=60) as bundler:
            bundler.add(small)
            for job in (big, astral):
                with pytest.raises(JobTooLarge, match="the limit is 500"):
                    bundler.add(job)
        with pytest.raises(JobTooLarge):
            client.submit(astral)
        assert client.redis.hlen(keys.run_submitted_hash(run_name)) == 1
