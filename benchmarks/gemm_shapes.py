"""The decoder's GEMMs on the engine's batch shape: separate against fused projections, cuBLAS
against cuBLASLt, back to back against interleaved with memory-bound kernels, and the card's
clock and power while each runs.

    python benchmarks/gemm_shapes.py [--tokens 16384] [--layers 32] [--rounds 2] [--out FILE]

Llama-3-8B's projections (hidden 4096, 32 query and 8 KV heads of 128, MLP 14336) on random bf16
activations of ``--tokens`` rows, as the engine runs them on one packed batch:

- ``matmul``: the 8192^3 rate as ``worker.bench.measure.matmul_rate`` measures it (10 calls after
  3, a burst of about 15 ms) and sustained for about 2 s (``measure.sustained_matmul_rate``);
- per layer set: ``separate`` (q, k, v, o, gate, up, down: as transformers calls them) and ``fused``
  (q|k|v as one GEMM, o, gate|up as one GEMM, down), ``--layers`` layers back to back, each GEMM
  timed by CUDA events; ``interleaved`` adds the memory-bound work of a layer between them (an
  RMSNorm-sized and a SiLU-times-up-sized elementwise kernel), as an eager forward runs them;
- under both BLAS libraries torch can call (``torch.backends.cuda.preferred_blas_library``).

Each phase reports achieved TFLOP/s per shape and in all, and the SM clock (MHz), power (W) and
temperature that ``nvidia-smi`` sampled every 50 ms while it ran. Prints JSON (and writes it to
``--out``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from layertap.worker.bench.card import CardSampler
from layertap.worker.bench.measure import matmul_rate, sustained_matmul_rate

HIDDEN, Q_OUT, KV_OUT, MLP = 4096, 4096, 1024, 14336

#: (name, in features, out features) of each GEMM of one layer, in call order.
LAYER_SETS = {
    "separate": [("q", HIDDEN, Q_OUT), ("k", HIDDEN, KV_OUT), ("v", HIDDEN, KV_OUT), ("o", Q_OUT, HIDDEN),
                 ("gate", HIDDEN, MLP), ("up", HIDDEN, MLP), ("down", MLP, HIDDEN)],
    "fused": [("qkv", HIDDEN, Q_OUT + 2 * KV_OUT), ("o", Q_OUT, HIDDEN), ("gate_up", HIDDEN, 2 * MLP),
              ("down", MLP, HIDDEN)],
}


def matmul(sampler: CardSampler, seconds: float) -> dict:
    """The 8192^3 rate as a burst (the benchmarks' baseline) and sustained, with the card's state."""
    device = torch.device("cuda")
    burst = matmul_rate(device)
    start = time.perf_counter()
    sustained = sustained_matmul_rate(device, seconds)
    return {"burst_tflops": round(burst / 1e12, 1), "sustained_tflops": round(sustained / 1e12, 1),
            "card": sampler.between(start, time.perf_counter())}


def run_layers(layer_set: str, tokens: int, layers: int, interleaved: bool, sampler: CardSampler) -> dict:
    shapes = LAYER_SETS[layer_set]
    weights = [[torch.randn(out, inner, device="cuda", dtype=torch.bfloat16) * inner**-0.5
                for _, inner, out in shapes] for _ in range(2)]  # two layers' weights, alternated
    inputs = {inner: torch.randn(tokens, inner, device="cuda", dtype=torch.bfloat16) for _, inner, _ in shapes}
    gate_up = torch.randn(tokens, 2 * MLP, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)

    def memory_bound() -> None:  # a layer's norms, adds and SiLU * up, by the bytes they move
        gate, up = gate_up.chunk(2, dim=-1)
        F.silu(gate) * up
        for _ in range(2):
            (residual * torch.rsqrt(residual.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)

    def one_pass(record: bool) -> list[list[float]]:
        timings: list[list[tuple]] = []
        for layer in range(layers):
            row = []
            for (name, inner, _), weight in zip(shapes, weights[layer % 2]):
                if record:
                    first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    first.record()
                F.linear(inputs[inner], weight)
                if record:
                    last.record()
                    row.append((first, last))
                if interleaved and name in ("o", "down"):
                    memory_bound()
            timings.append(row)
        torch.cuda.synchronize()
        return [[first.elapsed_time(last) for first, last in row] for row in timings]

    one_pass(False)
    start = time.perf_counter()
    passes = [one_pass(True) for _ in range(4)]
    end = time.perf_counter()
    report: dict = {"shapes": {}}
    total_ms = total_flops = 0.0
    for index, (name, inner, out) in enumerate(shapes):
        times = [row[index] for timings in passes for row in timings]
        ms = statistics.median(times)
        flops = 2 * tokens * inner * out
        report["shapes"][name] = {"mnk": [tokens, out, inner], "median_ms": round(ms, 3),
                                  "tflops": round(flops / (ms * 1e-3) / 1e12, 1)}
        total_ms += ms
        total_flops += flops
    report["layer_gemm_ms"] = round(total_ms, 3)
    report["tflops"] = round(total_flops / (total_ms * 1e-3) / 1e12, 1)
    report["card"] = sampler.between(start, end)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2, help="alternated rounds of every phase")
    parser.add_argument("--out")
    args = parser.parse_args()
    sampler = CardSampler()
    time.sleep(0.3)
    report: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rounds": []}
    for _ in range(args.rounds):
        entry: dict = {"matmul": matmul(sampler, 2.0)}
        for blas in ("cublas", "cublaslt"):
            torch.backends.cuda.preferred_blas_library(blas)
            for layer_set in LAYER_SETS:
                for interleaved in (False, True):
                    key = f"{blas}/{layer_set}/{'interleaved' if interleaved else 'back-to-back'}"
                    entry[key] = run_layers(layer_set, args.tokens, args.layers, interleaved, sampler)
        torch.backends.cuda.preferred_blas_library("cublas")
        entry["matmul_after"] = matmul(sampler, 2.0)
        report["rounds"].append(entry)
    sampler.stop()
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(text)


if __name__ == "__main__":
    main()
