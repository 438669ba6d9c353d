"""Training from a live run (layertap.producer.files.streaming) with a real Redis and real workers: consumers
(threads, DataLoader workers, torch.distributed ranks) split a run with no duplicates and no
gaps; a SIGKILLed consumer's entries are finished by another while a slow live one's are not
taken from it; a restart with the same group continues and another group reads it all; a Redis
crash mid-stream loses nothing; ``delete_after`` leaves no files, even for a job re-run after it
was trained on; and with ``--inflight-until consumed`` the files on disk stay under the
in-flight limit while the consumer is ten times slower than the worker."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from layertap.producer.client.client import Client
from layertap.producer.dataset import HiddenStatesDataset, StreamingHiddenStatesDataset, collate
from layertap.producer.dev.redis_server import RedisServer, free_port
from layertap.producer.files.manifest import entry_from_file
from layertap.protocol import keys
from layertap.settings import Settings
from tests.support.processes import WorkerProcess, cli

MODEL = "tiny-qwen3"
MAX_INFLIGHT = 6


def token_jobs(count: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"job_id": f"j{i:03d}", "token_ids": [rng.randrange(1, 700) for _ in range(rng.randint(8, 48))]}
            for i in range(count)]


def submit(client, run: str, jobs: list[dict]) -> list[str]:
    ids = [client.submit(job, model=MODEL, run=run).job_id for job in jobs]
    client.seal(run)
    return ids


def stream(redis_server, run: str, **options) -> StreamingHiddenStatesDataset:
    return StreamingHiddenStatesDataset(run, redis_url=redis_server.url, time_limit_s=60, **options)


def files_under(folder: Path) -> list[Path]:
    return [path for path in folder.rglob("*") if path.is_file()] if folder.exists() else []


def test_two_consumers_split_a_live_run(workers, redis_server, client, run_name):
    jobs = token_jobs(40)
    bad = {"job_id": "bad-token", "token_ids": [5, 10**6]}  # outside the vocabulary: an error result
    consumers = {name: stream(redis_server, run_name, consumer=name, read_count=4, shuffle_buffer=3)
                 for name in ("a", "b")}
    taken: dict[str, list[dict]] = {name: [] for name in consumers}
    threads = [threading.Thread(target=lambda n=name: taken[n].extend(consumers[n])) for name in consumers]
    for thread in threads:
        thread.start()  # before anything is submitted: they follow the run as it grows
    sent = submit(client, run_name, jobs[:20] + [bad] + jobs[20:])
    for thread in threads:
        thread.join(timeout=90)
        assert not thread.is_alive()

    got = {name: [item["job_id"] for item in items] for name, items in taken.items()}
    assert got["a"] and got["b"]  # both took a share
    every = got["a"] + got["b"]
    assert Counter(every) == Counter(job["job_id"] for job in jobs)  # no duplicate, no gap, no error result
    assert sum(ds.counts.errors for ds in consumers.values()) == 1
    assert sum(ds.counts.yielded for ds in consumers.values()) == 40
    assert len(sent) == 41 and client.redis.hlen(keys.run_consumed_hash(run_name, "train")) == 41  # errors too
    assert client.redis.xpending(keys.results_stream(run_name), "train")["pending"] == 0

    # the same items as the offline dataset, and they batch with the same collate
    items = {item["job_id"]: item for item in taken["a"] + taken["b"]}
    paths = {r.job_id: r.path for r in client.latest(run_name).values() if r.ok}
    offline = HiddenStatesDataset([entry_from_file(job_id, paths[job_id]) for job_id in sorted(items)])
    for index, job_id in enumerate(sorted(items)):
        expected = offline[index]
        assert sorted(items[job_id]) == sorted(expected)
        for name, value in expected.items():
            assert value == items[job_id][name] if name == "job_id" else torch.equal(value, items[job_id][name])
    batch = collate([items["j000"], items["j001"]])
    assert batch["hidden_states"].shape[:2] == batch["attention_mask"].shape


def test_options_select_layers_cast_and_cut_as_offline(workers, redis_server, client, run_name):
    jobs = token_jobs(6, seed=9)
    job_ids = submit(client, run_name, jobs)
    paths = {r.job_id: r.path for r in client.wait(run_name, job_ids, timeout=120).values()}
    options = {"layers": [4, 1], "dtype": torch.float16, "max_length": 10}
    items = {item["job_id"]: item for item in stream(redis_server, run_name, **options)}
    offline = HiddenStatesDataset([entry_from_file(job_id, paths[job_id]) for job_id in job_ids], **options)
    for index, job_id in enumerate(job_ids):
        assert items[job_id]["hidden_states"].shape == (min(10, len(jobs[index]["token_ids"])), 2, 64)
        assert items[job_id]["hidden_states"].dtype == torch.float16
        assert all(torch.equal(value, items[job_id][name])
                   for name, value in offline[index].items() if name != "job_id")
    with pytest.raises(ValueError, match="not \\[7\\]"):
        next(iter(stream(redis_server, run_name, group="other", layers=[7])))


VICTIM = """
import sys, time
from layertap.producer.dataset import StreamingHiddenStatesDataset
url, run = sys.argv[1], sys.argv[2]
for item in StreamingHiddenStatesDataset(run, redis_url=url, consumer="victim", read_count=8, claim_idle_s=2):
    print(item["job_id"], flush=True)
    time.sleep(0.3)
