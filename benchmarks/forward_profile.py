"""Where one batch of the headline goes, by kernel class (issue 47, item 2).

One engine batch as the worker runs it (its layout, capture of the wanted layers, host copy),
after a warm-up, under ``torch.profiler``: device time by kernel class (GEMMs, attention, norms /
RoPE / activations / residual adds and other elementwise work, copies), the GPU idle share of the
batch's wall time, and each GEMM shape's achieved TFLOP/s (``aten::mm``/``addmm`` with their FLOPs,
grouped by input shape), beside a bf16 8192^3 matmul measured in the same call.

    python benchmarks/forward_profile.py --model shape:llama3-8b --out profile.json
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from layertap.worker.bench.measure import matmul_rate
from layertap.worker.engine.engine import Engine
from layertap.worker.engine.records import EngineRequest
from layertap.worker.model.loading import load_model

#: Kernel class by the first pattern its name holds (lower case), in this order.
CLASSES = (
    ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "splitk")),
    ("attention", ("flash", "fmha", "attention", "sdpa", "softmax")),
    ("copy", ("memcpy", "copy", "memset")),
    ("norm, rope, activation, residual", ("elementwise", "vectorized", "reduce", "rms", "norm", "silu", "mul",
                                          "add", "cat", "index", "pow", "mean", "rsqrt", "neg", "cos", "sin")),
)


def kernel_class(name: str) -> str:
    lowered = name.lower()
    return next((label for label, patterns in CLASSES if any(p in lowered for p in patterns)), "other")


def sharegpt_lengths(budget: int, seed: int) -> list[int]:
    """Lognormal lengths around 900 tokens (128-4096; the last one cut) that fill one batch of ``budget`` tokens."""
    generator = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    while sum(lengths) < budget:
        length = int(torch.empty(1).log_normal_(6.8, 0.6, generator=generator).clamp(128, 4096))
        lengths.append(min(length, budget - sum(lengths)))
    return lengths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="shape:llama3-8b")
    parser.add_argument("--layers", default="2,16,29,32")
    parser.add_argument("--budget", type=int, default=16384)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    loaded = load_model(args.model, name="profile", device=args.device, dtype="bfloat16")
    cuda = loaded.device.type == "cuda"
    layers = [int(layer) for layer in args.layers.split(",")]
    engine = Engine(loaded, token_budget=args.budget, staging_layers=len(layers))
    lengths = sharegpt_lengths(args.budget, 0)
    vocab = loaded.vocab_size

    def batch() -> list:
        requests = [EngineRequest(torch.randint(0, vocab, (n,)), layers) for n in lengths]
        return [future.result().wait() for future in engine.submit_many(requests, together=True)]

    try:
        engine.warm_up(full_batch=True)
        for _ in range(3):
            for captured in batch():
                captured.release()
        if cuda:
            torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True,
                     with_flops=True) as prof:
            started = time.perf_counter()
            for captured in batch():
                captured.release()
            if cuda:
                torch.cuda.synchronize()
            wall = time.perf_counter() - started
    finally:
        engine.stop()
    by_class: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            by_class[kernel_class(event.key)] += event.self_device_time_total / 1e6
    busy = sum(by_class.values())
    gemms = []
    for event in prof.key_averages(group_by_input_shape=True):
        if event.key in ("aten::mm", "aten::addmm") and event.flops and event.device_time_total:
            gemms.append({"op": event.key, "shapes": str(event.input_shapes), "calls": event.count,
                          "device_s": event.device_time_total / 1e6,
                          "tflops": event.flops / (event.device_time_total / 1e6) / 1e12})
    gemms.sort(key=lambda row: -row["device_s"])
    report = {"model": args.model, "device": torch.cuda.get_device_name() if cuda else "cpu", "tokens": sum(lengths),
              "prompts": len(lengths), "wall_s": wall, "tokens_per_s": sum(lengths) / wall,
              "matmul_tflops": matmul_rate(loaded.device) / 1e12,
              "device_s_by_class": dict(sorted(by_class.items(), key=lambda item: -item[1])),
              "idle_share": max(0.0, 1 - busy / wall), "gemms": gemms[:12]}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"{report['device']}: {report['prompts']} prompts, {report['tokens']} tokens in {wall * 1e3:.1f} ms "
          f"({report['tokens_per_s']:.0f} tokens/s); matmul {report['matmul_tflops']:.0f} TFLOP/s")
    for label, seconds in report["device_s_by_class"].items():
        print(f"  {label:36} {seconds * 1e3:8.2f} ms  {seconds / wall:6.1%} of the batch")
    print(f"  {'idle':36} {'':8}     {report['idle_share']:6.1%}")
    for row in gemms[:8]:
        print(f"  {row['op']:10} {row['shapes'][:60]:60} {row['calls']:4} calls {row['tflops']:6.0f} TFLOP/s")


if __name__ == "__main__":
    main()
