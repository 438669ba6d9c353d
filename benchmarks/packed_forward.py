"""Time one packed forward of N small prompts: layertap's per-prompt attention calls
against one SDPA call over the whole row with a block-diagonal causal mask.

    python benchmarks/packed_forward.py --model /tmp/bench-tiny --device cpu

What it answers: how much of a small-jobs batch is Python per prompt, and whether a
single masked attention call would be cheaper (it is not, on the CPU). The masked
variant exists only here, for the comparison.
"""

from __future__ import annotations

import argparse
import itertools
import time

import torch
import torch.nn.functional as F

import layertap.worker.model.attention as packed
from layertap.worker.model.loading import load_model


def masked_row(query, key, value, output, bounds, scaling, sliding_window, gqa) -> None:
    """One SDPA call over the packed row; a prompt attends causally within itself only."""
    lengths = torch.tensor([end - start for start, end in zip(bounds[:-1], bounds[1:])])
    prompt = torch.repeat_interleave(torch.arange(len(lengths)), lengths).to(query.device)
    index = torch.arange(query.shape[2], device=query.device)
    mask = (prompt[:, None] == prompt[None, :]) & (index[:, None] >= index[None, :])
    output.copy_(F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling,
                                                enable_gqa=gqa).transpose(1, 2))


def time_forward(decoder: torch.nn.Module, lengths: list[int], vocab: int, device: torch.device,
                 repeats: int) -> float:
    """Milliseconds per forward of ``lengths`` packed into one row."""
    bounds = [0, *itertools.accumulate(lengths)]
    ids = torch.randint(0, vocab, (1, bounds[-1]), device=device)
    positions = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
    with torch.inference_mode(), packed.packed_sequences(bounds):
        for _ in range(3):
            decoder(input_ids=ids, position_ids=positions, use_cache=False)
        start = time.perf_counter()
        for _ in range(repeats):
            decoder(input_ids=ids, position_ids=positions, use_cache=False)
        if device.type == "cuda":
            torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prompts", default="1,19,64", help="batch sizes (prompts per packed row)")
    parser.add_argument("--min-len", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    torch.manual_seed(0)
    loaded = load_model(args.model, device=args.device)
    packed.use_packed_attention(loaded.model)
    vocab = min(loaded.model.config.vocab_size, 200)
    sizes = [int(n) for n in args.prompts.split(",")]
    batches = {n: torch.randint(args.min_len, args.max_len, (n,)).tolist() for n in sizes}
    per_prompt = {n: time_forward(loaded.decoder, batches[n], vocab, loaded.device, args.repeats) for n in sizes}
    packed._attend_each = masked_row
    masked = {n: time_forward(loaded.decoder, batches[n], vocab, loaded.device, args.repeats) for n in sizes}
    print("| prompts in the row | per-prompt attention, ms | one masked SDPA, ms |")
    print("|---:|---:|---:|")
    for n in sizes:
        print(f"| {n} | {per_prompt[n]:.2f} | {masked[n]:.2f} |")


if __name__ == "__main__":
    main()
