"""Ctrl-C on a busy worker (issue 40, item 3), with real Redis, real workers and a tiny real model
whose forward waits while a gate file exists: a warm shutdown finishes the batches in the engine
and hands every other message back to its queue unstarted; a restarted worker runs them, every
job once, none counted twice."""

from __future__ import annotations

import signal
from collections import Counter

from layertap.protocol import keys
from tests.support.blocking import hang_env
from tests.support.jobs import wait_for

MODEL = "tiny-qwen3"
HANDED_BACK = "goes back to its queue unstarted"  # the worker's log line of a handed-back message


def test_ctrl_c_with_a_deep_backlog_hands_back_what_the_engine_has_not_taken(make_worker, private_client,
                                                                            blocking_model, tmp_path):
    """The worker takes every bundle (concurrency 64), but only what fills the engine
    (prepare_ahead_batches 1 x max_batch_jobs 4) holds a place there: at SIGINT, while the engine is
    still blocked, every other bundle is handed back (Celery's reject with requeue); once the
    engine runs, the worker finishes its batches, exits and leaves those bundles in the queue."""
    gate = tmp_path / "gate"
    env = {**hang_env(gate, 600), "LAYERTAP_WORKER__MAX_BATCH_JOBS": "4",
           "LAYERTAP_WORKER__PREPARE_AHEAD_BATCHES": "1"}
    first = make_worker("first@localhost", model_dir=blocking_model, env=env)
    gate.touch()  # the engine's next forward waits until the gate is gone
    run, bundles, per_bundle = "backlog", 10, 8
    with private_client.bundler(max_jobs=per_bundle) as bundler:
        jobs = [bundler.add({"prompt": f"job {i} of the backlog"}, model=MODEL, run=run)
                for i in range(bundles * per_bundle)]
    queue, redis = keys.model_queue(MODEL), private_client.redis
    wait_for(lambda: redis.llen(queue) == 0 and redis.hlen(keys.UNACKED_HASH) == bundles, 60,
             "the worker to take every bundle")
    first.process.send_signal(signal.SIGINT)
    wait_for(lambda: first.log_text().count(HANDED_BACK) >= 1, 60, "the first bundle handed back")
    assert gate.exists() and first.process.poll() is None  # handed back while the engine is still blocked
    gate.unlink()
    first.process.wait(timeout=120)  # Celery's exit code after a SIGINT is 1 (EX_FAILURE), after a SIGTERM 0
    handed_back = first.log_text().count(HANDED_BACK)  # one line each, no traceback
    done_first = {r.job_id for r in private_client.results(run)}
    assert handed_back >= bundles - 2 and redis.llen(queue) == handed_back  # back in the queue, unstarted
    assert len(done_first) == (bundles - handed_back) * per_bundle  # what held a place ran; nothing else

    make_worker("second@localhost", model_dir=blocking_model, env=env)
    results = private_client.wait(run, [job.job_id for job in jobs], timeout=120)
    assert all(result.ok and result.attempt == 1 for result in results.values())  # no start counted twice
    published = Counter(r.job_id for r in private_client.results(run))
    assert set(published) == {job.job_id for job in jobs} and set(published.values()) == {1}  # 0 lost, 0 repeated
