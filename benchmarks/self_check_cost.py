"""What the load-time self-check costs at worker start (issue 44): its probes planned from the
model's config (``layertap.worker.engine.probes``) against the four 20-31-token probes it ran
before, on one model, device and dtype, through the engine as a worker starts it.

    python benchmarks/self_check_cost.py --model shape:llama3-8b --device cuda --dtype bfloat16 \\
        --model shape:gemma3-4k-window ...

Each model: loaded once (random weights for ``shape:`` names), the engine warmed up, then each
probe set checked ``--repeats`` times; prints the median seconds and the worst error per set.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from layertap.worker.engine.engine import Engine
from layertap.worker.engine.probes import ProbePlan
from layertap.worker.engine.self_check import check_batching, probe_plan
from layertap.worker.model.loading import load_model

#: The probes of the self-check before issue 44.
FIXED_PROBES = ProbePlan((29, 24, 31, 20), 0, (), "")


def measure(source: str, device: str, dtype: str, repeats: int) -> list[dict]:
    loaded = load_model(source, name="self-check-cost", device=device, dtype=dtype)
    engine = Engine(loaded, token_budget=16384, staging_layers=4)
    rows = []
    try:
        engine.warm_up()
        for label, plan in (("from the config", probe_plan(loaded)), ("fixed 20-31 tokens", FIXED_PROBES)):
            seconds, report = [], None
            for _ in range(repeats):
                if loaded.device.type == "cuda":
                    torch.cuda.synchronize()
                started = time.perf_counter()
                report = check_batching(engine, plan=plan)
                seconds.append(time.perf_counter() - started)
            rows.append({"model": source, "device": str(loaded.device), "dtype": dtype, "probes": label,
                         "plan": plan.describe(), "layout": loaded.batching.name,
                         "median_s": statistics.median(seconds), "runs_s": seconds,
                         "worst_relative_error": report.worst_relative_error if report else None})
    finally:
        engine.stop()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", required=True, help="a folder or shape:<name>; repeatable")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    rows = [row for source in args.model for row in measure(source, args.device, args.dtype, args.repeats)]
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(rows, handle, indent=1)
    print(f"{'model':28} {'probes':20} {'median s':>9} {'worst err':>10}  plan")
    for row in rows:
        print(f"{row['model']:28} {row['probes']:20} {row['median_s']:9.3f} {row['worst_relative_error']:10.2g}  "
              f"{row['plan']}")


if __name__ == "__main__":
    main()
