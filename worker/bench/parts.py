"""The in-process parts of ``layertap bench``, each on the same loaded model and prompts:
(a) naive HF loop, (p) plain HF padded batches, (b) the engine's batches with the bare
forward (the ceiling), (c) the engine with files written; and the peak-memory check.

(b) and (c) batch alike: (b) plans its batches with the engine's own policy
(``layertap.worker.engine.inputs.batch_policy``) and lays them out with the model's layout.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from layertap.settings import Limits, WorkerSettings
from layertap.worker.bench.config import PartResult
from layertap.worker.bench.measure import dir_bytes, sync, timed_loop
from layertap.worker.bench.prompts import random_prompts
from layertap.worker.engine.inputs import batch_policy, pad_multiple
from layertap.worker.extractor import build_processor
from layertap.worker.model.capture import StopForward
from layertap.worker.model.loading import LoadedModel
from layertap.worker.model.modes import transformers_attention

PLAIN_BATCH = 8  # (p): prompts per batch
#: (b) and (c) take at most this many jobs per batch, as a worker does by default.
MAX_BATCH_JOBS = WorkerSettings().max_batch_jobs


@contextlib.contextmanager
def plain_transformers(loaded: LoadedModel, out: Path) -> Iterator[dict[str, torch.Tensor]]:
    """The model on transformers' own attention, with the last decoder layer's output caught
    in the yielded dict (``"h"``: id ``L``, before the final norm); restored on exit."""
    out.mkdir(parents=True, exist_ok=True)
    last: dict[str, torch.Tensor] = {}
    with transformers_attention(loaded):
        handle = loaded.layers[-1].register_forward_hook(
            lambda m, a, o: last.__setitem__("h", o[0] if isinstance(o, tuple) else o))
        try:
            yield last
        finally:
            handle.remove()


def save_row(path: Path, output: Any, last: dict[str, torch.Tensor], row: int, ids: list[int],
             layer_ids: list[int], num_layers: int) -> None:
    """Save one prompt's layers (row ``row`` of a transformers output, its real tokens only)."""
    n = len(ids)
    states = [last["h"][row, :n] if i == num_layers else output.hidden_states[i][row, :n] for i in layer_ids]
    save_file({"hidden_states": torch.stack(states, 1).cpu().contiguous(), "token_ids": torch.tensor(ids)},
              str(path))


def run_naive(loaded: LoadedModel, prompts: list[list[int]], layer_ids: list[int], out: Path) -> PartResult:
    """(a) one prompt at a time through the whole CausalLM with output_hidden_states=True."""
    model, device = loaded.model, loaded.device
    with plain_transformers(loaded, out) as last:
        def one(batch: list[int]) -> None:
            index = batch[0]
            ids = prompts[index] if index >= 0 else prompts[0][:64]
            with torch.inference_mode():
                output = model(torch.tensor([ids], device=device), output_hidden_states=True, use_cache=False)
            save_row(out / f"{index}.safetensors", output, last, 0, ids, layer_ids, loaded.num_layers)

        seconds = timed_loop(one, [[i] for i in range(len(prompts))], device, warm_up=[-1])
        (out / "-1.safetensors").unlink()
    return PartResult("a: naive HF loop", seconds, sum(map(len, prompts)), len(prompts), dir_bytes(out))


