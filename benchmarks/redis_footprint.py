"""Redis bytes per finished job: after the run, after ``layertap run trim``, after ``run delete``.

    python benchmarks/redis_footprint.py --jobs 2000

Starts a private Redis (no AOF), builds a tiny model, starts one real ``layertap worker`` (CPU),
submits ``--jobs`` small jobs of one run (a short prompt and a short ``metadata``) with the
Client and waits for every result. Redis ``used_memory`` (``INFO memory``) and its dataset
and client-buffer parts (``MEMORY STATS``) are read with the worker idle before the run and at
each phase; the difference over the job count is the cost per finished job. Each phase also
prints a per-key-family breakdown: every key (``SCAN``) with its ``MEMORY USAGE`` (all nested
values sampled), grouped by the key with the run name and job ids taken out. Phases:

* **finished**: every job has its result (stream entries inside the retention);
* **trimmed**: ``runs.trim`` (what ``layertap run trim`` and the retention sweep do): what is
  left is what manifest, resume and ``runs`` need;
* **deleted**: ``runs.delete`` (``layertap run delete``).

Before the run, ``--queued`` jobs of ``--queued-tokens`` token ids each are sent to a model no
worker serves, and the bytes per queued job are printed by key family (the queue holds each
job once; there is no second copy), then that queue and its records are removed.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import redis

from layertap.producer.client import runs
from layertap.producer.client.client import Client
from layertap.producer.dev.redis_server import RedisServer
from layertap.protocol import keys
from layertap.settings import Settings

RUN = "footprint"
MODEL = "tiny-qwen3"
JOB_ID = re.compile(r"fp-\d+")


def key_family(key: str) -> str:
    """The key with the run and job ids taken out: ``layertap:attempts:<run>:<job>``."""
    return JOB_ID.sub("<job>", key.replace(RUN, "<run>"))


def breakdown(client: redis.Redis) -> dict[str, tuple[int, int]]:
    """Key family -> (keys, bytes by ``MEMORY USAGE ... SAMPLES 0``)."""
    families: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for key in client.scan_iter(count=1000):
        name = key.decode(errors="replace")
        usage = client.memory_usage(key, samples=0) or 0
        family = families[key_family(name)]
        family[0] += 1
        family[1] += usage
    return {name: (count, size) for name, (count, size) in families.items()}


def memory(client: redis.Redis) -> dict[str, int]:
    """``used_memory`` and its parts from ``MEMORY STATS``: the dataset, client buffers, the rest."""
    time.sleep(0.5)  # let the worker's last acks and events land
    stats = client.memory_stats()
    return {"used_memory": int(client.info("memory")["used_memory"]), "dataset": int(stats["dataset.bytes"]),
            "clients": int(stats["clients.normal"]), "keys": int(stats["keys.count"])}


def report(phase: str, client: redis.Redis, baseline: dict[str, int], jobs: int) -> tuple[int, int]:
    """Print the phase; returns (bytes of the run's keys, dataset bytes)."""
    now = memory(client)
    print(f"\n== {phase}: " + ", ".join(
        f"{name} {value:,} ({value - baseline[name]:+,}, {(value - baseline[name]) / jobs:+,.0f}/job)"
        for name, value in now.items()))
    rows = sorted(breakdown(client).items(), key=lambda item: -item[1][1])
    for family, (count, size) in rows:
        print(f"  {size:>12,} B  {size / jobs:>8,.1f} B/job  {count:>6} key(s)  {family}")
    return sum(size for family, (_, size) in rows if "<run>" in family), now["dataset"]


def queued_footprint(client: Client, raw: redis.Redis, jobs: int, tokens: int) -> None:
    """Print the bytes per queued job by key family, then remove those jobs."""
    import warnings

    from layertap.producer.client.client import NoWorkerWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NoWorkerWarning)
        for index in range(jobs):
            client.submit({"token_ids": list(range(index, index + tokens)), "model": "unserved", "run": "queued",
                           "job_id": f"q-{index:05d}"})
    print(f"{jobs} queued jobs of {tokens} token ids each (no worker serves their model):")
    for family, (count, size) in sorted(breakdown(raw).items(), key=lambda item: -item[1][1]):
        if "unserved" in family or "pending" in family or "queued" in family:
            print(f"  {size:>12,} B  {size / jobs:>8,.1f} B/job  {count:>6} key(s)  {family}")
    runs.delete(client.redis, "queued", force=True)
    raw.delete(keys.pending_sent_zset(keys.model_queue("unserved")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--metadata-bytes", type=int, default=16, help="size of each job's metadata string")
    parser.add_argument("--id-chars", type=int, default=32, help="length of each job id (a content-hash id: 32)")
    parser.add_argument("--queued", type=int, default=100, help="jobs left queued for a model no worker serves")
    parser.add_argument("--queued-tokens", type=int, default=2000, help="token ids in each queued job")
    args = parser.parse_args()
    from layertap.worker.model.tiny_model import make_tiny_model

    with tempfile.TemporaryDirectory() as scratch, RedisServer(appendonly=False) as server:
        model_dir = make_tiny_model(Path(scratch) / "model", "qwen3")
        env = {**os.environ, "LAYERTAP_REDIS_URL": server.url, "LAYERTAP_STORAGE_ROOT": str(Path(scratch) / "files")}
        worker = subprocess.Popen([sys.executable, "-m", "layertap", "worker", "--model", str(model_dir), "--name",
                                   MODEL, "--device", "cpu", "--node-name", "measurer@localhost"],
                                  env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            with Client(Settings(redis_url=server.url)) as client:
                while MODEL not in client.served_models():
                    if worker.poll() is not None:
                        raise SystemExit(f"the worker exited with code {worker.returncode}")
                    time.sleep(0.2)
                raw = redis.Redis.from_url(server.url)
                queued_footprint(client, raw, args.queued, args.queued_tokens)
                baseline = memory(raw)
                print("idle baseline (worker up, no jobs): " + ", ".join(f"{k} {v:,}" for k, v in baseline.items()))
                start = time.perf_counter()
                ids = [client.submit({"prompt": f"short prompt number {index}", "model": MODEL, "run": RUN,
                                      "job_id": f"fp-{index:0{args.id_chars - 3}d}",
                                      "metadata": f"{index:0{args.metadata_bytes}d}"}).job_id
                       for index in range(args.jobs)]
                results = client.wait(RUN, ids, timeout=max(120.0, args.jobs / 5))
                elapsed = time.perf_counter() - start
                assert all(result.ok for result in results.values()), "some job failed"
                print(f"{args.jobs} jobs finished in {elapsed:.1f} s ({args.jobs / elapsed:.0f} jobs/s)")
                phases = {"finished": report("finished", raw, baseline, args.jobs)}
                trimmed = runs.trim(client.redis, RUN)
                print(f"\n(run trim dropped {trimmed} stream entries)")
                phases["trimmed"] = report("trimmed", raw, baseline, args.jobs)
                runs.delete(client.redis, RUN)
                phases["deleted"] = report("deleted", raw, baseline, args.jobs)
                left = phases["deleted"][1]
                print(f"\nper finished job ({args.jobs} jobs): the run's keys (MEMORY USAGE) / dataset bytes "
                      "freed by `run delete` (what a constant, unowned rest does not blur)")
                for phase, (owned, dataset) in phases.items():
                    print(f"  {phase:>9}: {owned / args.jobs:8,.1f} B  /  {(dataset - left) / args.jobs:8,.1f} B")
                raw.close()
        finally:
            worker.terminate()
            worker.wait(60)


if __name__ == "__main__":
    main()
