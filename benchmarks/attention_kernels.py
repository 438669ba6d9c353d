"""Variable-length causal attention kernels on the engine's packed shape, against aten's flash call.

    python benchmarks/attention_kernels.py [--tokens 16384] [--iters 20] [--out FILE]

Builds one packed row of prompts (lengths drawn lognormal in 128-2047, summing to about
``--tokens``) with random bf16 q ``[T, 32, 128]`` and k/v ``[T, 8, 128]`` (Llama-3-8B's
grouped heads), runs the engine's call (``aten._flash_attention_forward`` over cumulative
lengths, causal) and each other kernel that imports: torch's ``varlen_attn``, aten's cuDNN
varlen call, FlashAttention 3 (the ``fa3_fwd`` wheel, directly and through torch's FA3
dispatcher hook where torch has one) and cuDNN frontend's THD op. Each output is checked
against aten's (max abs diff, ||a-b||/||b||) and against an fp32 per-prompt reference; each
is timed with CUDA events (warm-up, median of ``--iters`` calls) and reported as useful
TFLOP/s (causal: 4 * sum(len^2) / 2 * heads * dim), beside a bf16 8192^3 matmul measured in
the same process. Prints JSON (and writes it to ``--out`` if given). A kernel that is not
installed or fails is reported with its error, not skipped silently.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import inspect
import itertools
import json
import math
import random
import statistics
import time
import traceback
from collections.abc import Callable

import torch
import torch.nn.functional as F


def draw_lengths(tokens: int, low: int, high: int, seed: int) -> list[int]:
    """Prompt lengths, lognormal-ish in ``[low, high]``, summing to about ``tokens``."""
    rng = random.Random(seed)
    lengths: list[int] = []
    while True:
        length = int(min(high, max(low, math.exp(rng.gauss(math.log(800), 0.6)))))
        if sum(lengths) + length > tokens:
            remainder = tokens - sum(lengths)
            if remainder >= low:
                lengths.append(min(high, remainder))
            return lengths
        lengths.append(length)


def first_call(fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, float]:
    """The output of ``fn``'s first call and its wall time in ms (imports done, plans/JIT not)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, (time.perf_counter() - start) * 1e3


def cuda_time(fn: Callable[[], object], warmup: int, iters: int) -> dict:
    for _ in range(warmup):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for begin, end in events:
        begin.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    times = [begin.elapsed_time(end) for begin, end in events]
    return {"median_ms": round(statistics.median(times), 4),
            "min_ms": round(min(times), 4), "max_ms": round(max(times), 4)}


def matmul_tflops(size: int, warmup: int = 3, iters: int = 10) -> dict:
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    timing = cuda_time(lambda: a @ b, warmup, iters)
    return {"size": size, "median_ms": timing["median_ms"],
            "tflops": round(2 * size**3 / (timing["median_ms"] * 1e-3) / 1e12, 1)}


def compare(out: torch.Tensor, ref: torch.Tensor) -> dict:
    out, ref = out.float().reshape(ref.shape), ref.float()
    diff = out - ref
    return {"max_abs_diff": float(diff.abs().max()), "rel_err": float(diff.norm() / ref.norm())}


def fp32_reference(q, k, v, bounds, scale) -> torch.Tensor:
    """Causal attention of each prompt alone in fp32 (math), KV heads repeated."""
    group = q.shape[1] // k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for start, end in itertools.pairwise(bounds):
        qi = q[start:end].float().transpose(0, 1)[None]
        ki = k[start:end].float().repeat_interleave(group, dim=1).transpose(0, 1)[None]
        vi = v[start:end].float().repeat_interleave(group, dim=1).transpose(0, 1)[None]
        with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.MATH]):
            oi = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale)
        out[start:end] = oi[0].transpose(0, 1)
    return out


