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

    python benchmarks/attention_kernels.py --packings [--slots 256] [--fixed-max 16384] [--out FILE]

runs instead the graph-reuse study for cuDNN frontend's THD op, whose graph cache is keyed on the
number of sequences and the max lengths (not on the token count). Six packings of about
``--tokens`` query tokens (19 lognormal prompts; ~170 short ones; a few long; one prompt; normal
prompts mixed with 1-20-token ones; and rows whose queries are the last part of a longer key row,
``cu_seqlens_q != cu_seqlens_kv``, causal aligned bottom-right as the prefix cache does) are each run
through aten's flash call and three cuDNN variants: ``exact`` (the packing's own count and max
lengths, one graph per packing), ``fixed`` (cumulative lengths padded to ``--slots`` sequences with
zero-length ones, max lengths ``--fixed-max``, bottom-right causal for every packing: equal q and kv
lengths make it the same mask as top-left) and ``fixed_slots_pow2_max`` (``--slots`` sequences, max
lengths rounded up to a power of two). Per packing and variant: whether the call built a graph, the
first call's wall time, the median of ``--iters`` calls after, errors against aten (called with both
cumulative lengths, which aligns causal bottom-right) and against an fp32 reference.
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


def failure(error: Exception) -> dict:
    """A failed kernel call as a report entry: the error, where it was raised, and the device's
    state after it (``cuda_state`` where the device failed too)."""
    entry = {"error": f"{type(error).__name__}: {str(error)[:600]}",
             "where": traceback.format_exc().strip().splitlines()[-3:]}
    try:
        torch.cuda.synchronize()
    except Exception as sync_error:  # noqa: BLE001
        entry["cuda_state"] = f"{type(sync_error).__name__}: {str(sync_error)[:200]}"
    return entry


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


def fp32_reference_ragged(q, k, v, q_bounds, kv_bounds, scale) -> torch.Tensor:
    """Causal attention of each row alone in fp32 (math), the diagonal aligned at the bottom right:
    query ``i`` of a row with ``m`` queries and ``n`` keys sees keys ``0 .. i + n - m``."""
    group = q.shape[1] // k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for (q0, q1), (k0, k1) in zip(itertools.pairwise(q_bounds), itertools.pairwise(kv_bounds), strict=True):
        m, n = q1 - q0, k1 - k0
        qi = q[q0:q1].float().transpose(0, 1)[None]
        ki = k[k0:k1].float().repeat_interleave(group, dim=1).transpose(0, 1)[None]
        vi = v[k0:k1].float().repeat_interleave(group, dim=1).transpose(0, 1)[None]
        mask = torch.ones(m, n, dtype=torch.bool, device=q.device).tril(n - m)
        step = max(1, min(q.shape[1], (1 << 29) // max(1, m * n)))  # heads per chunk: scores under ~2 GiB
        for h in range(0, q.shape[1], step):
            with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.MATH]):
                oi = F.scaled_dot_product_attention(qi[:, h:h + step], ki[:, h:h + step], vi[:, h:h + step],
                                                    attn_mask=mask, scale=scale)
            out[q0:q1, h:h + step] = oi[0].transpose(0, 1)
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


def study_packings(tokens: int, seed: int) -> list[tuple[str, list[int], list[int]]]:
    """(name, query lengths, key lengths) of the study's six packings, each about ``tokens`` queries."""
    rng = random.Random(seed)
    packings = []
    lengths = draw_lengths(tokens, 128, 2047, seed)
    packings.append((f"lognormal_{len(lengths)}_prompts", lengths, lengths))
    short: list[int] = []
    while sum(short) + 160 <= tokens:
        short.append(rng.randint(32, 160))
    if sum(short) < tokens:
        short.append(tokens - sum(short))
    packings.append((f"short_{len(short)}_prompts", short, short))
    few = [8192, 4096, 2048, 1024, 512, 256, 256]
    packings.append(("few_long_7_prompts", few, few))
    packings.append(("one_prompt", [tokens], [tokens]))
    tiny = [rng.randint(1, 20) for _ in range(8)]
    mixed = draw_lengths(tokens - sum(tiny), 128, 2047, seed + 1)
    for length in tiny:
        mixed.insert(rng.randrange(len(mixed) + 1), length)
    packings.append((f"tiny_mixed_{len(mixed)}_prompts", mixed, mixed))
    new = draw_lengths(tokens, 64, 1500, seed + 2)
    prefixes = [0 if rng.random() < 0.2 else rng.randint(1, 4000) for _ in new]
    packings.append((f"prefix_bottom_right_{len(new)}_rows", new, [n + p for n, p in zip(new, prefixes, strict=True)]))
    return packings


def bounds_of(lengths: list[int]) -> list[int]:
    return list(itertools.accumulate(lengths, initial=0))


