"""``layertap bench``: four ways to extract the same prompts, measured in one process and run.

(a) naive: the HF loop, one prompt at a time, ``output_hidden_states=True``, lm_head
    included, save each file (how EAGLE's original scripts extract);
(p) plain transformers the usual batched way: length-sorted batches of 8, right-padded with
    an attention mask, ``output_hidden_states=True``, lm_head included, save each file;
(b) ceiling: the engine's own batches (its scheduler's policy, packed or padded as the model's
    batching plan says), decoder layers up to the last wanted one, nothing copied or
    written (the bare forward), run on a thread of its own as the engine runs its forwards
    (on a CPU, PyTorch's intra-op threads run the same forward several times slower from
    the main thread: measured there, (b) fell below (c));
(c) engine: layertap's engine in-process (``JobProcessor``), files written;
(d) queue: the whole path, jobs through Redis to a ``layertap worker`` process and
    results back from the stream.

Each part reports tokens/s, GB/s written and MFU: the useful model FLOPs (decoder layers
up to the last wanted one, attention included) over the device's measured matmul rate (no
MFU where no rate was measured). Layers default to EAGLE-3's ``[2, L//2, L-3, L]`` of the
loaded model; a random-weight shape too big for a CPU is refused before anything is built.
(c) and (d) report the share of wall time the device did no batch work. The naive part
keeps its first files and the engine's files are compared with them (exactness).

The parts live in ``parts`` (a, p, b, c and the memory check) and ``queue_part`` (d); the
settings in ``config``, the report table in ``report``. This module runs them in order.
"""

from __future__ import annotations

import gc
import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from layertap.protocol.layers import eagle3_layer_ids, resolve_layer_ids
from layertap.settings import Settings
from layertap.worker.bench.config import BenchConfig, PartResult, check_shape_fits, claim_storage
from layertap.worker.bench.exactness import compare, fp32_reference_errors
from layertap.worker.bench.measure import matmul_rate, on_own_thread, sustained_matmul_rate, useful_flops
from layertap.worker.bench.parts import memory_check, run_engine, run_forward_only, run_naive, run_plain_batched
from layertap.worker.bench.prompts import file_prompts, random_prompts
from layertap.worker.bench.queue_part import run_queue
from layertap.worker.bench.report import device_name, format_flops, format_table, software_versions
from layertap.worker.model.attention import resolved_kernel, use_varlen_kernel
from layertap.worker.model.devices import resolve_device
from layertap.worker.model.loading import load_model
from layertap.worker.model.modes import compile_decoder_layers

__all__ = ["BenchConfig", "format_table", "run_bench"]  # the CLI's imports

COMPARE_PROMPTS = 8


