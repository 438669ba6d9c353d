"""Conversations per second of ``layertap regenerate`` at several concurrency levels, against the
small real chat server of ``tests.support.chat_server`` on a tiny model (CPU), and the overhead
against a bare async loop (httpx2, the same requests, the same concurrency, no store, no walking).

The regenerate side is the command's own loop (``Regenerator`` with its store, fsync per row)
run in-process, so the comparison is of the loops; the command's start-up (imports, reading the
source) is printed once, apart. Rounds alternate bare and regenerate and the best of each is
kept, so a load spike on a shared machine does not land on one side only. The client's own CPU
time per conversation (``time.process_time`` of this process; the server is another process) is
printed too: on a loaded machine it is the steadier measure of what the command adds.

    PYTHONPATH=. python benchmarks/regenerate_rate.py [--conversations 64] [--levels 1,4,16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import httpx2

from layertap.command import layertap_argv
from layertap.producer.ingest.enqueue import plan_jobs
from layertap.producer.ingest.formats import RowConverter
from layertap.producer.ingest.sources import open_source
from layertap.producer.regen.endpoint import ChatEndpoint
from layertap.producer.regen.runner import Regenerator, conversations
from layertap.producer.regen.store import OutputStore
from tests.support.chat_server import small_server


async def bare_loop(url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int) -> float:
    """Seconds for one chat completion per prompt, ``concurrency`` at a time, answers discarded
    (the answers are parsed as JSON, as any client must)."""
    slots = asyncio.Semaphore(concurrency)
    async with httpx2.AsyncClient(base_url=url, timeout=600) as client:
        async def one(text: str) -> None:
            async with slots:
                response = await client.post("/chat/completions", json={
                    "model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                    "return_token_ids": True})
                response.raise_for_status()
                response.json()
        start = time.perf_counter()
        await asyncio.gather(*(one(text) for text in prompts))
        return time.perf_counter() - start


async def regenerate_loop(url: str, model: str, chats: Path, out: Path, concurrency: int, max_tokens: int) -> float:
    """Seconds for ``layertap regenerate``'s loop over ``chats`` into a fresh ``out``."""
    sampling = {"max_tokens": max_tokens, "return_token_ids": True}
    with OutputStore(out) as store:
        async with ChatEndpoint(url, model, sampling, max_connections=concurrency) as endpoint:
            regenerator = Regenerator(endpoint, store, {"endpoint": url, "model": model}, concurrency=concurrency)
            start = time.perf_counter()
            planned = plan_jobs(open_source(chats).rows, RowConverter(), {"model": model})
            counts = await regenerator.run(conversations(planned, 1))
            seconds = time.perf_counter() - start
    assert counts.failed == 0, counts
    return seconds


def command_start_seconds() -> float:
    """Wall time of ``layertap regenerate --help``: the command's start-up, paid once per run."""
    start = time.perf_counter()
    subprocess.run(layertap_argv("regenerate", "--help"), check=True, capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--levels", default="1,4,16")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-pin", dest="pin", action="store_false",
                        help="Leave the server and this client to share every core (by default, on a host of 2 or "
                             "more, the server runs on the last core with one torch thread and this client on the "
                             "first: on 2 cores the server's torch threads otherwise moved the rounds by 35%%).")
    args = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    pinned = args.pin and len(cores) >= 2
    server_cores = client_cores = None
    if pinned:
        server_cores, client_cores = {cores[-1]}, {cores[0]}
        os.sched_setaffinity(0, client_cores)  # before any thread starts: they inherit it
    from layertap.worker.model.tiny_model import make_tiny_model

    work = Path(tempfile.mkdtemp(prefix="regen-bench-"))
    model = str(make_tiny_model(work / "model", "qwen3"))
    server = small_server(Path(model), work / "answers.jsonl")
    if server_cores is not None:
        server.argv = ["taskset", "-c", ",".join(map(str, server_cores)), *server.argv]
        server.env = {**server.env, "OMP_NUM_THREADS": "1"}
    server.start()
    try:
        prompts = [f"benchmark question {i}" for i in range(args.conversations)]
        chats = work / "chats.jsonl"
        chats.write_text("".join(json.dumps({"id": f"c{i}", "messages": [{"role": "user", "content": text}]}) + "\n"
                                 for i, text in enumerate(prompts)))
        asyncio.run(bare_loop(server.url, model, prompts[:4], 4, args.max_tokens))  # warm up
        print(f"{len(prompts)} conversations, {args.max_tokens} tokens each; layertap regenerate --help starts "
              f"in {command_start_seconds():.2f} s; " + (f"server on core {server_cores}, client on core {client_cores}"
              if pinned else "server and client share the cores"), flush=True)
        for level in (int(x) for x in args.levels.split(",")):
            bare, ours, bare_cpu, ours_cpu = [], [], [], []
            for round_no in range(args.rounds):
                cpu = time.process_time()
                bare.append(asyncio.run(bare_loop(server.url, model, prompts, level, args.max_tokens)))
                bare_cpu.append(time.process_time() - cpu)
                out = work / f"out-{level}-{round_no}.jsonl"
                cpu = time.process_time()
                ours.append(asyncio.run(regenerate_loop(server.url, model, chats, out, level, args.max_tokens)))
                ours_cpu.append(time.process_time() - cpu)
            best_bare, best_ours = min(bare), min(ours)
            median_bare, median_ours = statistics.median(bare), statistics.median(ours)
            print(f"concurrency {level:3d}: bare loop {len(prompts) / best_bare:6.1f} conv/s, regenerate "
                  f"{len(prompts) / best_ours:6.1f} conv/s, overhead {100 * (best_ours - best_bare) / best_bare:+.1f}% "
                  f"best against best, {100 * (median_ours - median_bare) / median_bare:+.1f}% median against median "
                  f"({args.rounds} rounds each; all bare {', '.join(f'{x:.2f}' for x in bare)} s, all regenerate "
                  f"{', '.join(f'{x:.2f}' for x in ours)} s); client CPU per conversation: bare "
                  f"{1000 * min(bare_cpu) / len(prompts):.2f} ms, "
                  f"regenerate {1000 * min(ours_cpu) / len(prompts):.2f} ms",
                  flush=True)
    finally:
        server.kill()


if __name__ == "__main__":
    main()
