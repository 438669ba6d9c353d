"""Issue 24's figures on one GPU, in one command: quantized and big checkpoints, random weights
written to a local folder (``layertap.worker.bench.checkpoints``, shard by shard), each measured with
``layertap bench``'s parts and then deleted (so the host needs room for one at a time).

    python benchmarks/frontier.py --folder /dev/shm/layertap-frontier --out benchmarks/h200-frontier.json

Cases (``--cases``, default all):

* ``8b``:  Qwen3-8B shape, bf16 against FP8 block-scaled (128x128 ``weight_scale_inv``): the
  engine in-process (c) and the queue end to end (d); FP8 with the compute path the worker
  picks (auto: fp8 matmuls where the probe passes) and with ``dequant`` (c only). Ratio FP8/bf16.
* ``70b``: Llama-3.3-70B shape in FP8 block-scaled (~70 GB): the queue end to end (d).
* ``30b``: Qwen3-30B-A3B shape in bf16 (~61 GB): plain HF right-padded batches of 8 (p) and the
  queue (d); ratio d/p.

Every case reports the load: seconds, the bench process's peak host memory while loading against
the weights' size, the quantization and the compute path. Prints a table and writes JSON.
``--compile`` compiles the decoder layers in every case, as the headline bench does.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path
from typing import Any

from layertap.worker.bench.bench import run_bench
from layertap.worker.bench.checkpoints import write_checkpoint
from layertap.worker.bench.config import BenchConfig

CASES = ("8b", "70b", "30b")
#: case -> [(label, shape, checkpoint format, parts, quant_compute)]
PLAN: dict[str, list[tuple[str, str, str, tuple[str, ...], str]]] = {
    "8b": [("qwen3-8b bf16", "qwen3-8b", "bf16", ("c", "d"), "auto"),
           ("qwen3-8b fp8-block", "qwen3-8b", "fp8-block", ("c", "d"), "auto"),
           ("qwen3-8b fp8-block dequant", "qwen3-8b", "fp8-block", ("c",), "dequant")],
    "70b": [("llama3.3-70b fp8-block", "llama3.3-70b", "fp8-block", ("d",), "auto")],
    "30b": [("qwen3-30b-a3b bf16", "qwen3-30b-a3b", "bf16", ("p", "d"), "auto")],
    # a smoke test of this script on any machine (``--cases tiny --device cpu``)
    "tiny": [("qwen3-8b bf16", "qwen3-tiny", "bf16", ("c", "d"), "auto"),
             ("qwen3-8b fp8-block", "qwen3-tiny", "fp8-block", ("c", "d"), "auto")],
}
LAYERS = {"qwen3-8b": [2, 18, 33, 36], "llama3.3-70b": [2, 40, 77, 80], "qwen3-30b-a3b": [2, 24, 45, 48],
          "qwen3-tiny": [1, 2, 4]}


def run_case(label: str, shape: str, fmt: str, parts: tuple[str, ...], quant_compute: str, folder: Path,
             args: argparse.Namespace) -> dict[str, Any]:
    checkpoint = folder / f"{shape}-{fmt}"
    if not (checkpoint / "config.json").exists():
        started = time.monotonic()
        write_checkpoint(f"shape:{shape}", checkpoint, fmt)
        print(f"{label}: checkpoint written in {time.monotonic() - started:.0f}s", flush=True)
    cfg = BenchConfig(model=str(checkpoint), device=args.device, dtype="bfloat16", layers=LAYERS[shape],
                      prompts=args.prompts, min_len=args.min_len, max_len=args.max_len,
                      storage=str(folder / "bench-storage"), parts=parts, quant_compute=quant_compute,
                      compile=args.compile)
    result = run_bench(cfg, log=lambda line: print(f"{label}: {line}", flush=True))
    return {"label": label, "shape": shape, "format": fmt, **result}


def table(results: list[dict[str, Any]]) -> str:
    rows = ["| case | load s | host peak GiB | weights GiB | compute | part | tokens/s |",
            "|---|---|---|---|---|---|---|"]
    for result in results:
        load = result["load"]
        for key, part in result["parts"].items():
            rows.append(f"| {result['label']} | {load.get('seconds', '-')} | {load.get('peak_rss_gib', '-')} | "
                        f"{load.get('weights_gib', '-')} | {load.get('quant_compute') or 'bf16'} | {key} | "
                        f"{part['tokens_per_s']:,.0f} |")
    by_label = {r["label"]: r["parts"] for r in results}
    ratios = []
    for fp8 in ("qwen3-8b fp8-block", "qwen3-8b fp8-block dequant"):
        for part in ("c", "d"):
            if fp8 in by_label and "qwen3-8b bf16" in by_label and part in by_label[fp8]:
                ratio = by_label[fp8][part]["tokens_per_s"] / by_label["qwen3-8b bf16"][part]["tokens_per_s"]
                ratios.append(f"{fp8} / bf16 ({part}): {ratio:.2f}")
    if "qwen3-30b-a3b bf16" in by_label:
        parts = by_label["qwen3-30b-a3b bf16"]
        ratios.append(f"qwen3-30b-a3b queue / plain HF padded 8 (d/p): "
                      f"{parts['d']['tokens_per_s'] / parts['p']['tokens_per_s']:.2f}")
    return "\n".join(rows + [""] + ratios)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--folder", type=Path, default=Path("/dev/shm/layertap-frontier"),
                        help="Where checkpoints are written (one at a time) and deleted after their case.")
    parser.add_argument("--cases", default=",".join(CASES), help="Comma list of 8b, 70b, 30b.")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=128)
    parser.add_argument("--max-len", type=int, default=2047)
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile the decoder layers, as the workers' --compile does (for fp8: the "
                             "activation quantizer fuses into each layer's graph).")
    parser.add_argument("--keep", action="store_true", help="Keep the checkpoints (they are large).")
    parser.add_argument("--out", type=Path, default=None, help="Write every result as JSON here.")
    args = parser.parse_args()
    results = []
    for case in args.cases.split(","):
        if case not in PLAN:
            parser.error(f"unknown case {case!r}; choose from {', '.join(CASES)}")
        for label, shape, fmt, parts, quant_compute in PLAN[case]:
            results.append(run_case(label, shape, fmt, parts, quant_compute, args.folder, args))
            if args.out:
                args.out.write_text(json.dumps(results, indent=2, default=str))
        if not args.keep:
            for _, shape, fmt, _, _ in PLAN[case]:
                shutil.rmtree(args.folder / f"{shape}-{fmt}", ignore_errors=True)
    print(table(results))


if __name__ == "__main__":
    main()