def run_plain_batched(loaded: LoadedModel, prompts: list[list[int]], layer_ids: list[int], out: Path) -> PartResult:
    """(p) plain transformers batched the usual way: length-sorted batches of 8, right-padded
    with an attention mask, ``output_hidden_states=True``, lm_head included, save each file."""
    model, device = loaded.model, loaded.device
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    batches = [order[i:i + PLAIN_BATCH] for i in range(0, len(order), PLAIN_BATCH)]
    with plain_transformers(loaded, out) as last:
        def one(batch: list[int]) -> None:
            width = max(len(prompts[i]) for i in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for row, index in enumerate(batch):
                ids[row, :len(prompts[index])] = torch.tensor(prompts[index])
                mask[row, :len(prompts[index])] = 1
            with torch.inference_mode():
                output = model(ids.to(device), attention_mask=mask.to(device), output_hidden_states=True,
                               use_cache=False)
            for row, index in enumerate(batch):
                save_row(out / f"{index}.safetensors", output, last, row, prompts[index], layer_ids, loaded.num_layers)

        seconds = timed_loop(one, batches, device)
    return PartResult(f"p: plain HF, length-sorted padded batches of {PLAIN_BATCH}", seconds,
                      sum(map(len, prompts)), len(prompts), dir_bytes(out), notes={"batches": len(batches)})


def ceiling_batches(loaded: LoadedModel, lengths: list[int], budget: int,
                    max_padding: float = WorkerSettings().max_padding) -> list[list[int]]:
    """(b)'s batches: the ones an engine with the same settings takes from a backlog of these jobs."""
    return batch_policy(loaded, token_budget=budget, max_jobs=MAX_BATCH_JOBS, max_padding=max_padding).plan(lengths)


def run_forward_only(loaded: LoadedModel, prompts: list[list[int]], layer_ids: list[int], budget: int,
                     max_padding: float = WorkerSettings().max_padding) -> PartResult:
    """(b) the engine's batches (packed or padded, as the model's plan says), decoder layers up
    to the last wanted one, nothing copied or written."""
    device = loaded.device
    top = max(layer_ids)
    stop_module = loaded.layers[top] if top < loaded.num_layers else None

    def stop(*_: Any, **__: Any) -> None:
        raise StopForward

    handle = stop_module.register_forward_pre_hook(stop) if stop_module is not None else None
    lengths = [len(p) for p in prompts]
    layout = loaded.batching
    pad_to = pad_multiple(device)
    batches = ceiling_batches(loaded, lengths, budget, max_padding)
    tokens = [torch.tensor(p, dtype=torch.long) for p in prompts]

    def forward(batch: list[int]) -> None:
        inputs = layout.build_inputs([tokens[i] for i in batch], device, pad_to=pad_to)
        with torch.inference_mode():
            try:
                inputs.run(loaded.decoder)
            except StopForward:
                pass

    try:
        seconds = timed_loop(forward, batches, device)
    finally:
        if handle is not None:
            handle.remove()
    return PartResult(f"b: forward-only ceiling ({layout.name})", seconds, sum(lengths), len(prompts),
                      notes={"batches": len(batches)})


def run_engine(loaded: LoadedModel, prompts: list[list[int]], layer_ids: list[int], out: Path,
               budget: int, concurrency: int, max_padding: float = WorkerSettings().max_padding
               ) -> tuple[PartResult, list[str]]:
    """(c) the engine in-process: JobProcessor on task threads, files written."""
    processor = build_processor(loaded, storage_root=out, worker_name="bench", layers=layer_ids,
                                limits=Limits(), token_budget=budget, max_batch_jobs=MAX_BATCH_JOBS,
                                max_padding=max_padding)  # compiled if asked
    engine = processor.engine
    try:
        engine.warm_up()
        jobs = [{"model": loaded.name, "run": "c", "job_id": f"p{i}", "token_ids": ids, "layers": layer_ids}
                for i, ids in enumerate(prompts)]
        sync(loaded.device)
        if loaded.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(loaded.device)
        busy_before = engine.busy_seconds()
        start = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            results = list(pool.map(processor.process, jobs))
        seconds = time.perf_counter() - start
        busy = engine.busy_seconds() - busy_before
    finally:
        engine.stop()
    tokens = sum(len(prompt) for prompt, result in zip(prompts, results) if result.ok)  # errors computed nothing
    part = PartResult("c: engine in-process", seconds, tokens, len(prompts), dir_bytes(out),
                      errors=sum(not r.ok for r in results),
                      device_idle_share=max(0.0, 1 - busy / seconds),
                      notes={"batches": engine.stats.batches, "oom_splits": engine.stats.oom_splits})
    if loaded.device.type == "cuda":
        part.peak_memory_gb = torch.cuda.max_memory_allocated(loaded.device) / 1e9
    if part.errors:
        part.notes["first_error"] = next(r.error for r in results if not r.ok)
    return part, [r.path or "" for r in results]


def memory_check(loaded: LoadedModel, layer_ids: list[int], budget: int) -> dict[str, Any]:
    """Peak device memory for one 16k-token prompt and for 64 prompts of 2k tokens."""
    report: dict[str, Any] = {}
    processor = build_processor(loaded, storage_root=Path("/dev/shm/layertap-memcheck"), worker_name="memcheck",
                                layers=layer_ids, limits=Limits(), token_budget=budget)
    weights = sum(p.numel() * p.element_size() for p in loaded.model.parameters()) / 1e9
    try:
        for label, prompts in (("one 16k prompt", random_prompts(1, 16384, 16384, loaded.vocab_size, 1)),
                               ("64 x 2k prompts", random_prompts(64, 2048, 2048, loaded.vocab_size, 2))):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(loaded.device)
            jobs = [{"model": loaded.name, "run": "mem", "job_id": f"m{i}", "token_ids": p}
                    for i, p in enumerate(prompts)]
            with ThreadPoolExecutor(64) as pool:
                results = list(pool.map(processor.process, jobs))
            report[label] = {"ok": sum(r.ok for r in results), "jobs": len(results),
                             "peak_gb": torch.cuda.max_memory_allocated(loaded.device) / 1e9,
                             "errors": sorted({r.error_type.value for r in results if not r.ok})}
    finally:
        processor.close()
        shutil.rmtree("/dev/shm/layertap-memcheck", ignore_errors=True)
    report["weights_gb"] = weights
    return report