def run_bench(cfg: BenchConfig, log: Any = print) -> dict[str, Any]:
    """Run ``cfg``'s parts on one loaded model and the same prompts (a, p, b, c, the memory check, then d; ``log``
    gets a line each); returns the report (:func:`format_table` prints it, ``--report`` saves it)."""
    check_shape_fits(cfg.model, resolve_device(cfg.device).type)
    storage = Path(cfg.storage)
    claim_storage(storage)
    loaded = load_model(cfg.model, name="bench-model", device=cfg.device, dtype=cfg.dtype,
                        quant_compute=cfg.quant_compute, stages=cfg.split_stages, token_budget=cfg.token_budget,
                        captured_layers=len(cfg.layers) if cfg.layers else None)
    load = {**(loaded.load_report.as_json() if loaded.load_report else {}),
            "quantization": loaded.quantization.describe() if loaded.quantization else None,
            "quant_compute": loaded.quant_compute or None, "experts": loaded.experts,
            "split": loaded.split.describe() if loaded.split is not None else None}
    layer_ids = resolve_layer_ids(eagle3_layer_ids(loaded.num_layers) if cfg.layers is None else cfg.layers,
                                  loaded.num_layers)
    if cfg.file:
        prompts = file_prompts(cfg.file, loaded.tokenizer, cfg.prompts)
    else:
        prompts = random_prompts(cfg.prompts, cfg.min_len, cfg.max_len, loaded.vocab_size, cfg.seed)
    lengths = [len(p) for p in prompts]
    batching = loaded.batching.describe()
    use_varlen_kernel(Settings().worker.attention_kernel)  # (b) and (c) attend as (d)'s worker does (LAYERTAP_ env)
    attention_kernel = resolved_kernel(loaded.device) if loaded.device.type == "cuda" else None
    rate = on_own_thread(loaded.device, matmul_rate, loaded.device)  # as (b) runs
    sustained = on_own_thread(loaded.device, sustained_matmul_rate, loaded.device)
    flops = useful_flops(loaded, layer_ids, lengths)
    log(f"model {cfg.model} ({loaded.num_layers} layers, {loaded.dtype}) on {loaded.device}; {len(prompts)} prompts, "
        f"{sum(lengths)} tokens; layers {layer_ids}; matmul {format_flops(rate)}"
        f"{f' (sustained {format_flops(sustained)})' if sustained else ''}; batching {batching}; "
        f"attention kernel {attention_kernel}")
    parts: dict[str, PartResult] = {}
    exactness: dict[str, float] | None = None
    if "a" in cfg.parts:
        parts["a"] = run_naive(loaded, prompts, layer_ids, storage / "a")
        log(f"  {parts['a'].name}: {parts['a'].tokens / parts['a'].seconds:,.0f} tokens/s")
    if "p" in cfg.parts:
        parts["p"] = run_plain_batched(loaded, prompts, layer_ids, storage / "p")
        shutil.rmtree(storage / "p", ignore_errors=True)
        log(f"  {parts['p'].name}: {parts['p'].tokens / parts['p'].seconds:,.0f} tokens/s")
    if cfg.compile:
        compile_decoder_layers(loaded)
    if "b" in cfg.parts:
        parts["b"] = on_own_thread(loaded.device, run_forward_only, loaded, prompts, layer_ids, cfg.token_budget,
                                   cfg.max_padding)
        log(f"  {parts['b'].name}: {parts['b'].tokens / parts['b'].seconds:,.0f} tokens/s")
    if "c" in cfg.parts:
        parts["c"], engine_paths = run_engine(loaded, prompts, layer_ids, storage / "c", cfg.token_budget,
                                              cfg.concurrency, cfg.max_padding)
        log(f"  {parts['c'].name}: {parts['c'].tokens / parts['c'].seconds:,.0f} tokens/s")
        if "a" in cfg.parts:
            exactness = compare(storage / "a", engine_paths, COMPARE_PROMPTS)
            if loaded.dtype != torch.float32:
                exactness.update(fp32_reference_errors(loaded, prompts, layer_ids, storage / "a", engine_paths))
    for name in ("a", "c"):
        shutil.rmtree(storage / name, ignore_errors=True)
    memory = (memory_check(loaded, layer_ids, cfg.token_budget)
              if cfg.memory_check and loaded.device.type == "cuda" else None)
    if "d" in cfg.parts:
        if loaded.device.type == "cuda":
            del loaded
            gc.collect()  # a split model's hooks hold cycles (accelerate's module -> forward -> module)
            torch.cuda.empty_cache()
        parts["d"] = run_queue(cfg, prompts, layer_ids, storage / "d")
        shutil.rmtree(storage / "d", ignore_errors=True)
        log(f"  {parts['d'].name}: {parts['d'].tokens / parts['d'].seconds:,.0f} tokens/s")
    for part in parts.values():
        part.fill_rates(flops, rate)
    ratios = {}
    speed = {key: part.tokens_per_s for key, part in parts.items()}
    for top, bottom in (("c", "a"), ("d", "a"), ("d", "p"), ("d", "b"), ("c", "b")):
        if top in speed and bottom in speed:
            ratios[f"{top}/{bottom}"] = speed[top] / speed[bottom]
    return {
        "config": asdict(cfg), "device": device_name(), "software": software_versions(),
        "date": time.strftime("%Y-%m-%d"), "prompts": len(prompts), "tokens": sum(lengths), "batching": batching,
        "attention_kernel": attention_kernel, "layer_ids": layer_ids, "matmul_tflops": rate / 1e12,
        "matmul_tflops_sustained": sustained / 1e12,
        "useful_gflop_per_token": flops / sum(lengths) / 1e9,
        "parts": {key: asdict(part) for key, part in parts.items()}, "ratios": ratios,
        "exactness_vs_unbatched_hf": exactness, "memory": memory, "load": load,
    }
