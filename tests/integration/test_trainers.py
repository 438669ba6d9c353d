"""Streaming trainers that start late, use DataLoader workers, or die (layertap.producer.files.streaming), with
a real Redis, real workers and real trainer processes: a trainer that starts after the retention
trimmed the run gets every sample from the run's ledger (and unblocks an enqueue waiting for it),
or is told at once how many it cannot get; DataLoader workers end together, every time; and a
trainer with DataLoader workers SIGKILLed mid-run loses no sample."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from torch.utils.data import DataLoader

from layertap.producer.client import runs
from layertap.producer.dataset import StreamingHiddenStatesDataset, collate
from layertap.protocol import keys
from layertap.settings import Settings
from tests.integration.test_streaming import MODEL, files_under, submit, token_jobs
from tests.support.processes import cli


def test_a_late_trainer_gets_every_trimmed_sample_from_the_ledger(workers, redis_server, client, run_name,
                                                                  storage_root, caplog):
    jobs = token_jobs(10, seed=11)
    job_ids = submit(client, run_name, [*jobs, {"job_id": "bad-token", "token_ids": [5, 10**6]}])
    client.wait(run_name, job_ids, timeout=120)
    assert runs.trim(client.redis, run_name) == 11  # the retention, before any trainer's group existed

    late = StreamingHiddenStatesDataset(run_name, redis_url=redis_server.url, delete_after=True, read_count=3,
                                        time_limit_s=90, settings=Settings(storage_root=storage_root))
    seen = [job_id for batch in late.loader(batch_size=2, num_workers=2) for job_id in batch["job_ids"]]
    assert Counter(seen) == Counter(job["job_id"] for job in jobs)  # every ok sample, once, across two workers
    assert late.counts.yielded == len(seen)  # the DataLoader workers' counts, summed in this process
    assert client.redis.hlen(keys.run_consumed_hash(run_name, "train")) == 11  # the error too
    assert files_under(storage_root / run_name) == []

    # a group later still: the first one removed every file; it is told at once, with the count
    later = StreamingHiddenStatesDataset(run_name, group="later", redis_url=redis_server.url, time_limit_s=90)
    with caplog.at_level(logging.ERROR, logger="layertap.producer.client.recovery"):
        items = iter(later)
        assert next(items, None) is None
    assert "10 recovered ok job(s) have no file here" in caplog.text
    assert (later.counts.recovered, later.counts.unrecoverable) == (11, 10)
    assert (later.counts.missing, later.counts.errors, later.counts.yielded) == (10, 1, 0)


def test_a_late_trainer_unblocks_an_enqueue_waiting_for_it(workers, redis_server, client, run_name, tmp_path,
                                                          storage_root):
    jobs = token_jobs(12, seed=12)
    rows = tmp_path / "jobs.jsonl"
    rows.write_text("".join(json.dumps(job) + "\n" for job in jobs))
    enqueue = subprocess.Popen(cli("enqueue", "--model", MODEL, "--run", run_name, "--file", str(rows), "--quiet",
                                   "--max-inflight", "4", "--inflight-until", "consumed"),
                               env={**os.environ, "LAYERTAP_REDIS_URL": redis_server.url},
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while client.redis.hlen(keys.run_status_hash(run_name)) < 4:  # sent 4, all final: it waits for a trainer
        assert time.monotonic() < deadline and enqueue.poll() is None, "the first 4 jobs did not finish"
        time.sleep(0.05)
    assert runs.trim(client.redis, run_name) == 4  # the retention window passes before the trainer starts

    seen = [item["job_id"] for item in StreamingHiddenStatesDataset(
        run_name, redis_url=redis_server.url, delete_after=True, time_limit_s=120,
        settings=Settings(storage_root=storage_root))]
    assert enqueue.wait(timeout=60) == 0, enqueue.stderr.read()
    assert Counter(seen) == Counter(job["job_id"] for job in jobs)


def test_dataloader_workers_end_together_every_time(workers, redis_server, client, run_name):
    job_ids = submit(client, run_name, token_jobs(24, seed=13))
    client.wait(run_name, job_ids, timeout=120)
    for attempt in range(10):  # one new group per pass over the same finished run; a worker reads 8 at a time
        dataset = StreamingHiddenStatesDataset(run_name, group=f"pass{attempt}", redis_url=redis_server.url,
                                               read_count=8, shuffle_buffer=4 * (attempt % 4 >= 2))
        loader = (dataset.loader(batch_size=2, num_workers=2) if attempt % 2 else
                  DataLoader(dataset, batch_size=2, num_workers=2, collate_fn=collate))
        seen: list[str] = []
        thread = threading.Thread(target=lambda: seen.extend(j for batch in loader for j in batch["job_ids"]),
                                  daemon=True)
        thread.start()
        thread.join(timeout=120)  # no time limit on the dataset: a worker left waiting hangs the pass
        assert not thread.is_alive(), f"pass {attempt} hung"
        assert Counter(seen) == Counter(job_ids), attempt
        stream = keys.results_stream(run_name)
        assert client.redis.xpending(stream, f"pass{attempt}")["pending"] == 0


TRAINER = """
import sys, time
from layertap.producer.dataset import StreamingHiddenStatesDataset
from layertap.settings import Settings
url, run, trained, root = sys.argv[1:5]
dataset = StreamingHiddenStatesDataset(run, redis_url=url, delete_after=True, read_count=2, time_limit_s=120,
                                       settings=Settings(storage_root=root))
with open(trained, "a") as out:
    for batch in dataset.loader(batch_size=2, num_workers=2):
        time.sleep(0.2)  # a training step
        out.write(" ".join(batch["job_ids"]) + "\\n")
        out.flush()
"""


def trained_ids(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


def test_a_killed_trainer_with_dataloader_workers_loses_no_sample(workers, redis_server, client, run_name,
                                                                  storage_root, tmp_path):
    job_ids = submit(client, run_name, token_jobs(24, seed=14))
    client.wait(run_name, job_ids, timeout=120)
    trained = tmp_path / "trained.txt"
    argv = [sys.executable, "-c", TRAINER, redis_server.url, run_name, str(trained), str(storage_root)]
    first = subprocess.Popen(argv, start_new_session=True, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while len(trained_ids(trained)) < 6:  # three steps done, more batches prefetched by both workers
        assert time.monotonic() < deadline and first.poll() is None, first.stderr.read() if first.poll() else ""
        time.sleep(0.02)
    os.killpg(first.pid, signal.SIGKILL)  # the trainer and its DataLoader workers
    first.wait()
    before = set(trained_ids(trained))
    assert len(before) < len(job_ids)

    again = subprocess.run(argv, capture_output=True, text=True, timeout=180)  # the same group and consumer names
    assert again.returncode == 0, again.stderr
    assert set(trained_ids(trained)) == set(job_ids)  # every sample trained at least once
    assert files_under(storage_root / run_name) == []
    assert client.redis.hlen(keys.run_consumed_hash(run_name, "train")) == len(job_ids)
