"""Per-turn training rows with and without prefix sharing (issue 47, item 1), in one process.

Row ``k`` of a conversation is the conversation through its assistant turn ``k`` (as speculators
writes them). The engine in-process (``JobProcessor`` on task threads, files written, as ``layertap
bench``'s part c; the rows in messages of ``--bundle`` jobs, the client's default 64, on a worker's
default 64 task threads) runs the same rows: with neither in-batch sharing nor the prefix cache (``off``),
then with sharing alone and with the prefix cache, the rows sent all at once in turn order, all at
once shuffled, or a turn at a time (``waves``: each row in a later batch than its prefix); with
``--system-prompt N`` every conversation begins with the same N tokens. Baselines
in the same call: plain transformers in length-sorted padded batches of 8 (part p) and a bf16
8192^3 matmul. Each pass's files are compared with ``off``'s (and ``off``'s with plain
transformers'). With ``--plain-prompts N``, then N random prompts (128-2,047 tokens, nothing to
share) with the prefix cache off and on, twice. With ``--kernels flash,cudnn,...``, the passes
run once per name with packed attention on that kernel (``worker.attention_kernel``), each
round's files compared with the first round's no-sharing files. Tokens/s count every row's full length.

    python benchmarks/per_turn_rows.py --model shape:llama3-8b --device cuda --dtype bfloat16 --compile \\
        --conversations 150 --folder /dev/shm/layertap-turns --out turns.json
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import safe_open

from layertap.protocol.schema import Job
from layertap.settings import BundleSettings, Limits, WorkerSettings
from layertap.worker.bench.card import CardSampler
from layertap.worker.bench.measure import matmul_rate, sustained_matmul_rate, sync, useful_flops
from layertap.worker.bench.parts import run_plain_batched
from layertap.worker.bench.prompts import random_prompts
from layertap.worker.engine.prefix_cache import PrefixCache
from layertap.worker.engine.self_check import relative_error_per_layer
from layertap.worker.extractor import build_processor
from layertap.worker.model.attention import attention_kernel, resolved_kernel, use_varlen_kernel
from layertap.worker.model.loading import load_model

TURNS = 3


def per_turn_rows(conversations: int, vocab: int, seed: int, system: int = 0) -> list[list[int]]:
    """``conversations`` random-token chats of 900-1900 tokens, each cut after each of its
    ``TURNS`` turns (at about a third, two thirds and the end), in turn order; with ``system``,
    every chat begins with the same ``system`` random tokens (a shared system prompt) before its own."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(conversations):
        length = int(torch.randint(900, 1900, (1,), generator=generator))
        chat = torch.randint(0, vocab, (length,), generator=generator).tolist()
        rows += [chat[:length * turn // TURNS] for turn in range(1, TURNS + 1)]
    if system:
        prompt = torch.randint(0, vocab, (system,), generator=torch.Generator().manual_seed(seed + 1000)).tolist()
        rows = [prompt + row for row in rows]
    return rows


def distinct_tokens(rows: list[list[int]]) -> int:
    """Tokens that need computing at least once: the distinct prefixes among ``rows`` (a token's
    states depend on it and the tokens before it alone)."""
    seen: set[int] = set()
    for row in rows:
        chained = 0
        for token in row:
            chained = hash((chained, token))
            seen.add(chained)
    return len(seen)


def arrivals(rows: list[list[int]], order: str, seed: int) -> list[list[int]]:
    """Row indices in the waves they are sent in, each wave after the one before is answered:
    ``turns`` all at once in turn order, ``shuffled`` all at once in random order, ``waves`` each
    turn of every conversation after the turn before (every row in a later batch than its prefix)."""
    indices = list(range(len(rows)))
    if order == "turns":
        return [indices]
    if order == "shuffled":
        random.Random(seed).shuffle(indices)
        return [indices]
    return [indices[turn::TURNS] for turn in range(TURNS)]


def bundled(indices: list[int], lengths: list[int], most_jobs: int) -> list[list[int]]:
    """``indices`` in order, in messages of at most ``most_jobs`` jobs and the client's ``max_tokens``
    tokens each (a longer row alone). The client also keeps a conversation's rows sent in turn order in
    one message (``Job.extends``); that decides which worker gets them, and here one worker gets all."""
    most_tokens = BundleSettings().max_tokens
    bundles: list[list[int]] = []
    tokens = 0
    for index, length in zip(indices, lengths):
        if not bundles or len(bundles[-1]) >= most_jobs or tokens + length > most_tokens:
            bundles.append([])
            tokens = 0
        bundles[-1].append(index)
        tokens += length
    return bundles


def run(processor, rows: list[list[int]], layers: list[int], run_name: str, sharing: bool,
        cache: PrefixCache | None, order: str, seed: int, bundle: int, card: CardSampler | None) -> dict:
    """One pass over ``rows`` (``arrivals`` order, each wave in messages of ``bundle`` jobs, at most
    :data:`CONCURRENCY` in flight, as a worker takes them) with in-batch sharing on or off and the
    worker's prefix cache emptied first (None: no cache); ``card``'s clock and power while it ran."""
    engine = processor.engine
    engine.prefix_sharing = sharing
    if cache is not None:
        cache.clear()
    engine.prefix_cache = cache
    jobs = [{"model": processor.loaded.name, "run": run_name, "job_id": f"r{i}", "token_ids": ids, "layers": layers}
            for i, ids in enumerate(rows)]
    computed, shared, cached = engine.stats.tokens, engine.stats.shared_tokens, engine.stats.cached_tokens
    batches = engine.stats.batches
    sync(processor.loaded.device)
    busy = engine.busy_seconds()
    start = time.perf_counter()
    results = [None] * len(rows)
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        for wave in arrivals(rows, order, seed):
            bundles = bundled(wave, [len(rows[index]) for index in wave], bundle)
            answers = pool.map(lambda indices: processor.process_many([Job.model_validate(jobs[i]) for i in indices]),
                               bundles)
            for indices, answered in zip(bundles, answers):
                for index, result in zip(indices, answered):
                    results[index] = result
    seconds = time.perf_counter() - start
    tokens = sum(map(len, rows))
    report = {"sharing": sharing, "cache_bytes": 0 if cache is None else cache.budget_bytes, "order": order,
              "seconds": seconds,
              "device_busy_s": engine.busy_seconds() - busy,
              "row_tokens": tokens, "tokens_per_s": tokens / seconds,
              "computed_tokens": engine.stats.tokens - computed, "shared_tokens": engine.stats.shared_tokens - shared,
              "cached_tokens": engine.stats.cached_tokens - cached, "batches": engine.stats.batches - batches,
              "prefix_cache_bytes_at_end": 0 if cache is None else cache.held_bytes,
              "errors": sum(not result.ok for result in results), "card": card and card.between(start, start + seconds),
              "paths": [result.path for result in results]}
    engine.prefix_cache = None
    return report


#: Messages in flight at once: a worker's default ``concurrency``.
CONCURRENCY = WorkerSettings().concurrency

#: Rows whose files are compared between passes (every ``len(rows) // COMPARED``-th).
COMPARED = 90


def max_difference(paths_a: list[str], paths_b: list[str]) -> float:
    """The largest per-layer relative error between two runs' files of the same rows (:data:`COMPARED` of them)."""
    worst = 0.0
    step = max(1, len(paths_a) // COMPARED)
    for a, b in list(zip(paths_a, paths_b))[::step]:
        with safe_open(a, "pt") as fa, safe_open(b, "pt") as fb:
            worst = max(worst, float(relative_error_per_layer(fa.get_tensor("hidden_states"),
                                                             fb.get_tensor("hidden_states")).max()))
    return worst


def kernels_named(names: str, device: torch.device) -> str:
    """``--kernels`` with ``auto`` resolved for ``device`` (e.g. ``auto (cudnn)``)."""
    return ",".join(f"{name} ({resolved_kernel(device)})" if name == "auto" else name for name in names.split(","))


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
    parser.add_argument("--plain-prompts", type=int, default=0,
                        help="then this many random prompts of 128-2,047 tokens with the prefix cache off and on")
    parser.add_argument("--kernels", default=WorkerSettings().attention_kernel,
                        help="packed attention's kernel for each round of passes, e.g. flash,cudnn,flash,cudnn")
    parser.add_argument("--bundle", type=int, default=BundleSettings().max_jobs,
                        help="jobs per message (the client's default; 1: each row in its own message)")
    parser.add_argument("--no-padded-baseline", dest="padded_baseline", action="store_false",
                        help="skip plain transformers' padded batches (an A/B of the engine alone)")
    parser.add_argument("--passes", default="", help="which sharing passes to run (default: all)")
    parser.add_argument("--prefix-cache-mib", type=int, default=None,
                        help="the prefix cache's budget (worker.prefix_cache_mib; default: the worker's)")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile the decoder layers, as a worker's --compile")
    parser.add_argument("--system-prompt", type=int, default=0,
                        help="every conversation begins with the same this many tokens (a shared system prompt)")
    args = parser.parse_args()
    folder = Path(args.folder)
    shutil.rmtree(folder, ignore_errors=True)
    loaded = load_model(args.model, name="turns", device=args.device, dtype=args.dtype)
    layers = [int(layer) for layer in args.layers.split(",")]
    card = CardSampler(loaded.device.index or 0) if loaded.device.type == "cuda" else None
    rows = per_turn_rows(args.conversations, loaded.vocab_size, args.seed, args.system_prompt)
    report: dict = {"model": args.model, "device": torch.cuda.get_device_name() if loaded.device.type == "cuda"
                    else "cpu", "rows": len(rows), "row_tokens": sum(map(len, rows)),
                    "system_prompt_tokens": args.system_prompt, "distinct_tokens": distinct_tokens(rows),
                    "matmul_flops": matmul_rate(loaded.device),
                    "matmul_flops_sustained": sustained_matmul_rate(loaded.device),
                    "flops_per_row_token": useful_flops(loaded, layers, list(map(len, rows))) / sum(map(len, rows))}
    if args.padded_baseline:
        plain = run_plain_batched(loaded, rows, layers, folder / "plain")
        report["plain_padded_tokens_per_s"] = plain.tokens / plain.seconds
    report["attention_kernel"] = kernels_named(args.kernels, loaded.device)
    plain_paths = [str(folder / "plain" / f"{index}.safetensors") for index in range(len(rows))]
    processor = build_processor(loaded, storage_root=folder, worker_name="turns", layers=layers, limits=Limits(),
                                token_budget=args.budget, compile_layers=args.compile,
                                prefix_cache_mib=args.prefix_cache_mib)
    kernels = args.kernels.split(",")
    try:
        processor.engine.warm_up(full_batch=True)
        report["prefix_check_passed"] = processor.engine.prefix_sharing
        report["prefix_cache_check_passed"] = processor.engine.prefix_cache is not None
        cache = processor.engine.prefix_cache  # the worker's, as the load-time checks left it
        report["prefix_cache_budget_bytes"] = 0 if cache is None else cache.budget_bytes
        passes = {"on": (True, None, "turns"), "cache-turns": (True, cache, "turns"),
                  "cache-shuffled": (True, cache, "shuffled"), "cache-waves": (True, cache, "waves")}
        wanted = args.passes.split(",") if args.passes else list(passes)
        reference: list[str] = []  # the first round's no-sharing files: every pass is compared with them
        prompts = random_prompts(args.plain_prompts, 128, 2047, loaded.vocab_size, args.seed + 1)
        for round_index, kernel in enumerate(kernels):
            label = "" if len(kernels) == 1 else f"{kernel}-{round_index}-"
            if kernel != attention_kernel():
                use_varlen_kernel(kernel)
                processor.engine.warm_up(full_batch=True)  # the kernel's own first calls (cuDNN: its graphs)
            off = run(processor, rows, layers, label + "off", False, None, "turns", args.seed, args.bundle, card)
            if not reference:
                reference = off.pop("paths")
                if args.padded_baseline:
                    report["max_relative_error_plain_vs_off"] = max_difference(plain_paths, reference)
                shutil.rmtree(folder / "plain", ignore_errors=True)
            else:
                off["max_relative_error_vs_off"] = max_difference(reference, off["paths"])
                for path in off.pop("paths"):
                    Path(path).unlink()
            report[label + "off"] = off
            print(json.dumps({label + "off": off}), flush=True)
            for name in wanted:
                sharing, pass_cache, order = passes[name]
                measured = run(processor, rows, layers, label + name, sharing, pass_cache, order, args.seed,
                               args.bundle, card)
                measured["max_relative_error_vs_off"] = max_difference(reference, measured["paths"])
                for path in measured.pop("paths"):
                    Path(path).unlink()
                measured["speedup_vs_off"] = measured["tokens_per_s"] / off["tokens_per_s"]
                report[label + name] = measured
                print(json.dumps({label + name: measured}), flush=True)
            if args.plain_prompts:  # the cache on prompts that share nothing: what it costs where it serves nothing
                plain_passes = (("plain-cache-off", None), ("plain-cache-on", cache), ("plain-cache-off-again", None),
                                ("plain-cache-on-again", cache)) if len(kernels) == 1 else (("plain-cache-on", cache),)
                for name, pass_cache in plain_passes:
                    measured = run(processor, prompts, layers, label + name, True, pass_cache, "turns", args.seed,
                                   args.bundle, card)
                    for path in measured.pop("paths"):
                        Path(path).unlink()
                    report[label + name] = measured
                    print(json.dumps({label + name: measured}), flush=True)
        for path in reference:
            Path(path).unlink()
    finally:
        processor.engine.stop()
        if card is not None:
            card.stop()
    shutil.rmtree(folder, ignore_errors=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
