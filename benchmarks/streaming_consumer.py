"""How fast a streaming consumer loads items, and how much disk a live run needs with delete_after.

Two phases, each with a real ``layertap worker`` process and an embedded Redis (or ``--redis-url``):

* **read**: the worker extracts ``--prompts`` random-token prompts into ``--storage``, then is
  stopped; with nothing else running, ``StreamingHiddenStatesDataset`` reads the run with
  ``verify`` (checksums) and without, ``--repeat`` times each (a consumer group per pass),
  each item collated (copied) as a trainer would; the best pass's tokens/s and GB/s are
  reported. The worker's own pace (first to last result) is reported too: the consumer keeps
  up when its rate is above it.
* **live**: the worker runs again while ``layertap enqueue --max-inflight N --inflight-until
  consumed`` feeds it (``--inflight-until finished`` is the control without back-pressure) and
  the consumer, with ``delete_after``, trains on nothing (``--consumer-delay-x K`` sleeps K times
  the worker's seconds per job after each item: a slow trainer). A thread samples the files
  under the run's folder (and the filesystem's used bytes) every 10 ms; the report has their
  peaks against the in-flight bound (``N`` files, ``N`` x the largest file in bytes) and how
  many files are left (none, when it works).

Usage (CPU, tiny model): ``python benchmarks/streaming_consumer.py --model tiny --prompts 200``;
on a GPU host, see BENCHMARKS.md ("Streaming consumer"). Prints a JSON report (``--json F``
writes it too).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch.utils.data import DataLoader

from layertap.command import layertap_argv
from layertap.producer.client.client import Client
from layertap.producer.dataset import StreamingHiddenStatesDataset, collate
from layertap.producer.dev.redis_server import RedisServer
from layertap.settings import Settings
from layertap.worker.bench.prompts import random_prompts
from layertap.worker.model.shapes import SHAPE_PREFIX, is_shape, shape_config

NAME = "stream-bench"


class DiskPeak(threading.Thread):
    """Samples the bytes and files under ``folder`` and the used bytes of its filesystem every 10 ms."""

    def __init__(self, folder: Path, filesystem: Path):
        super().__init__(daemon=True)
        self.folder, self.filesystem, self.stopped = folder, filesystem, threading.Event()
        self.used_at_start = self.used_bytes()
        self.peak_bytes = self.peak_files = self.largest_file = self.peak_used_over_start = 0

    def used_bytes(self) -> int:
        stat = os.statvfs(self.filesystem)
        return (stat.f_blocks - stat.f_bfree) * stat.f_frsize

    def run(self) -> None:
        while not self.stopped.wait(0.01):
            sizes = []
            for path in self.folder.rglob("*.safetensors") if self.folder.exists() else []:
                with contextlib.suppress(FileNotFoundError):  # removed while we looked
                    sizes.append(path.stat().st_size)
            self.peak_bytes, self.peak_files = max(self.peak_bytes, sum(sizes)), max(self.peak_files, len(sizes))
            self.largest_file = max([self.largest_file, *sizes])
            self.peak_used_over_start = max(self.peak_used_over_start, self.used_bytes() - self.used_at_start)


@contextlib.contextmanager
def worker_process(args: argparse.Namespace, model: str, env: dict[str, str], log: Path) -> Iterator[None]:
    """A ``layertap worker`` serving ``model`` as NAME until the block ends (SIGTERM)."""
    node = f"stream-bench-{os.getpid()}-{time.monotonic_ns()}@{socket.gethostname()}"
    command = layertap_argv("worker", "--model", model, "--name", NAME, "--device",
               args.device, "--dtype", args.dtype, "--layers", args.layers, "--token-budget", str(args.token_budget),
               "--node-name", node, "--loglevel", "WARNING")
    with open(log, "a") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        with Client(Settings(redis_url=env["LAYERTAP_REDIS_URL"])) as client:
            deadline = time.monotonic() + 900
            while node not in client.workers():
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the worker did not come up; see {log}")
                time.sleep(0.2)
        yield
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=120)


def consume(dataset: StreamingHiddenStatesDataset, loader_workers: int, delay_s: float = 0.0) -> dict[str, Any]:
    """Iterate the stream to its end, each item collated into a batch of one (a copy of every
    tensor, so the bytes of a memory-mapped file are really read); tokens, bytes and seconds
    from the first call to the last item."""
    items = dataset if loader_workers == 0 else DataLoader(dataset, batch_size=None, num_workers=loader_workers)
    tokens = nbytes = count = 0
    start = time.perf_counter()
    for item in items:
        batch = collate([item])
        tokens += int(batch["lengths"].sum())
        nbytes += sum(value.numel() * value.element_size() for value in batch.values() if hasattr(value, "numel"))
        count += 1
        if delay_s:
            time.sleep(delay_s)
    seconds = time.perf_counter() - start
    return {"items": count, "tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds),
            "gb_per_s_loaded": round(nbytes / seconds / 1e9, 3), "loader_workers": loader_workers}


def worker_pace(client: Client, run: str, job_ids: list[str]) -> dict[str, Any]:
    results = client.wait(run, job_ids, timeout=3600)
    failed = [r for r in results.values() if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} jobs failed, e.g. {failed[0].error}")
    finished = sorted(r.finished_at for r in results.values())
    seconds = finished[-1] - finished[0]
    tokens = sum(r.num_tokens or 0 for r in results.values())
    return {"jobs": len(results), "tokens": tokens, "seconds_first_to_last_result": round(seconds, 3),
            "seconds_per_job": seconds / max(1, len(results) - 1),
            "tokens_per_s": round(tokens / seconds) if seconds else None}


def vocab_size(model: str) -> int:
    if is_shape(model):
        return shape_config(model[len(SHAPE_PREFIX):]).vocab_size
    return json.loads((Path(model) / "config.json").read_text())["vocab_size"]


def run_bench(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    model = args.model
    if model == "tiny":
        from layertap.worker.model.tiny_model import make_tiny_model

        model = str(make_tiny_model(work / "tiny-model", "qwen3"))
    prompts = random_prompts(args.prompts, args.min_len, args.max_len, vocab_size(model), args.seed)
    storage = Path(args.storage) / f"stream-bench-{os.getpid()}"
    report: dict[str, Any] = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                              "model": args.model, "layers": args.layers, "prompts": args.prompts,
                              "storage": str(storage), "max_inflight": args.max_inflight,
                              "inflight_until": args.inflight_until}
    server = None if args.redis_url else RedisServer(data_dir=work / "redis").start()
    url = args.redis_url or server.url  # type: ignore[union-attr]
    env = {**os.environ, "LAYERTAP_REDIS_URL": url, "LAYERTAP_STORAGE_ROOT": str(storage),
           "LAYERTAP_WORKER__CONCURRENCY": str(args.concurrency), "LAYERTAP_WORKER__COMPILE": str(args.compile).lower()}
    tag = f"{os.getpid()}-{int(time.time())}"
    try:
        with Client(Settings(redis_url=url)) as client:
            read_run = f"stream-read-{tag}"
            with worker_process(args, model, env, work / "worker.log"):
                job_ids = [client.submit({"token_ids": ids, "job_id": f"p{i}"}, model=NAME, run=read_run).job_id
                           for i, ids in enumerate(prompts)]
                client.seal(read_run)
                report["worker"] = worker_pace(client, read_run, job_ids)
            for verify in (True, False):  # the worker is stopped: nothing else runs
                passes = [consume(StreamingHiddenStatesDataset(read_run, redis_url=url, verify=verify,
                                                               group=f"read-verify-{verify}-{index}"),
                                  args.loader_workers) for index in range(args.repeat)]
                best = max(passes, key=lambda part: part["tokens_per_s"])
                label = f"read_verify_{str(verify).lower()}"
                report[label] = {**best, "tokens_per_s_each_pass": [part["tokens_per_s"] for part in passes]}
                print(json.dumps({label: report[label]}), flush=True)
            shutil.rmtree(storage / read_run)  # the live phase starts on an empty folder
            if args.skip_live:
                return report

            live_run = f"stream-live-{tag}"
            rows = work / "live.jsonl"
            rows.write_text("".join(json.dumps({"job_id": f"p{i}", "token_ids": ids}) + "\n"
                                    for i, ids in enumerate(prompts)))
            delay_s = args.consumer_delay_x * report["worker"]["seconds_per_job"]
            disk = DiskPeak(storage / live_run, storage.parent)
            with worker_process(args, model, env, work / "worker.log"):
                disk.start()
                enqueue = subprocess.Popen(
                    layertap_argv("enqueue", "--model", NAME, "--run", live_run, "--file",
                     str(rows), "--quiet", "--max-inflight", str(args.max_inflight), "--inflight-until",
                     args.inflight_until),
                    env=env, stderr=subprocess.DEVNULL)
                dataset = StreamingHiddenStatesDataset(live_run, redis_url=url, delete_after=True, verify=True)
                live = consume(dataset, args.loader_workers, delay_s)
                if enqueue.wait(timeout=300) != 0:
                    raise RuntimeError(f"layertap enqueue exited with {enqueue.returncode}")
                disk.stopped.set()
                disk.join()
            left = [p for p in (storage / live_run).rglob("*") if p.is_file()] if (storage / live_run).exists() else []
            report["live"] = {**live, "consumer_delay_x": args.consumer_delay_x, "delay_s_per_item": round(delay_s, 4),
                              "peak_files": disk.peak_files, "peak_bytes": disk.peak_bytes,
                              "largest_file_bytes": disk.largest_file,
                              "bound_bytes": args.max_inflight * disk.largest_file,
                              "peak_filesystem_used_over_start": disk.peak_used_over_start,
                              "files_left": len(left)}
    finally:
        shutil.rmtree(storage, ignore_errors=True)
        if server is not None:
            server.close()
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="A model folder, shape:<name>, or tiny (built here).")
    parser.add_argument("--layers", default="1,2,3,4")
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--min-len", type=int, default=128)
    parser.add_argument("--max-len", type=int, default=2047)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--token-budget", type=int, default=16384)
    parser.add_argument("--concurrency", type=int, default=64, help="The worker's job threads.")
    parser.add_argument("--compile", action="store_true", help="The worker compiles its model.")
    parser.add_argument("--storage", default="/dev/shm", help="Files go to a new folder under this one.")
    parser.add_argument("--max-inflight", type=int, default=256)
    parser.add_argument("--inflight-until", default="consumed", choices=["consumed", "finished"],
                        help="Live phase: finished is the control without back-pressure from the trainer.")
    parser.add_argument("--consumer-delay-x", type=float, default=0.0,
                        help="Live phase: after each item sleep this many times the worker's seconds per job.")
    parser.add_argument("--loader-workers", type=int, default=0, help="DataLoader worker processes (0: in-process).")
    parser.add_argument("--repeat", type=int, default=3, help="Read phase: passes each way (the best is reported).")
    parser.add_argument("--skip-live", action="store_true", help="Only the read phase.")
    parser.add_argument("--redis-url", default=None, help="Default: an embedded Redis.")
    parser.add_argument("--json", type=Path, help="Write the report here too.")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="stream-bench-") as work:
        report = run_bench(args, Path(work))
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
