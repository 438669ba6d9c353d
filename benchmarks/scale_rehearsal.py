"""A scale rehearsal on one machine: many tiny-model jobs through several workers on one Redis.

    python benchmarks/scale_rehearsal.py --jobs 200000 --workers 4 --report rehearsal.json

Builds a tiny Qwen3 model, starts a private Redis (AOF on, as deployed) and ``workers``
``layertap worker`` processes on the CPU, writes ``jobs`` token-id jobs of 8-32 tokens to a
JSONL file and sends them with one ``layertap enqueue`` (bundles, default back-pressure), then
waits for every job to finish. It reports:

* jobs/s end to end (first job sent to last result), and the enqueue's own jobs/s;
* Redis ``used_memory`` at the start, its peak (sampled every 0.25 s) and at the end, and
  bytes per finished job at the end, after ``layertap run trim`` (the retention's work) and
  after ``layertap run delete``;
* the reconciler's reads per sweep: mid-run the workers are paused (SIGSTOP) holding their
  messages, one :meth:`Reconciler.sweep` runs from here, and the server's output bytes across it
  are divided by the messages held;
* ``Client.wait`` for one job at the end of the run (best of 5, the last job and a middle one);

and it verifies that every job has exactly one ok result on the stream, a status ``ok`` and a
complete file of its own (header job id), before the trim. Exit code 1 if not.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import redis

from layertap.command import layertap_argv
from layertap.producer.client.client import Client
from layertap.producer.client.results import stream_results
from layertap.producer.dev.redis_server import RedisServer
from layertap.protocol import keys
from layertap.protocol.fileformat import MetaKey, read_file_header
from layertap.settings import Settings
from layertap.worker.model.tiny_model import make_tiny_model
from layertap.worker.queue.reconciler import Reconciler

NAME = "rehearsal-qwen3"
RUN = "rehearsal"


def used_memory(client: redis.Redis) -> int:
    return int(client.info("memory")["used_memory"])


class PeakSampler(threading.Thread):
    """Samples ``used_memory`` until stopped; ``peak`` is the largest seen."""

    def __init__(self, url: str, period_s: float = 0.25):
        super().__init__(daemon=True)
        self.client = redis.Redis.from_url(url)
        self.period_s = period_s
        self.peak = 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            self.peak = max(self.peak, used_memory(self.client))
            self.done.wait(self.period_s)


def write_jobs(path: Path, count: int, vocab: int, seed: int) -> None:
    """``count`` distinct token-id jobs (the first three ids spell the index), 8-32 tokens each."""
    rng = random.Random(seed)
    with path.open("w") as out:
        for index in range(count):
            head = [index // (vocab * vocab) % vocab, index // vocab % vocab, index % vocab]
            tail = [rng.randrange(vocab) for _ in range(rng.randint(5, 29))]
            out.write(json.dumps({"token_ids": head + tail}) + "\n")


def reconciler_reads(url: str, client: Client, workers: list[subprocess.Popen]) -> dict[str, float]:
    """One sweep's output bytes with the workers paused holding their messages."""
    raw = redis.Redis.from_url(url)
    for worker in workers:
        os.kill(worker.pid, signal.SIGSTOP)
    try:
        time.sleep(0.5)  # in-flight replies land
        held = raw.hlen(keys.UNACKED_HASH)
        reconciler = Reconciler(raw, client.celery, "rehearsal-bench", interval=1.0, grace=3600.0)
        raw.delete(keys.RECONCILE_LOCK)
        before = int(raw.info("stats")["total_net_output_bytes"])
        reconciler.sweep()
        after = int(raw.info("stats")["total_net_output_bytes"])
        info_reply = int(raw.info("stats")["total_net_output_bytes"]) - after
    finally:
        for worker in workers:
            os.kill(worker.pid, signal.SIGCONT)
        raw.close()
    read = after - before - info_reply
    return {"held_messages": held, "bytes_per_sweep": read, "bytes_per_held_message": round(read / max(held, 1), 1)}


def wait_latency_ms(client: Client, job_ids: list[str]) -> float:
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        client.wait(RUN, job_ids, timeout=60)
        best = min(best, (time.perf_counter() - started) * 1000)
    return round(best, 2)


def verify(client: Client, job_ids: list[str]) -> dict[str, int]:
    """Every job: exactly one ok result on the stream, status ok, and its own complete file."""
    ok_entries: Counter[str] = Counter()
    paths: dict[str, str] = {}
    errors = 0
    for _, result in stream_results(client.redis, RUN):
        if result.ok:
            ok_entries[result.job_id] += 1
            paths[result.job_id] = result.path or ""
        else:
            errors += 1
    statuses = client.redis.hgetall(keys.run_status_hash(RUN))
    bad_files = 0
    for job_id in job_ids:
        try:
            if read_file_header(paths[job_id]).metadata.get(MetaKey.JOB_ID) != job_id:
                bad_files += 1
        except (KeyError, OSError, ValueError):
            bad_files += 1
    return {"jobs": len(job_ids), "without_one_ok_result": sum(ok_entries[j] != 1 for j in job_ids),
            "status_not_ok": sum(statuses.get(j) != "ok" for j in job_ids), "error_results": errors,
            "bad_or_missing_files": bad_files}


