"""Per-turn training rows with and without prefix sharing (issue 47, item 1), in one process.

Row ``k`` of a conversation is the conversation through its assistant turn ``k`` (as speculators
writes them), rows in turn order. The engine in-process (``JobProcessor`` on task threads, files
written, as ``layertap bench``'s part c) runs the same rows with prefix sharing off and on;
baselines in the same call: plain transformers in length-sorted padded batches of 8 (part p) and a
bf16 8192^3 matmul. Tokens/s count every row's full length.

    python benchmarks/per_turn_rows.py --model shape:llama3-8b --device cuda --dtype bfloat16 \\
        --conversations 150 --folder /dev/shm/layertap-turns --out turns.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import safe_open

from layertap.settings import Limits
from layertap.worker.bench.measure import matmul_rate, sync, useful_flops
from layertap.worker.bench.parts import run_plain_batched
from layertap.worker.engine.self_check import relative_error_per_layer
from layertap.worker.extractor import build_processor
from layertap.worker.model.loading import load_model

TURNS = 3


def per_turn_rows(conversations: int, vocab: int, seed: int) -> list[list[int]]:
    """``conversations`` random-token chats of 900-1900 tokens, each cut after each of its
    ``TURNS`` turns (at about a third, two thirds and the end), in turn order."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(conversations):
        length = int(torch.randint(900, 1900, (1,), generator=generator))
        chat = torch.randint(0, vocab, (length,), generator=generator).tolist()
        rows += [chat[:length * turn // TURNS] for turn in range(1, TURNS + 1)]
    return rows


def run(processor, rows: list[list[int]], layers: list[int], run_name: str, sharing: bool) -> dict:
    engine = processor.engine
    engine.prefix_sharing = sharing
    jobs = [{"model": processor.loaded.name, "run": run_name, "job_id": f"r{i}", "token_ids": ids, "layers": layers}
            for i, ids in enumerate(rows)]
    computed, shared = engine.stats.tokens, engine.stats.shared_tokens
    sync(processor.loaded.device)
    start = time.perf_counter()
    with ThreadPoolExecutor(64) as pool:
        results = list(pool.map(processor.process, jobs))
    seconds = time.perf_counter() - start
    tokens = sum(map(len, rows))
    return {"sharing": sharing, "seconds": seconds, "row_tokens": tokens, "tokens_per_s": tokens / seconds,
            "computed_tokens": engine.stats.tokens - computed, "shared_tokens": engine.stats.shared_tokens - shared,
            "errors": sum(not result.ok for result in results), "paths": [result.path for result in results]}


def max_difference(paths_a: list[str], paths_b: list[str]) -> float:
    """The largest per-layer relative error between two runs' files of the same rows."""
    worst = 0.0
    for a, b in zip(paths_a, paths_b):
        with safe_open(a, "pt") as fa, safe_open(b, "pt") as fb:
            worst = max(worst, float(relative_error_per_layer(fa.get_tensor("hidden_states"),
                                                             fb.get_tensor("hidden_states")).max()))
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="shape:llama3-8b")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--conversations", type=int, default=150)
    parser.add_argument("--layers", default="2,16,29,32")
    parser.add_argument("--folder", default="/dev/shm/layertap-turns")
    parser.add_argument("--budget", type=int, default=16384)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    folder = Path(args.folder)
    shutil.rmtree(folder, ignore_errors=True)
    loaded = load_model(args.model, name="turns", device=args.device, dtype=args.dtype)
    layers = [int(layer) for layer in args.layers.split(",")]
    rows = per_turn_rows(args.conversations, loaded.vocab_size, args.seed)
    report: dict = {"model": args.model, "device": torch.cuda.get_device_name() if loaded.device.type == "cuda"
                    else "cpu", "rows": len(rows), "row_tokens": sum(map(len, rows)),
                    "matmul_flops": matmul_rate(loaded.device),
                    "flops_per_row_token": useful_flops(loaded, layers, list(map(len, rows))) / sum(map(len, rows))}
    plain = run_plain_batched(loaded, rows, layers, folder / "plain")
    report["plain_padded_tokens_per_s"] = plain.tokens / plain.seconds
    shutil.rmtree(folder / "plain", ignore_errors=True)
    processor = build_processor(loaded, storage_root=folder, worker_name="turns", layers=layers, limits=Limits(),
                                token_budget=args.budget)
    try:
        processor.engine.warm_up()
        report["prefix_check_passed"] = processor.engine.prefix_sharing
        off = run(processor, rows, layers, "off", sharing=False)
        on = run(processor, rows, layers, "on", sharing=True)
    finally:
        processor.engine.stop()
    report["max_relative_error_on_vs_off"] = max_difference(off.pop("paths"), on.pop("paths"))
    report["off"], report["on"] = off, on
    report["speedup"] = on["tokens_per_s"] / off["tokens_per_s"]
    shutil.rmtree(folder, ignore_errors=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