"""


def test_a_killed_consumers_entries_are_finished_by_another(workers, redis_server, client, run_name):
    job_ids = submit(client, run_name, token_jobs(30, seed=1))
    client.wait(run_name, job_ids, timeout=120)
    victim = subprocess.Popen([sys.executable, "-c", VICTIM, redis_server.url, run_name],
                              stdout=subprocess.PIPE, text=True)
    printed = [victim.stdout.readline().strip() for _ in range(3)]
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait()
    stream_key = keys.results_stream(run_name)
    held = client.redis.xpending_range(stream_key, "train", min="-", max="+", count=100, consumername="victim.r0.w0")
    assert len(held) >= 5  # read 8, finished 2 (the third was yielded, not finished)

    survivor = stream(redis_server, run_name, consumer="survivor", claim_idle_s=2)
    taken = [item["job_id"] for item in survivor]

    assert survivor.counts.claimed >= len(held)
    assert set(taken) | set(printed[:2]) == set(job_ids)  # nothing lost
    assert Counter(taken)[printed[2]] <= 1 and max(Counter(taken).values()) == 1
    assert not set(taken) & set(printed[:2])  # what the victim finished is not given again
    assert client.redis.xpending(stream_key, "train")["pending"] == 0


def test_a_slow_live_consumers_entries_are_not_taken_from_it(workers, redis_server, client, run_name):
    job_ids = submit(client, run_name, token_jobs(12, seed=6))
    client.wait(run_name, job_ids, timeout=120)
    slow = stream(redis_server, run_name, consumer="slow", read_count=6, claim_idle_s=1)
    fast = stream(redis_server, run_name, consumer="fast", read_count=1, claim_idle_s=1)
    slow_ids: list[str] = []

    def train_slowly() -> None:
        for item in slow:
            slow_ids.append(item["job_id"])
            time.sleep(0.4)  # holds its other entries for longer than claim_idle_s

    thread = threading.Thread(target=train_slowly)
    thread.start()
    time.sleep(0.3)  # it has read its six
    fast_ids = [item["job_id"] for item in fast]
    thread.join(timeout=60)
    assert len(slow_ids) == 6 and Counter(slow_ids + fast_ids) == Counter(job_ids)
    assert slow.counts.claimed == fast.counts.claimed == 0  # its heartbeat kept them


RANK = """
import sys, torch.distributed as dist
from layertap.producer.dataset import StreamingHiddenStatesDataset
url, run = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
dataset = StreamingHiddenStatesDataset(run, redis_url=url, read_count=2)
print(dataset.consumer_name(), *(item["job_id"] for item in dataset))
dist.destroy_process_group()
"""


def test_each_distributed_rank_is_its_own_consumer(workers, redis_server, client, run_name):
    job_ids = submit(client, run_name, token_jobs(16, seed=7))
    client.wait(run_name, job_ids, timeout=120)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    ranks = [subprocess.Popen([sys.executable, "-c", RANK, redis_server.url, run_name], env={**env, "RANK": str(rank)},
                              stdout=subprocess.PIPE, text=True) for rank in range(2)]
    lines = [rank.communicate(timeout=120)[0].split() for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0]
    assert [line[0] for line in lines] == ["trainer.r0.w0", "trainer.r1.w0"]
    assert Counter(lines[0][1:] + lines[1][1:]) == Counter(job_ids)


def test_restart_with_the_same_group_continues_and_another_group_reads_it_all(workers, redis_server, client, run_name):
    job_ids = submit(client, run_name, token_jobs(20, seed=2))
    first = [item["job_id"] for item in stream(redis_server, run_name, group="g", read_count=8, max_items=5)]
    assert len(first) == 5
    rest = [item["job_id"] for item in stream(redis_server, run_name, group="g", read_count=8)]
    assert Counter(first + rest) == Counter(job_ids)
    other_group = [item["job_id"] for item in stream(redis_server, run_name, group="h")]
    assert Counter(other_group) == Counter(job_ids)  # each group trains on the whole run once


def test_delete_after_leaves_no_files(workers, redis_server, client, run_name, storage_root):
    job_ids = submit(client, run_name, token_jobs(24, seed=3))
    dataset = stream(redis_server, run_name, delete_after=True, settings=Settings(storage_root=storage_root),
                     shuffle_buffer=4)
    loader = DataLoader(dataset, batch_size=4, num_workers=2, collate_fn=collate)
    seen = [job_id for batch in loader for job_id in batch["job_ids"]]
    assert Counter(seen) == Counter(job_ids)
    assert files_under(storage_root / run_name) == []  # no file, no lock left
    assert client.redis.hlen(keys.run_consumed_hash(run_name, "train")) == len(job_ids)

    # a job sent again after it was trained on: the worker writes its file again and publishes a
    # second ok result; the group does not yield it twice and removes that file too
    again = client.submit(token_jobs(1, seed=3)[0], model=MODEL, run=run_name)
    deadline = time.monotonic() + 60
    while sum(r.job_id == again.job_id for r in client.results(run_name)) < 2:
        assert time.monotonic() < deadline, "no second result"
        time.sleep(0.05)
    assert len(files_under(storage_root / run_name)) == 2  # the file and its lock, written again
    rerun = stream(redis_server, run_name, delete_after=True, settings=Settings(storage_root=storage_root))
    assert list(rerun) == [] and rerun.counts.duplicates == 1
    assert files_under(storage_root / run_name) == []


def worker_seconds_per_job(client, run: str) -> float:
    """The worker's own pace: time between its first and last result over a backlog of jobs."""
    job_ids = submit(client, run, token_jobs(16, seed=4))
    finished = sorted(r.finished_at for r in client.wait(run, job_ids, timeout=120).values())
    return (finished[-1] - finished[0]) / (len(finished) - 1)


