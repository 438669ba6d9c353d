"""How fast one ``layertap enqueue`` puts jobs into Redis.

    python benchmarks/producer_rate.py --jobs 20000 --tokens 1000

Starts a private Redis (no persistence), writes a JSONL file of ``jobs`` prompts of about
``tokens`` tokens each (``Job.estimated_tokens``: 4 characters a token), and times one
``layertap enqueue --file`` process into it (no worker: the jobs stay queued), from its
start to its exit, Python start-up included. Prints jobs/s and the messages it made (one
per bundle; ``--max-jobs 1`` sends every job alone), then checks that every job is in the
run's ledger, and the enqueue's own CPU seconds (the machine may be shared) and the load
average. Bundling comes from the ``bundle`` settings (``LAYERTAP_BUNDLE__*``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

from layertap.producer.dev.redis_server import RedisServer
from layertap.protocol import keys
from layertap.protocol.schema import CHARS_PER_TOKEN

MODEL = "bench-producer"
RUN = "producer-rate"
WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo")


def write_prompts(path: Path, jobs: int, tokens: int) -> int:
    """A JSONL file of ``jobs`` distinct prompts of ``tokens * CHARS_PER_TOKEN`` characters; its bytes."""
    rng = random.Random(0)
    with open(path, "w") as handle:
        for index in range(jobs):
            words: list[str] = [f"row {index}:"]
            length = len(words[0])
            while length < tokens * CHARS_PER_TOKEN:
                words.append(rng.choice(WORDS))
                length += len(words[-1]) + 1
            handle.write(json.dumps({"prompt": " ".join(words)[:tokens * CHARS_PER_TOKEN]}) + "\n")
    return path.stat().st_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=20000)
    parser.add_argument("--tokens", type=int, default=1000, help="tokens per prompt (estimated)")
    parser.add_argument("--max-jobs", type=int, default=None, help="LAYERTAP_BUNDLE__MAX_JOBS for the enqueue")
    parser.add_argument("--max-tokens", type=int, default=None, help="LAYERTAP_BUNDLE__MAX_TOKENS for the enqueue")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder, RedisServer(appendonly=False) as server:
        rows = Path(folder) / "prompts.jsonl"
        size = write_prompts(rows, args.jobs, args.tokens)
        env = {**os.environ, "LAYERTAP_REDIS_URL": server.url, "LAYERTAP_ENQUEUE__MAX_INFLIGHT": str(10 * args.jobs)}
        if args.max_jobs is not None:
            env["LAYERTAP_BUNDLE__MAX_JOBS"] = str(args.max_jobs)
        if args.max_tokens is not None:
            env["LAYERTAP_BUNDLE__MAX_TOKENS"] = str(args.max_tokens)
        command = [sys.executable, "-m", "layertap", "enqueue", "--model", MODEL, "--run", RUN, "--file", str(rows),
                   "--quiet"]
        start, cpu_before = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        seconds, cpu_after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu_s = (cpu_after.ru_utime - cpu_before.ru_utime) + (cpu_after.ru_stime - cpu_before.ru_stime)
        if done.returncode != 0:
            raise SystemExit(f"enqueue failed ({done.returncode}): {done.stderr[-2000:]}")
        client = redis.Redis.from_url(server.url)
        submitted, messages = client.hlen(keys.run_submitted_hash(RUN)), client.llen(keys.model_queue(MODEL))
        assert submitted == args.jobs, f"{submitted} of {args.jobs} jobs in the run's ledger"
        print(json.dumps({"jobs": args.jobs, "tokens_per_job": args.tokens, "file_mib": round(size / 2**20, 1),
                          "seconds": round(seconds, 2), "jobs_per_s": round(args.jobs / seconds, 1),
                          "enqueue_cpu_s": round(cpu_s, 2), "jobs_per_cpu_s": round(args.jobs / cpu_s, 1),
                          "load_average_1m": os.getloadavg()[0],
                          "messages": messages, "jobs_per_message": round(args.jobs / max(1, messages), 1),
                          "redis_used_memory_mib": round(client.info("memory")["used_memory"] / 2**20, 1)}))


if __name__ == "__main__":
    main()
