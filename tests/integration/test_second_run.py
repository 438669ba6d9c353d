"""A second run through every fault of issue 22 at once, on one run with real processes: the
checkpoint rewritten in place under finished files, an enqueue into a Redis at ``maxmemory``,
a trainer that starts after the retention trimmed the run, and a trainer with DataLoader
workers SIGKILLed mid-run with ``delete_after``. Its last line counts what was lost or stale in
each: all zeros, or the test fails."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter

import torch

from layertap.producer.client import runs
from layertap.producer.dataset import StreamingHiddenStatesDataset
from layertap.producer.files.reader import load_hidden_states
from layertap.protocol import keys
from layertap.settings import Settings
from tests.integration.test_file_identity import rewrite_checkpoint
from tests.integration.test_streaming import files_under, token_jobs
from tests.integration.test_trainers import TRAINER, trained_ids
from tests.support.jobs import ORPHAN_TIMEOUT, wait_for
from tests.support.processes import cli, run_through_full_redis
from tests.support.reference import reference_states

MODEL = "tiny-ck"
LAYERS = [0, 2, 4]


def latest_by(client, run: str, job_ids: list[str], worker: str, timeout: float) -> dict:
    """Each job's latest result once it comes from ``worker``."""
    wait_for(lambda: all(getattr(client.latest(run).get(job_id), "worker", None) == worker for job_id in job_ids),
             timeout, f"every job answered again by {worker}")
    latest = client.latest(run)
    return {job_id: latest[job_id] for job_id in job_ids}


def test_a_second_run_through_every_fault_loses_nothing_and_serves_nothing_stale(
        make_worker, private_client, private_redis, tiny_models, run_name, tmp_path):
    client, storage = private_client, make_worker.storage
    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(tiny_models["qwen3"], checkpoint)
    jobs = [{**job, "layers": LAYERS} for job in token_jobs(10, seed=21)]
    first = make_worker("first@localhost", model_dir=checkpoint, name=MODEL)
    ids = [client.submit(job, model=MODEL, run=run_name).job_id for job in jobs]
    assert all(result.ok for result in client.wait(run_name, ids, timeout=120).values())
    first.stop()

    # 1. The checkpoint is rewritten in place; the same jobs again: every file computed anew
    rewrite_checkpoint(checkpoint, seed=22)
    make_worker("second@localhost", model_dir=checkpoint, name=MODEL)
    for job in jobs:
        client.submit(job, model=MODEL, run=run_name)
    again = latest_by(client, run_name, ids, "second@localhost", 120)
    stale = sum(result.cached or not torch.allclose(
        load_hidden_states(result.path)["hidden_states"].float(),
        reference_states(str(checkpoint), job["token_ids"], LAYERS), atol=1e-5, rtol=1e-5)
        for job, result in zip(jobs, again.values()))

    # 2. More rows enqueued into a Redis at maxmemory: the enqueue waits it out, nothing ends lost
    rows = tmp_path / "more.jsonl"
    more = token_jobs(8, seed=23)
    rows.write_text("".join(json.dumps({**job, "job_id": f"m{job['job_id']}"}) + "\n" for job in more))
    enqueue = run_through_full_redis(cli("enqueue", "--model", MODEL, "--run", run_name, "--file", str(rows), "-q",
                                         "--layers", ",".join(map(str, LAYERS))),
                                     {**os.environ, "LAYERTAP_REDIS_URL": private_redis.url}, client.redis)
    assert enqueue.returncode == 0 and "Redis refuses writes" in enqueue.stderr, enqueue.stderr[-2000:]
    every = ids + [f"m{job['job_id']}" for job in more]
    client.wait(run_name, every, timeout=120)
    time.sleep(3 * ORPHAN_TIMEOUT)  # reconciler sweeps pass over the run's old pending records
    statuses = client.redis.hgetall(keys.run_status_hash(run_name))
    lost = sum(statuses.get(job_id) != "ok" for job_id in every)

    # 3. The retention trims the run before any trainer: a late trainer still gets every sample
    runs.trim(client.redis, run_name)
    late = StreamingHiddenStatesDataset(run_name, redis_url=private_redis.url, group="late", time_limit_s=180,
                                        settings=Settings(storage_root=storage))
    seen = Counter(job_id for batch in late.loader(batch_size=4, num_workers=2) for job_id in batch["job_ids"])
    late_lost = len(set(every) - set(seen))

    # 4. A trainer with DataLoader workers and delete_after, SIGKILLed mid-run, then run again
    trained = tmp_path / "trained.txt"
    argv = [sys.executable, "-c", TRAINER, private_redis.url, run_name, str(trained), str(storage)]
    killed = subprocess.Popen(argv, start_new_session=True, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: len(trained_ids(trained)) >= 6 or killed.poll() is not None, 180, "a few training steps")
    assert killed.poll() is None, killed.stderr.read()
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait()
    rerun = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    killed_lost = len(set(every) - set(trained_ids(trained)))
    left = files_under(storage / run_name)

    print(f"second run: checkpoint rewritten in place ({len(ids)} jobs, {stale} stale); Redis at maxmemory "
          f"during enqueue ({len(every)} jobs, {lost} lost); late trainer ({len(set(seen))} of {len(every)}, "
          f"{late_lost} lost); DataLoader workers killed ({len(set(trained_ids(trained)))} of {len(every)} "
          f"trained, {killed_lost} lost, {len(left)} files left)")
    assert (stale, lost, late_lost, killed_lost, left) == (0, 0, 0, 0, [])
