"""Where one batch of the headline goes, by kernel class (issue 47, item 2).

One engine batch as the worker runs it (its layout, capture of the wanted layers, host copy),
after a warm-up, under ``torch.profiler`` (every thread: the engine's forwards run on its own):
device time by kernel class (GEMMs, attention, norms / RoPE / activations / residual adds and other
elementwise work, copies), the batch's wall time the device ran no kernel at all (idle), each GEMM
shape's achieved TFLOP/s (``aten::mm``/``addmm`` with their FLOPs, grouped by input shape), and the
batch against the matmul rate: useful FLOPs per token (``useful_flops``, as ``layertap bench``'s MFU)
over a bf16 8192^3 matmul measured in the same process. The batch is also timed without the
profiler (best of 3), since the profiler's own CPU work can add idle.

    python benchmarks/forward_profile.py --model shape:llama3-8b --compile [--attention-kernel flash] --out profile.json
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch._C._profiler import _ExperimentalConfig
from torch.profiler import ProfilerActivity, profile

from layertap.settings import WorkerSettings
from layertap.worker.bench.measure import matmul_rate, on_own_thread, useful_flops
from layertap.worker.engine.engine import Engine
from layertap.worker.engine.records import EngineRequest
from layertap.worker.model.attention import VARLEN_KERNELS, resolved_kernel, use_varlen_kernel
from layertap.worker.model.loading import load_model
from layertap.worker.model.modes import compile_decoder_layers

#: Kernel class by the first pattern its name holds (lower case), in this order. Attention comes
#: first: flash-attention's kernel names hold ``cutlass::bfloat16_t``. Inductor's fused kernels
#: (``triton_``) are the compiled layers' norms, RoPE, activations and adds; their names can hold
#: ``_to_copy`` (a cast), so they are matched before the copies. Device copy kernels are, in an
#: eager model, mostly the norms' casts to float32 and back and RoPE's ``cat``; the capture's own
#: copies into the staging buffer are among them too.
ELEMENTWISE = "norm, rope, activation, residual"
CLASSES = (
    ("attention", ("flash", "fmha", "attention", "sdpa", "softmax")),
    ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "splitk")),
    (ELEMENTWISE, ("triton_",)),
    ("copy to host, memset", ("memcpy", "memset")),
    ("copy on device: casts, cat, contiguous", ("copy_kernel", "catarraybatchedcopy")),
    (ELEMENTWISE, ("elementwise", "vectorized", "reduce", "rms", "norm", "silu", "mul", "add", "cat", "index",
                   "pow", "mean", "rsqrt", "neg", "cos", "sin")),
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


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals (kernels on several streams overlap)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="shape:llama3-8b")
    parser.add_argument("--layers", default="2,16,29,32")
    parser.add_argument("--budget", type=int, default=16384)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--compile", action="store_true", help="torch.compile the decoder layers, as bench --compile")
    parser.add_argument("--attention-kernel", default=WorkerSettings().attention_kernel, choices=VARLEN_KERNELS,
                        help="packed attention's kernel (worker.attention_kernel)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    use_varlen_kernel(args.attention_kernel)
    loaded = load_model(args.model, name="profile", device=args.device, dtype="bfloat16")
    cuda = loaded.device.type == "cuda"
    layers = [int(layer) for layer in args.layers.split(",")]
    if args.compile:
        compile_decoder_layers(loaded)
    engine = Engine(loaded, token_budget=args.budget, staging_layers=len(layers))
    lengths = sharegpt_lengths(args.budget, 0)
    vocab = loaded.vocab_size

    def batch() -> float:
        requests = [EngineRequest(torch.randint(0, vocab, (n,)), layers) for n in lengths]
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        for captured in [future.result().wait() for future in engine.submit_many(requests, together=True)]:
            captured.release()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - started

    try:
        engine.warm_up(full_batch=True)
        batch()  # the batch's own shapes once
        unprofiled = min(batch() for _ in range(3))
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True, with_flops=True,
                     experimental_config=_ExperimentalConfig(profile_all_threads=True)) as prof:
            wall = batch()
    finally:
        engine.stop()
    rate = on_own_thread(loaded.device, matmul_rate, loaded.device)  # as bench measures it
    flops = useful_flops(loaded, layers, lengths)
    tokens = sum(lengths)
    by_class: dict[str, float] = defaultdict(float)
    kernels: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    intervals = []
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            seconds = event.time_range.elapsed_us() / 1e6
            by_class[kernel_class(event.name)] += seconds
            kernels[event.name][0] += 1
            kernels[event.name][1] += seconds
            intervals.append((event.time_range.start / 1e6, event.time_range.end / 1e6))
    busy = busy_seconds(intervals)
    gemms = []
    for event in prof.key_averages(group_by_input_shape=True):
        if event.key in ("aten::mm", "aten::addmm") and event.flops and event.device_time_total:
            gemms.append({"op": event.key, "shapes": str(event.input_shapes), "calls": event.count,
                          "tflop": event.flops / 1e12, "device_s": event.device_time_total / 1e6,
                          "tflops": event.flops / (event.device_time_total / 1e6) / 1e12})
    gemms.sort(key=lambda row: -row["device_s"])
    gemm_flops = sum(row["tflop"] for row in gemms) * 1e12
    config = loaded.model.config.get_text_config()
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or loaded.hidden_size // heads
    attention_flops = sum(2 * n * n * heads * head_dim for n in lengths) * max(layers)
    report = {
        "model": args.model, "compile": args.compile, "layers": layers,
        "attention_kernel": resolved_kernel(loaded.device),
        "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"), "tokens": tokens, "prompts": len(lengths), "lengths": lengths,
        "wall_s": wall, "wall_unprofiled_s": unprofiled, "tokens_per_s": tokens / unprofiled,
        "matmul_tflops": rate / 1e12, "useful_gflop_per_token": flops / tokens / 1e9,
        "tokens_per_s_at_matmul_rate": rate / (flops / tokens) if rate else None,
        "fraction_of_matmul_rate": flops / unprofiled / rate if rate else None,
        "device_s_by_class": dict(sorted(by_class.items(), key=lambda item: -item[1])),
        "device_busy_s": busy, "idle_share": max(0.0, 1 - busy / wall),
        "gemm_tflop": gemm_flops / 1e12,
        "gemm_tflops": gemm_flops / 1e12 / by_class["gemm"] if by_class.get("gemm") else None,
        "attention_tflop": attention_flops / 1e12,
        "attention_tflops": attention_flops / 1e12 / by_class["attention"] if by_class.get("attention") else None,
        "gemms": gemms[:16],
        "kernels": [{"name": name, "calls": int(calls), "device_s": seconds}
                    for name, (calls, seconds) in sorted(kernels.items(), key=lambda item: -item[1][1])[:40]],
    }
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"{report['device']} {args.model} {'compiled' if args.compile else 'eager'}: {len(lengths)} prompts, "
          f"{tokens} tokens in {unprofiled * 1e3:.1f} ms ({report['tokens_per_s']:.0f} tokens/s; "
          f"{wall * 1e3:.1f} ms profiled); {report['useful_gflop_per_token']:.2f} GFLOP/token; "
          f"matmul {report['matmul_tflops']:.0f} TFLOP/s")
    if rate:
        print(f"  at the matmul rate: {report['tokens_per_s_at_matmul_rate']:.0f} tokens/s; "
              f"this batch reaches {report['fraction_of_matmul_rate']:.1%} of it")
    for label, seconds in report["device_s_by_class"].items():
        print(f"  {label:36} {seconds * 1e3:8.2f} ms  {seconds / wall:6.1%} of the profiled batch")
    print(f"  {'idle (no kernel running)':36} {(wall - busy) * 1e3:8.2f} ms  {report['idle_share']:6.1%}")
    if report["gemm_tflops"]:
        print(f"  GEMMs {report['gemm_tflop']:.1f} TFLOP at {report['gemm_tflops']:.0f} TFLOP/s; attention "
              f"{report['attention_tflop']:.1f} TFLOP at {report['attention_tflops'] or 0:.0f} TFLOP/s")
    if rate and report["gemm_tflops"]:
        at_rate = flops / rate
        gemm_over = by_class["gemm"] - gemm_flops / rate
        attention_over = by_class.get("attention", 0.0) - attention_flops / rate
        print(f"  the batch at the matmul rate: {at_rate * 1e3:.1f} ms; beyond it, GEMMs below the rate "
              f"{gemm_over * 1e3:.1f} ms, attention below it {attention_over * 1e3:.1f} ms, the other kernels and "
              f"idle the rest ({(wall - at_rate - gemm_over - attention_over) * 1e3:.1f} ms of the profiled batch)")
    for row in gemms[:8]:
        print(f"  {row['op']:10} {row['shapes'][:60]:60} {row['calls']:4} calls {row['tflops']:6.0f} TFLOP/s")


if __name__ == "__main__":
    main()