def version_of(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def candidates(q, k, v, cu, longest, scale, group) -> list[tuple[str, Callable[[], Callable[[], torch.Tensor]]]]:
    """(name, setup): setup imports what it needs and returns the call to time; it raises if unavailable."""

    def aten_flash():
        return lambda: torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, longest, longest, 0.0, True, False,
                                                                scale=scale)[0]

    def torch_varlen_attn():
        from torch.nn.attention.varlen import varlen_attn
        params = inspect.signature(varlen_attn).parameters
        kwargs: dict = {"scale": scale}
        if "is_causal" in params:
            kwargs["is_causal"] = True
        else:
            kwargs["window_size"] = (-1, 0)
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        return lambda: varlen_attn(q, k, v, cu, cu, longest, longest, **kwargs)

    def aten_cudnn(kk, vv):
        def setup():
            return lambda: torch.ops.aten._cudnn_attention_forward(q, kk, vv, None, cu, cu, longest, longest, False,
                                                                   0.0, True, False, scale=scale)[0]
        return setup

    def fa3_fwd(**extra):
        def setup():
            from fa3_fwd_interface import flash_attn_varlen_func

            def call():
                out = flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, softmax_scale=scale, causal=True,
                                             **extra)
                return out[0] if isinstance(out, tuple) else out
            return call
        return setup

    def cudnn_frontend():
        from cudnn.sdpa.fwd.torch_op import sdpa
        return lambda: sdpa(q, k, v, scale=scale, is_causal=True, cu_seqlens_q=cu, cu_seqlens_kv=cu,
                            max_seqlen_q=longest, max_seqlen_kv=longest)

    def torch_fa3_hook():
        """torch's FA3 dispatcher override (torch.nn.attention._fa3), fed the fa3_fwd wheel's
        ``fwd`` op, then the engine's exact aten call."""
        import fa3_fwd_interface  # noqa: F401  (registers torch.ops.fa3_fwd)
        fa3 = importlib.import_module("torch.nn.attention._fa3")
        fa3._FA3_CUDA_FWD = torch.ops.fa3_fwd.fwd
        library = fa3._fa3_register_kernels()
        if hasattr(torch._C, "_set_sdp_use_fa3"):
            torch._C._set_sdp_use_fa3(True)
        torch_fa3_hook.library = library  # kept alive: dropping it undoes the override
        return aten_flash()

    # Expanded KV for cuDNN in case the aten path refuses grouped heads (the copy is not timed).
    k_full = k.repeat_interleave(group, dim=1)
    v_full = v.repeat_interleave(group, dim=1)
    return [
        ("aten_flash", aten_flash),
        ("torch_varlen_attn", torch_varlen_attn),
        ("fa3_fwd", fa3_fwd()),
        ("fa3_fwd_pack_gqa", fa3_fwd(pack_gqa=True)),
        ("fa3_fwd_no_pack_gqa", fa3_fwd(pack_gqa=False)),
        ("cudnn_frontend_thd", cudnn_frontend),
        ("aten_cudnn_gqa", aten_cudnn(k, v)),
        ("aten_cudnn_expanded_kv", aten_cudnn(k_full, v_full)),
        ("torch_fa3_hook_aten_call", torch_fa3_hook),  # last: it overrides aten's flash call for the process
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--min-len", type=int, default=128)
    parser.add_argument("--max-len", type=int, default=2047)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--matmul", type=int, default=8192)
    parser.add_argument("--only", default="", help="comma-separated candidate names (default: all)")
    parser.add_argument("--out", default="")
    args = parser.parse_args()

    device = torch.device("cuda")
    lengths = draw_lengths(args.tokens, args.min_len, args.max_len, args.seed)
    bounds = [0]
    for length in lengths:
        bounds.append(bounds[-1] + length)
    total, longest = bounds[-1], max(lengths)
    scale = 1.0 / math.sqrt(args.dim)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    q = torch.randn(total, args.heads, args.dim, device=device, dtype=torch.bfloat16, generator=generator)
    k = torch.randn(total, args.kv_heads, args.dim, device=device, dtype=torch.bfloat16, generator=generator)
    v = torch.randn(total, args.kv_heads, args.dim, device=device, dtype=torch.bfloat16, generator=generator)
    cu = torch.tensor(bounds, dtype=torch.int32, device=device)
    flops = 4 * sum(n * n for n in lengths) / 2 * args.heads * args.dim

    properties = torch.cuda.get_device_properties(device)
    report: dict = {
        "device": properties.name, "capability": list(torch.cuda.get_device_capability(device)),
        "torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
        "packages": {name: version_of(name) for name in
                     ("fa3_fwd", "nvidia-cudnn-frontend", "nvidia-cudnn-cu13", "nvidia-cudnn-cu12", "flash-attn",
                      "flash-attn-3", "flash-attn-4", "flashinfer-python")},
        "shape": {"tokens": total, "prompts": len(lengths), "heads": args.heads, "kv_heads": args.kv_heads,
                  "dim": args.dim, "longest": longest, "lengths": lengths},
        "useful_tflop_per_call": flops / 1e12,
        "timing": f"CUDA events, {args.warmup} warm-up calls, median of {args.iters}",
        "matmul_bf16": matmul_tflops(args.matmul),
    }
    for module in ("flash_attn_interface", "flash_attn", "flash_attn.cute", "flashinfer"):
        try:
            importlib.import_module(module)
            report.setdefault("other_imports", {})[module] = "imported (not benchmarked here)"
        except Exception as error:  # noqa: BLE001
            report.setdefault("other_imports", {})[module] = f"{type(error).__name__}: {str(error)[:200]}"

    with torch.no_grad():
        reference32 = fp32_reference(q, k, v, bounds, scale)
        baseline = None
        results: dict = {}
        only = {name for name in args.only.split(",") if name}
        for name, setup in candidates(q, k, v, cu, longest, scale, args.heads // args.kv_heads):
            if only and name not in only and name != "aten_flash":
                continue
            entry: dict = {}
            try:
                call = setup()
                out, first_ms = first_call(call)
                entry["first_call_ms"] = round(first_ms, 3)
                if name == "aten_flash":
                    baseline = out.clone()
                entry["vs_aten_flash"] = compare(out, baseline)
                entry["vs_fp32_reference"] = compare(out, reference32)
                entry.update(cuda_time(call, args.warmup, args.iters))
                entry["useful_tflops"] = round(flops / (entry["median_ms"] * 1e-3) / 1e12, 1)
                entry["ok"] = True
            except Exception as error:  # noqa: BLE001
                entry = {"ok": False, "error": f"{type(error).__name__}: {str(error)[:600]}",
                         "where": traceback.format_exc().strip().splitlines()[-3:]}
                try:
                    torch.cuda.synchronize()
                except Exception as sync_error:  # noqa: BLE001
                    entry["cuda_state"] = f"{type(sync_error).__name__}: {str(sync_error)[:200]}"
            results[name] = entry
            print(json.dumps({name: entry}), flush=True)
        report["candidates"] = results
        base_ms = results.get("aten_flash", {}).get("median_ms")
        if base_ms:
            for entry in results.values():
                if entry.get("ok"):
                    entry["speedup_vs_aten_flash"] = round(base_ms / entry["median_ms"], 3)

    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(text + "\n")


if __name__ == "__main__":
    main()