def cli(url: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(layertap_argv(*args), env={**os.environ, "LAYERTAP_REDIS_URL": url}, check=True,
                          capture_output=True, text=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=200_000)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=64, help="jobs in flight per worker")
    parser.add_argument("--workdir", type=Path, default=None, help="keep everything here (default: a temp folder)")
    parser.add_argument("--report", type=Path, default=None, help="write the report here (JSON)")
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="layertap-rehearsal-"))
    work.mkdir(parents=True, exist_ok=True)
    model_dir = make_tiny_model(work / "model", "qwen3", num_layers=2, hidden_size=32)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    jobs_file = work / "jobs.jsonl"
    write_jobs(jobs_file, args.jobs, vocab, seed=0)
    report: dict[str, object] = {"jobs": args.jobs, "workers": args.workers, "concurrency": args.concurrency,
                                 "machine": f"{os.cpu_count()} cores", "date": time.strftime("%Y-%m-%d")}
    with RedisServer(data_dir=work / "redis") as server, Client(Settings(redis_url=server.url)) as client:
        env = {**os.environ, "LAYERTAP_REDIS_URL": server.url, "OMP_NUM_THREADS": "1"}
        def worker_argv(index: int) -> list[str]:
            return layertap_argv("worker", "--model", str(model_dir), "--name", NAME, "--device", "cpu",
                                 "--storage-root", str(work / "files"), "--node-name", f"w{index}@rehearsal",
                                 "--concurrency", str(args.concurrency), "--loglevel", "WARNING")

        workers = [subprocess.Popen(worker_argv(index), env=env, stdout=(work / f"w{index}.log").open("w"),
                                    stderr=subprocess.STDOUT) for index in range(args.workers)]
        try:
            deadline = time.monotonic() + 300
            while len([w for w in client.workers().values() if w["model"] == NAME]) < args.workers:
                if time.monotonic() > deadline or any(w.poll() is not None for w in workers):
                    raise RuntimeError(f"the workers did not come up; see {work}/w*.log")
                time.sleep(0.5)
            start_bytes = used_memory(client.redis)
            sampler = PeakSampler(server.url)
            sampler.start()
            started = time.monotonic()
            sent_ids = work / "sent.txt"  # enqueue prints each job id it sends
            enqueue_argv = layertap_argv("enqueue", "--model", NAME, "--run", RUN, "--file", str(jobs_file))
            enqueue = subprocess.Popen(enqueue_argv,
                                       env=env, stdout=sent_ids.open("w"), stderr=(work / "enqueue.log").open("w"))
            reconciler: dict[str, float] | None = None
            while True:
                done = client.redis.hlen(keys.run_status_hash(RUN))
                if enqueue.poll() is not None and "enqueue_s" not in report:
                    report["enqueue_s"] = round(time.monotonic() - started, 1)
                    report["enqueue_jobs_per_s"] = round(args.jobs / report["enqueue_s"])  # type: ignore[operator]
                    if enqueue.returncode != 0:
                        raise RuntimeError(f"enqueue failed; see {work / 'enqueue.log'}")
                if reconciler is None and done >= args.jobs // 2:
                    reconciler = reconciler_reads(server.url, client, workers)
                if done >= args.jobs:
                    break
                if any(w.poll() is not None for w in workers):
                    raise RuntimeError(f"a worker exited; see {work}/w*.log")
                print(f"{done:,} / {args.jobs:,} done, {time.monotonic() - started:.0f}s", file=sys.stderr, flush=True)
                time.sleep(2)
            elapsed = time.monotonic() - started
            if enqueue.wait(timeout=120) != 0:
                raise RuntimeError(f"enqueue failed; see {work / 'enqueue.log'}")
            report.setdefault("enqueue_s", round(elapsed, 1))
            report.setdefault("enqueue_jobs_per_s", round(args.jobs / elapsed))
            sampler.done.set()
            sampler.join()
            end_bytes = used_memory(client.redis)
            job_ids = [line.split()[0] for line in sent_ids.read_text().splitlines() if line.strip()]
            report.update({"seconds": round(elapsed, 1), "jobs_per_s": round(args.jobs / elapsed),
                           "redis_used_memory": {"start": start_bytes, "peak": max(sampler.peak, end_bytes),
                                                 "end": end_bytes},
                           "bytes_per_job_at_end": round((end_bytes - start_bytes) / args.jobs),
                           "reconciler": reconciler})
            if len(job_ids) != args.jobs:
                raise RuntimeError(f"enqueue printed {len(job_ids)} job ids for {args.jobs} jobs")
            report["wait_ms"] = {"last_job": wait_latency_ms(client, job_ids[-1:]),
                                 "middle_job": wait_latency_ms(client, job_ids[len(job_ids) // 2:][:1])}
            report["verified"] = verify(client, job_ids)
            cli(server.url, "run", "trim", RUN)
            after_trim = used_memory(client.redis)
            report["bytes_per_job_after_trim"] = round((after_trim - start_bytes) / args.jobs)
            cli(server.url, "run", "delete", RUN, "--yes")
            report["bytes_per_job_after_delete"] = round((used_memory(client.redis) - start_bytes) / args.jobs)
        finally:
            for worker in workers:
                worker.send_signal(signal.SIGTERM)
            for worker in workers:
                try:
                    worker.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    worker.kill()
    print(json.dumps(report, indent=1))
    if args.report:
        args.report.write_text(json.dumps(report, indent=1))
    verified = report["verified"]
    return 0 if all(value == 0 for key, value in verified.items() if key != "jobs") else 1  # type: ignore[union-attr]


if __name__ == "__main__":
    sys.exit(main())
