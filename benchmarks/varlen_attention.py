"""Packed attention on a GPU: one variable-length flash call per layer against one SDPA
(flash) call per prompt, on Qwen3-8B's attention shape (32 query heads, 8 KV heads, dim 128).

    python benchmarks/varlen_attention.py [--budget 16384] [--batches 20]

Prompts of 128-2047 random lengths are packed into rows of at most ``--budget`` tokens,
as the engine does. Prints milliseconds per layer call for each way and the largest
difference between their outputs (bf16).
"""

from __future__ import annotations

import argparse
import itertools
import json
import random

import torch
from torch.nn.attention import sdpa_kernel

import layertap.worker.model.attention as packed


def rows(budget: int, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    batches = []
    for _ in range(count):
        lengths: list[int] = []
        while True:
            length = rng.randint(128, 2047)
            if sum(lengths) + length > budget:
                break
            lengths.append(length)
        batches.append([0, *itertools.accumulate(lengths)])
    return batches


def per_prompt(query, key, value, bounds):
    output = query.new_empty(1, query.shape[2], query.shape[1], query.shape[3])
    with sdpa_kernel(packed.CUDA_BACKENDS):
        packed._attend_each(query, key, value, output, bounds, None, None, True)
    return output


def varlen(query, key, value, bounds):
    longest = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
    with packed.packed_sequences(bounds):
        return packed._attend_varlen(query, key, value, bounds, longest, None)


def time_ms(fn, args_list, repeats: int = 3) -> float:
    for args in args_list[:2]:
        fn(*args)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        for args in args_list:
            fn(*args)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / (repeats * len(args_list))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget", type=int, default=16384)
    parser.add_argument("--batches", type=int, default=20)
    args = parser.parse_args()
    device = torch.device("cuda")
    inputs = []
    for bounds in rows(args.budget, args.batches, 0):
        total = bounds[-1]
        # transformers' layout: [1, T, H, D] transposed to [1, H, T, D]
        query = torch.randn(1, total, 32, 128, device=device, dtype=torch.bfloat16).transpose(1, 2)
        key = torch.randn(1, total, 8, 128, device=device, dtype=torch.bfloat16).transpose(1, 2)
        value = torch.randn(1, total, 8, 128, device=device, dtype=torch.bfloat16).transpose(1, 2)
        inputs.append((query, key, value, bounds))
    pairs = [(per_prompt(*a), varlen(*a)) for a in inputs]
    worst = max((old.float() - new.float()).abs().max().item() for old, new in pairs)
    identical = all(torch.equal(old, new) for old, new in pairs)
    del pairs
    report = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "budget": args.budget,
              "prompts_per_row": round(sum(len(a[3]) - 1 for a in inputs) / len(inputs), 1),
              "per_prompt_sdpa_ms": round(time_ms(per_prompt, inputs), 3),
              "varlen_flash_ms": round(time_ms(varlen, inputs), 3),
              "max_abs_difference": worst, "bit_identical": identical}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