def next_pow2(n: int, low: int = 128) -> int:
    return max(low, 1 << (n - 1).bit_length())


def cudnn_study(args) -> dict:
    """The graph-reuse study (see the module docstring)."""
    from cudnn.frost.buffers import cutedsl_state
    from cudnn.sdpa.fwd import torch_op
    from cudnn.sdpa.fwd.torch_op import sdpa

    device = torch.device("cuda")
    scale = 1.0 / math.sqrt(args.dim)
    properties = torch.cuda.get_device_properties(device)
    report: dict = {
        "device": properties.name, "capability": list(torch.cuda.get_device_capability(device)),
        "torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
        "packages": {name: version_of(name) for name in
                     ("nvidia-cudnn-frontend", "nvidia-cudnn-cu13", "nvidia-cudnn-cu12", "nvidia-cutlass-dsl")},
        "cutedsl_state": str(cutedsl_state()),
        "heads": args.heads, "kv_heads": args.kv_heads, "dim": args.dim,
        "slots": args.slots, "fixed_max": args.fixed_max,
        "timing": f"first call: wall time (graph build when one is built); then CUDA events, {args.warmup} "
                  f"warm-up calls, median of {args.iters}; wall_per_call_ms: {args.iters} back-to-back calls / "
                  f"{args.iters} (host-bound if above median_ms)",
        "matmul_bf16": matmul_tflops(args.matmul),
    }

    def save() -> None:
        if args.out:
            with open(args.out, "w") as handle:
                handle.write(json.dumps(report, indent=2) + "\n")

    def graph_count() -> int:
        return len(torch_op._graph_cache)

    # Handle creation and library loading, apart from any graph build measured below.
    tiny = torch.randn(4, args.heads, args.dim, device=device, dtype=torch.bfloat16)
    tiny_kv = torch.randn(4, args.kv_heads, args.dim, device=device, dtype=torch.bfloat16)
    tiny_cu = torch.tensor([0, 4], dtype=torch.int32, device=device)
    try:
        _, init_ms = first_call(lambda: sdpa(tiny, tiny_kv, tiny_kv, scale=scale, is_causal=True,
                                             cu_seqlens_q=tiny_cu, cu_seqlens_kv=tiny_cu, max_seqlen_q=4,
                                             max_seqlen_kv=4))
        report["cudnn_init_and_4_token_graph_ms"] = round(init_ms, 3)
    except Exception as error:  # noqa: BLE001
        report["cudnn_init_and_4_token_graph_ms"] = f"{type(error).__name__}: {str(error)[:300]}"
    report["packings"] = []
    save()

    def wall_per_call(fn) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.iters):
            fn()
        torch.cuda.synchronize()
        return round((time.perf_counter() - start) * 1e3 / args.iters, 4)

    def measure(call, baseline, reference) -> tuple[dict, torch.Tensor]:
        before = graph_count()
        out, first_ms = first_call(call)
        baseline = out if baseline is None else baseline
        entry = {"graph_built": graph_count() > before, "first_call_ms": round(first_ms, 3),
                 "vs_aten_flash": compare(out[:baseline.shape[0]], baseline),
                 "vs_fp32_reference": compare(out[:baseline.shape[0]], reference),
                 "finite": bool(torch.isfinite(out).all())}
        entry.update(cuda_time(call, args.warmup, args.iters))
        entry["wall_per_call_ms"] = wall_per_call(call)
        return entry, out

    with torch.no_grad():
        for index, (name, q_lengths, kv_lengths) in enumerate(study_packings(args.tokens, args.seed)):
            qb, kb = bounds_of(q_lengths), bounds_of(kv_lengths)
            same = q_lengths == kv_lengths
            generator = torch.Generator(device=device).manual_seed(args.seed + index)
            q = torch.randn(qb[-1], args.heads, args.dim, device=device, dtype=torch.bfloat16, generator=generator)
            k = torch.randn(kb[-1], args.kv_heads, args.dim, device=device, dtype=torch.bfloat16, generator=generator)
            v = torch.randn(kb[-1], args.kv_heads, args.dim, device=device, dtype=torch.bfloat16, generator=generator)
            cu_q = torch.tensor(qb, dtype=torch.int32, device=device)
            cu_kv = torch.tensor(kb, dtype=torch.int32, device=device)
            max_q, max_kv = max(q_lengths), max(kv_lengths)
            flops = 4 * sum(m * (n - m) + m * m / 2 for m, n in zip(q_lengths, kv_lengths, strict=True)) \
                * args.heads * args.dim
            entry: dict = {"name": name, "rows": len(q_lengths), "q_tokens": qb[-1], "kv_tokens": kb[-1],
                           "max_q": max_q, "max_kv": max_kv, "q_lengths": q_lengths,
                           "useful_tflop_per_call": round(flops / 1e12, 4)}
            if not same:
                entry["kv_lengths"] = kv_lengths
            report["packings"].append(entry)
            reference = fp32_reference_ragged(q, k, v, qb, kb, scale)

            # The two closures below read q, k, v, which the loop deletes at its end, after their last call;
            # ruff takes that del for an undefined name (F821), hence the noqa.
            def aten():
                return torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_kv, max_q, max_kv,  # noqa: F821
                                                                0.0, True, False, scale=scale)[0]
            entry["aten_flash"], baseline = measure(aten, None, reference)
            entry["aten_flash"].pop("graph_built")

            def padded(cu: torch.Tensor) -> torch.Tensor:
                # The engine would fill a preallocated (slots + 1) buffer; built here untimed.
                return torch.cat([cu, cu[-1:].expand(args.slots + 1 - cu.numel())])

            cu_q_pad, cu_kv_pad = padded(cu_q), padded(cu_kv)
            variants = {
                "cudnn_exact": (cu_q, cu_kv, max_q, max_kv, not same),
                "cudnn_fixed": (cu_q_pad, cu_kv_pad, args.fixed_max, args.fixed_max, True),
                "cudnn_fixed_slots_pow2_max": (cu_q_pad, cu_kv_pad, next_pow2(max_q), next_pow2(max_kv), True),
            }
            for variant, (cq, ckv, mq, mkv, bottom_right) in variants.items():
                def call(cq=cq, ckv=ckv, mq=mq, mkv=mkv, bottom_right=bottom_right):
                    return sdpa(q, k, v, scale=scale, is_causal=True, causal_bottom_right=bottom_right,  # noqa: F821
                                cu_seqlens_q=cq, cu_seqlens_kv=ckv, max_seqlen_q=mq, max_seqlen_kv=mkv)
                try:
                    result, _ = measure(call, baseline, reference)
                    result.update({"sequences": cq.numel() - 1, "max_seqlen_q": mq, "max_seqlen_kv": mkv,
                                   "bottom_right": bottom_right})
                except Exception as error:  # noqa: BLE001
                    result = failure(error)
                entry[variant] = result
            if "error" in entry["cudnn_fixed"] and "cuda_state" not in entry["cudnn_fixed"]:
                # Zero-length sequences refused: pad with one-token sequences over spare rows instead.
                spare = args.slots + 1 - cu_q.numel()
                q1, k1, v1 = (torch.cat([t, t.new_zeros(spare, *t.shape[1:])]) for t in (q, k, v))
                steps = torch.arange(1, spare + 1, dtype=torch.int32, device=device)
                cq, ckv = torch.cat([cu_q, cu_q[-1] + steps]), torch.cat([cu_kv, cu_kv[-1] + steps])

                def call():
                    return sdpa(q1, k1, v1, scale=scale, is_causal=True, causal_bottom_right=True, cu_seqlens_q=cq,
                                cu_seqlens_kv=ckv, max_seqlen_q=args.fixed_max, max_seqlen_kv=args.fixed_max)
                variants["cudnn_fixed_one_token_padding"] = None
                try:
                    entry["cudnn_fixed_one_token_padding"], _ = measure(call, baseline, reference)
                except Exception as error:  # noqa: BLE001
                    entry["cudnn_fixed_one_token_padding"] = {"error": f"{type(error).__name__}: {str(error)[:600]}"}
            base_ms = entry["aten_flash"]["median_ms"]
            for variant in ("aten_flash", *variants):
                if "median_ms" in entry[variant]:
                    entry[variant]["useful_tflops"] = round(flops / (entry[variant]["median_ms"] * 1e-3) / 1e12, 1)
                    entry[variant]["speedup_vs_aten_flash"] = round(base_ms / entry[variant]["median_ms"], 3)
            print(json.dumps({key: value for key, value in entry.items() if "lengths" not in key}), flush=True)
            del q, k, v, reference, baseline
            save()
    report["graphs_cached"] = graph_count()
    try:
        report["graph_cache_keys"] = [str(key[1:]) for key in torch_op._graph_cache]
    except Exception as error:  # noqa: BLE001
        report["graph_cache_keys"] = f"{type(error).__name__}: {error}"
    save()
    return report


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
    parser.add_argument("--packings", action="store_true", help="run the cuDNN graph-reuse study instead")
    parser.add_argument("--slots", type=int, default=256, help="--packings: sequences every fixed graph declares")
    parser.add_argument("--fixed-max", type=int, default=16384, help="--packings: the fixed graph's max lengths")
    args = parser.parse_args()
    if args.packings:
        print(json.dumps(cudnn_study(args), indent=2))
        return

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
                entry = {"ok": False, **failure(error)}
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