class DiskSampler(threading.Thread):
    """Counts data files and lock files under a folder every 2 ms; keeps the peaks."""

    def __init__(self, folder: Path):
        super().__init__(daemon=True)
        self.folder, self.stopped = folder, threading.Event()
        self.peak_data = self.peak_locks = 0

    def run(self) -> None:
        while not self.stopped.wait(0.002):
            names = [path.name for path in files_under(self.folder)]
            locks = sum(name.endswith(".lock") for name in names)
            self.peak_data, self.peak_locks = max(self.peak_data, len(names) - locks), max(self.peak_locks, locks)


def test_in_flight_bound_holds_on_disk_with_a_slow_consumer(workers, redis_server, client, run_name, storage_root,
                                                            tmp_path):
    delay = 10 * max(worker_seconds_per_job(client, f"{run_name}-pace"), 0.005)
    jobs = token_jobs(50, seed=5)
    rows = tmp_path / "jobs.jsonl"
    rows.write_text("".join(json.dumps(job) + "\n" for job in jobs))
    env = {**os.environ, "LAYERTAP_REDIS_URL": redis_server.url}
    sampler = DiskSampler(storage_root / run_name)
    sampler.start()
    enqueue = subprocess.Popen(cli("enqueue", "--model", MODEL, "--run", run_name, "--file", str(rows), "--quiet",
                                   "--max-inflight", str(MAX_INFLIGHT), "--inflight-until", "consumed"),
                               env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seen = []
    trainer = stream(redis_server, run_name, delete_after=True, settings=Settings(storage_root=storage_root),
                     read_count=2)
    for item in trainer:
        seen.append(item["job_id"])
        time.sleep(delay)  # a trainer ten times slower than the worker
    sampler.stopped.set()
    sampler.join()
    assert enqueue.wait(timeout=60) == 0, enqueue.stderr.read()

    assert Counter(seen) == Counter(job["job_id"] for job in jobs)
    assert sampler.peak_data <= MAX_INFLIGHT and sampler.peak_locks <= MAX_INFLIGHT
    assert sampler.peak_data >= MAX_INFLIGHT - 2  # the worker did run ahead up to the limit
    assert files_under(storage_root / run_name) == []


def test_a_redis_restart_mid_stream_loses_nothing(tiny_models, tmp_path):
    with RedisServer(data_dir=tmp_path / "redis") as server, Client(Settings(redis_url=server.url)) as private:
        worker = WorkerProcess(tiny_models["qwen3"], MODEL, server.url, tmp_path / "files", node="stream-restart@local",
                               log_path=tmp_path / "worker.log").start()
        try:
            job_ids = submit(private, "restart", token_jobs(20, seed=8))
            private.wait("restart", job_ids, timeout=120)
            seen: list[str] = []
            for item in StreamingHiddenStatesDataset("restart", redis_url=server.url, read_count=4, time_limit_s=90,
                                                     settings=Settings(storage_root=tmp_path / "files")):
                seen.append(item["job_id"])
                if len(seen) == 5:  # Redis crashes and is back 2 s later (AOF, appendfsync always)
                    server.kill()
                    threading.Timer(2.0, server.start).start()
        finally:
            worker.stop()
    assert set(seen) == set(job_ids) and len(seen) <= len(job_ids) + 1  # at most the item in hand again


def test_streaming_is_one_pass(redis_server):
    with pytest.raises(ValueError, match="one pass"):
        StreamingHiddenStatesDataset("any", redis_url=redis_server.url, epochs=2)
