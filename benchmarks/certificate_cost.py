"""What a run's certificate and capture reuse cost (issue 46): the sampled rows' share of a run's
tokens/s, and later runs answered from a capture, or from disk, at 0 GPU seconds.

    python benchmarks/certificate_cost.py --model shape:llama3-8b --device cuda --dtype bfloat16 \\
        --rows 10000 --min-len 128 --max-len 2048 --storage /dev/shm/cert-bench --out cert.json
    python benchmarks/certificate_cost.py          # a CPU smoke run: shape:qwen3-tiny, 256 rows

One model loaded once, one engine, the worker's own job processor in this process (no Redis: the
sampled rows are kept in memory, the capture index is a dict), rows sent as the worker takes
them (bundles of ``--bundle`` jobs, ``--callers`` at once). Parts:

1. ``sampling``: the same rows, each time as a new run, with sampling off and on (1 in
   ``--sample-every``, at least ``--sample-min`` per run), alternated ``--repeats`` times:
   tokens/s of each (medians) and the cost in percent;
2. ``reuse``: a capture run (``--capture-layers``, the compute dtype), then the same rows asking
   ``--draft-layers`` and the same rows as float8: device seconds (the engine's busy time: 0 when no
   forward ran), rows/s, and the capture bytes read per second;
3. ``rerun``: the capture run's jobs again, answered from disk: device seconds and bytes read/s.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from layertap.protocol.certificate import SampleRow
from layertap.protocol.schema import Job, Result
from layertap.settings import Limits
from layertap.worker.bench.measure import dir_bytes, sync
from layertap.worker.bench.prompts import random_prompts
from layertap.worker.extractor import build_processor
from layertap.worker.job.pipeline import JobProcessor
from layertap.worker.job.sampling import SamplingPlan
from layertap.worker.model.loading import load_model

NAME = "certificate-bench"


class MemorySamples:
    """The sampled rows as lists (the worker keeps them in Redis): measured rows, rows waiting."""

    def __init__(self) -> None:
        self.rows: list[SampleRow] = []
        self.waiting_rows: set[tuple[str, str]] = set()

    def waiting(self, run: str, job_id: str, worker: str) -> None:
        self.waiting_rows.add((run, job_id))

    def record(self, run: str, row: SampleRow, facts: dict[str, Any]) -> None:
        self.rows.append(row)
        self.waiting_rows.discard((run, row.job_id))

    def dropped(self, run: str, job_id: str) -> None:
        self.waiting_rows.discard((run, job_id))

    def settled(self, timeout: float = 600.0) -> float:
        """Seconds until no row waits to be measured."""
        started = time.perf_counter()
        while self.waiting_rows and time.perf_counter() - started < timeout:
            time.sleep(0.005)
        return time.perf_counter() - started


class MemoryCaptures:
    """The capture index as a dict (the worker keeps it in Redis)."""

    def __init__(self) -> None:
        self.noted: dict[str, set[str]] = {}

    def find_many(self, capture_keys: Sequence[str]) -> list[list[str]]:
        return [sorted(self.noted.get(capture_key, ())) for capture_key in capture_keys]

    def add_many(self, notes: Sequence[tuple[str, str]]) -> None:
        for capture_key, address in notes:
            self.noted.setdefault(capture_key, set()).add(address)

    def forget(self, capture_key: str, address: str) -> None:
        self.noted.get(capture_key, set()).discard(address)


def run_rows(processor: JobProcessor, prompts: list[list[int]], run: str, fields: dict[str, Any], bundle: int,
             callers: int) -> tuple[float, list[Result]]:
    """Seconds to answer every prompt as a job of ``run``, in bundles on ``callers`` threads; the results."""
    jobs = [Job(model=NAME, run=run, job_id=f"r{index:07d}", token_ids=ids, **fields)
            for index, ids in enumerate(prompts)]
    bundles = [jobs[start:start + bundle] for start in range(0, len(jobs), bundle)]
    sync(processor.loaded.device)
    started = time.perf_counter()
    with ThreadPoolExecutor(callers) as pool:
        results = [result for done in pool.map(processor.process_many, bundles) for result in done]
    sync(processor.loaded.device)
    seconds = time.perf_counter() - started
    failed = [result for result in results if not result.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} job(s) failed, e.g. {failed[0].error_type}: {failed[0].error}")
    return seconds, results


def sampling_part(processor: JobProcessor, prompts: list[list[int]], args: argparse.Namespace,
                  book: MemorySamples) -> dict[str, Any]:
    """Tokens/s to the last result with sampling off and on; with it on also the seconds after the
    last result until every sampled row was measured (they are measured when the engine is idle)."""
    tokens = sum(map(len, prompts))
    sampler, captures, rates = processor.sampler, processor.captures, {"off": [], "on": []}
    settle: list[float] = []
    processor.captures = None  # every run computed (not answered from the one before)
    for repeat in range(args.repeats):
        for mode in ("off", "on"):
            processor.sampler = sampler if mode == "on" else None
            seconds, _ = run_rows(processor, prompts, f"sampling-{mode}-{repeat}", {"layers": args.capture_layers},
                                  args.bundle, args.callers)
            rates[mode].append(tokens / seconds)
            if mode == "on":
                settle.append(book.settled())
    processor.sampler, processor.captures = sampler, captures
    off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
    sampled = list(book.rows)
    return {"tokens_per_s_off": off, "tokens_per_s_on": on, "cost_percent": 100 * (off - on) / off,
            "runs_off": rates["off"], "runs_on": rates["on"], "measured_after_last_result_s": settle,
            "sampled_rows": len(sampled) // max(1, args.repeats),
            "worst_error": max((max(error for error in row.errors if error is not None) for row in sampled),
                               default=None), "failed_rows": sum(not row.passed for row in sampled)}


def answered_part(processor: JobProcessor, prompts: list[list[int]], run: str, fields: dict[str, Any],
                  read_bytes: int, args: argparse.Namespace) -> dict[str, Any]:
    """A run answered without a forward: device seconds it took, rows/s, bytes read/s."""
    busy = processor.engine.busy_seconds()
    batches = processor.engine.stats.batches
    seconds, results = run_rows(processor, prompts, run, fields, args.bundle, args.callers)
    return {"run": run, "rows": len(results), "device_s": processor.engine.busy_seconds() - busy,
            "forwards": processor.engine.stats.batches - batches, "rows_per_s": len(results) / seconds,
            "read_bytes_per_s": read_bytes / seconds, "from_capture": sum(bool(r.captured_from) for r in results),
            "from_disk": sum(r.cached for r in results)}


def model_and_layers(args: argparse.Namespace, layers: list[int] | None) -> tuple[Any, list[int]]:
    """The model ``args`` name, loaded, and ``layers`` or 4 spread over it, ending with L."""
    loaded = load_model(args.model, name=NAME, device=args.device, dtype=args.dtype)
    depth = loaded.num_layers
    return loaded, layers or sorted({2, depth // 2, depth - 3, depth})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="shape:qwen3-tiny", help="a folder or shape:<name>")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--token-budget", type=int, default=16384)
    parser.add_argument("--bundle", type=int, default=64)
    parser.add_argument("--callers", type=int, default=8)
    parser.add_argument("--sample-every", type=int, default=1000)
    parser.add_argument("--sample-min", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--capture-layers", type=lambda text: [int(i) for i in text.split(",")], default=None,
                        help="default: 4 layers spread over the model, ending with L")
    parser.add_argument("--draft-layers", type=lambda text: [int(i) for i in text.split(",")], default=None,
                        help="default: two of the capture's layers")
    parser.add_argument("--storage", default="certificate-bench-files", help="a folder, emptied first")
    parser.add_argument("--out", default=None, help="write the report as JSON here")
    args = parser.parse_args()

    loaded, args.capture_layers = model_and_layers(args, args.capture_layers)
    args.draft_layers = args.draft_layers or args.capture_layers[-2:]
    storage = Path(args.storage)
    shutil.rmtree(storage, ignore_errors=True)
    book = MemorySamples()
    processor = build_processor(loaded, storage_root=storage, worker_name="bench", layers=None, limits=Limits(),
                                token_budget=args.token_budget,
                                sampling=SamplingPlan(book, args.sample_every, args.sample_min),
                                captures=MemoryCaptures())
    prompts = random_prompts(args.rows, args.min_len, args.max_len, loaded.vocab_size, seed=46)
    report: dict[str, Any] = {"model": args.model, "device": str(loaded.device), "dtype": str(loaded.dtype),
                              "rows": args.rows, "tokens": sum(map(len, prompts)), "sample_every": args.sample_every,
                              "sample_min": args.sample_min, "capture_layers": args.capture_layers,
                              "draft_layers": args.draft_layers}
    try:
        processor.engine.warm_up(full_batch=loaded.device.type == "cuda")
        report["sampling"] = sampling_part(processor, prompts, args, book)
        processor.sampler = None  # the capture is measured as a run, not again here
        seconds, _ = run_rows(processor, prompts, "capture", {"layers": args.capture_layers}, args.bundle,
                              args.callers)
        capture_bytes = dir_bytes(storage / "capture")
        report["capture"] = {"seconds": seconds, "bytes": capture_bytes, "tokens_per_s": report["tokens"] / seconds}
        report["reuse"] = [answered_part(processor, prompts, "draft", {"layers": args.draft_layers}, capture_bytes,
                                         args),
                           answered_part(processor, prompts, "float8", {"layers": args.capture_layers,
                                                                        "dtype": "float8"}, capture_bytes, args)]
        report["rerun"] = answered_part(processor, prompts, "capture", {"layers": args.capture_layers},
                                        capture_bytes, args)
    finally:
        processor.close()
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    sampling = report["sampling"]
    print(f"{report['model']} on {report['device']} ({report['dtype']}), {args.rows} rows, {report['tokens']} tokens")
    print(f"sampling 1 in {args.sample_every} (at least {args.sample_min}): {sampling['tokens_per_s_off']:.0f} -> "
          f"{sampling['tokens_per_s_on']:.0f} tokens/s ({sampling['cost_percent']:+.2f}% cost), "
          f"{sampling['sampled_rows']} rows sampled per run, worst error {sampling['worst_error']}")
    print(f"capture {args.capture_layers}: {report['capture']['tokens_per_s']:.0f} tokens/s, "
          f"{report['capture']['bytes'] / 1e6:.1f} MB")
    for part in [*report["reuse"], report["rerun"]]:
        print(f"{part['run']:8} {part['forwards']} forwards, {part['device_s']:.3f} device s, {part['rows_per_s']:.0f} "
              f"rows/s, {part['read_bytes_per_s'] / 1e6:.0f} MB/s of the capture read; {part['from_capture']} from the "
              f"capture, {part['from_disk']} from disk")


if __name__ == "__main__":
    main()
