"""``layertap bench``: four ways to extract the same prompts, measured in one process and run.

(a) naive: the HF loop, one prompt at a time, ``output_hidden_states=True``, lm_head
    included, save each file (how EAGLE's original scripts extract);
(p) plain transformers the usual batched way: length-sorted batches of 8, right-padded with
    an attention mask, ``output_hidden_states=True``, lm_head included, save each file;
(b) ceiling: the engine's own batches (``batch_schedule``, packed or padded as the model's
    batching plan says), decoder layers up to the last wanted one, nothing copied or
    written (the bare forward);
(c) engine: layertap's engine in-process (``JobProcessor``), files written;
(d) queue: the whole path, jobs through Redis to a ``layertap worker`` process and
    results back from the stream.

Each part reports tokens/s, GB/s written and MFU: the useful model FLOPs (decoder layers
up to the last wanted one, attention included) over the device's measured matmul rate.
(c) and (d) report the share of wall time the device did no batch work. The naive part
keeps its first files and the engine's files are compared with them (exactness).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from producer.protocol.layers import resolve_layer_ids
from producer.settings import Limits, WorkerSettings
from worker.engine.attention import set_attention, use_packed_attention
from worker.engine.capture import StopForward
from worker.engine.inputs import build_inputs, pad_multiple
from worker.engine.scheduler import plan_batches
from worker.extractor import build_processor
from worker.model.batching import BatchingPath
from worker.model.loading import LoadedModel, compile_decoder_layers, load_model
from worker.model.self_check import relative_error_per_layer

PARTS = ("a", "b", "c", "d")  # the default; "p" is asked for by name
PLAIN_BATCH = 8
COMPARE_PROMPTS = 8


@dataclass
class BenchConfig:
    model: str = "shape:qwen3-8b"
    device: str = "auto"
    dtype: str = "auto"
    layers: list[int] = field(default_factory=lambda: [2, 18, 33, 36])
    prompts: int = 128
    min_len: int = 128
    max_len: int = 2047
    file: str | None = None
    storage: str = "/dev/shm/layertap-bench"
    token_budget: int = 16384
    max_padding: float = WorkerSettings().max_padding  # padded batches (b, c, d)
    parts: tuple[str, ...] = PARTS
    redis_url: str | None = None
    seed: int = 0
    concurrency: int = 64
    memory_check: bool = False
    compile: bool = False
    gpus: str | None = None  # for (d): start `layertap worker --gpus ...` (one worker per GPU)
    backlog: bool = False  # for (d): enqueue every job before the worker starts, then time the drain


@dataclass
class PartResult:
    name: str
    seconds: float
    tokens: int
    jobs: int
    bytes_written: int = 0
    tokens_per_s: float = 0.0
    gb_per_s: float = 0.0
    mfu: float | None = None
    device_idle_share: float | None = None
    peak_memory_gb: float | None = None
    errors: int = 0
    notes: dict[str, Any] = field(default_factory=dict)


def random_prompts(count: int, min_len: int, max_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(count)]


def file_prompts(path: str, tokenizer: Any, count: int) -> list[list[int]]:
    """Prompts from a JSONL file (``prompt`` or ``token_ids`` per line)."""
    prompts = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                row = json.loads(line)
                prompts.append(row["token_ids"] if "token_ids" in row else tokenizer(row["prompt"])["input_ids"])
            if len(prompts) >= count:
                break
    return prompts


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_loop(step: Any, batches: list[list[int]], device: torch.device, warm_up: list[int] | None = None) -> float:
    """Seconds for ``step(batch)`` over every batch, after one untimed ``step(warm_up)`` (default: the first)."""
    step(warm_up or batches[0])
    sync(device)
    start = time.perf_counter()
    for batch in batches:
        step(batch)
    sync(device)
    return time.perf_counter() - start


def matmul_rate(device: torch.device) -> float:
    """Measured dense matmul FLOP/s (bf16 8192^3 on a GPU, float32 1024^3 on the CPU), median of 10."""
    size, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (1024, torch.float32)
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    times = []
    for _ in range(10):
        start = time.perf_counter()
        a @ b
        sync(device)
        times.append(time.perf_counter() - start)
    return 2 * size**3 / statistics.median(times)


def useful_flops(loaded: LoadedModel, layer_ids: list[int], lengths: list[int]) -> float:
    """FLOPs of the decoder layers up to the last wanted one: 2 x params per token + causal attention."""
    run = max(layer_ids)  # id m < L needs layers 0..m-1; id L needs all L
    params = sum(p.numel() for layer in list(loaded.layers)[:run] for p in layer.parameters())
    config = loaded.model.config.get_text_config()
    heads = getattr(config, "num_attention_heads", None) or config.n_head
    head_dim = getattr(config, "head_dim", None) or loaded.hidden_size // heads
    attention = sum(2 * n * n * heads * head_dim for n in lengths) * run
    return 2 * params * sum(lengths) + attention


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*.safetensors")) if path.exists() else 0


@contextlib.contextmanager
def plain_transformers(loaded: LoadedModel, out: Path) -> Iterator[dict[str, torch.Tensor]]:
    """The model on transformers' own attention, with the last decoder layer's output caught
    in the yielded dict (``"h"``: id ``L``, before the final norm); restored on exit."""
    set_attention(loaded.model, loaded.native_attention)
    out.mkdir(parents=True, exist_ok=True)
    last: dict[str, torch.Tensor] = {}
    handle = loaded.layers[-1].register_forward_hook(
        lambda m, a, o: last.__setitem__("h", o[0] if isinstance(o, tuple) else o))
    try:
        yield last
    finally:
        handle.remove()
        if loaded.batching.path is BatchingPath.packed:
            use_packed_attention(loaded.model)


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
    path = loaded.batching.path
    pad_to = pad_multiple(device)
    batches = plan_batches(lengths, padded=path is BatchingPath.padded, token_budget=budget,
                           max_jobs=WorkerSettings().max_batch_jobs, pad_to=pad_to, max_padding=max_padding)
    tokens = [torch.tensor(p, dtype=torch.long) for p in prompts]

    def forward(batch: list[int]) -> None:
        inputs = build_inputs([tokens[i] for i in batch], path, device, pad_to=pad_to)
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
    return PartResult(f"b: forward-only ceiling ({path.value})", seconds, sum(lengths), len(prompts),
                      notes={"batches": len(batches)})


def run_engine(loaded: LoadedModel, prompts: list[list[int]], layer_ids: list[int], out: Path,
               budget: int, concurrency: int, max_padding: float = WorkerSettings().max_padding
               ) -> tuple[PartResult, list[str]]:
    """(c) the engine in-process: JobProcessor on task threads, files written."""
    from concurrent.futures import ThreadPoolExecutor

    processor = build_processor(loaded, storage_root=out, worker_name="bench", layers=layer_ids,
                                limits=Limits(), token_budget=budget, max_padding=max_padding)  # compiled if asked
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
    part = PartResult("c: engine in-process", seconds, sum(map(len, prompts)), len(prompts), dir_bytes(out),
                      errors=sum(not r.ok for r in results),
                      device_idle_share=max(0.0, 1 - busy / seconds),
                      notes={"batches": engine.stats.batches, "oom_splits": engine.stats.oom_splits})
    if loaded.device.type == "cuda":
        part.peak_memory_gb = torch.cuda.max_memory_allocated(loaded.device) / 1e9
    if part.errors:
        part.notes["first_error"] = next(r.error for r in results if not r.ok)
    return part, [r.path or "" for r in results]


def run_queue(cfg: BenchConfig, prompts: list[list[int]], layer_ids: list[int], out: Path) -> PartResult:
    """(d) Redis -> Celery worker process -> files -> results on the stream."""
    from producer.client.client import Client, NoWorkerWarning
    from producer.dev.redis_server import RedisServer
    from producer.settings import Settings

    server = None if cfg.redis_url else RedisServer().start()
    url = cfg.redis_url or server.url  # type: ignore[union-attr]
    node = f"bench-{os.getpid()}@{socket.gethostname()}"
    name = "bench-model"
    env = {**os.environ, "LAYERTAP_REDIS_URL": url, "LAYERTAP_STORAGE_ROOT": str(out),
           "LAYERTAP_WORKER__CONCURRENCY": str(cfg.concurrency), "LAYERTAP_WORKER__COMPILE": str(cfg.compile).lower(),
           "LAYERTAP_WORKER__MAX_PADDING": str(cfg.max_padding)}
    log = open(out.parent / "bench-worker.log", "w")
    placement = ["--node-name", node, "--device", cfg.device] if not cfg.gpus else (
        ["--gpus", cfg.gpus] + (["--device", cfg.device] if cfg.device != "auto" else []))
    worker: subprocess.Popen[bytes] | None = None

    def start_worker() -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, "-m", "producer", "worker", "--model", cfg.model, "--name", name, *placement,
             "--dtype", cfg.dtype, "--layers", ",".join(map(str, layer_ids)), "--token-budget",
             str(cfg.token_budget), "--loglevel", "WARNING"], env=env, stdout=log, stderr=subprocess.STDOUT)

    expected = len(cfg.gpus.split(",")) if cfg.gpus else 1
    run = f"bench-{int(time.time())}"
    try:
        with Client(Settings(redis_url=url)) as client:
            deadline = time.monotonic() + 600

            def submit_all() -> list[str]:  # in bundles unless LAYERTAP_BUNDLE__MAX_JOBS=1
                jobs = ({"token_ids": ids, "job_id": f"p{i}"} for i, ids in enumerate(prompts))
                return [job.job_id for job in client.submit_many(jobs, model=name, run=run, layers=layer_ids)]

            def serving() -> dict[str, Any]:
                return {n: i for n, i in client.workers().items() if i["model"] == name}

            with warnings.catch_warnings():  # a backlog is queued before its worker starts, on purpose
                warnings.simplefilter("ignore", NoWorkerWarning)
                job_ids = submit_all() if cfg.backlog else []
            worker = start_worker()
            while len(serving()) < expected:
                if worker.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"bench worker did not start; see {log.name}")
                time.sleep(0.05)
            engines_before = [i["engine"] for i in serving().values()]
            start = time.perf_counter()
            if not cfg.backlog:
                job_ids = submit_all()
            results = client.wait(run, job_ids, timeout=3600)
            seconds = time.perf_counter() - start
            time.sleep(max(0.3, client.settings.orphan_timeout / 4 + 0.2))  # one more heartbeat with final stats
            engines_after = [i["engine"] for i in serving().values()]
    finally:
        if worker is not None:
            worker.terminate()
            worker.wait(60)
        log.close()
        if server is not None:
            server.close()

    def engine_delta(key: str) -> float:
        return sum(e[key] for e in engines_after) - sum(e[key] for e in engines_before)

    busy = engine_delta("busy_s") / expected
    errors = [r for r in results.values() if not r.ok]
    label = f"d: queue end to end, {expected} workers (--gpus {cfg.gpus})" if cfg.gpus else "d: queue end to end"
    if cfg.backlog:
        label += ", draining a backlog"
    part = PartResult(label, seconds, sum(map(len, prompts)), len(prompts), dir_bytes(out),
                      errors=len(errors), device_idle_share=max(0.0, 1 - busy / seconds))
    if errors:
        part.notes["first_error"] = errors[0].error
    finished = sorted(r.finished_at for r in results.values())
    if len(finished) > 1 and finished[-1] > finished[0]:  # the workers' own pace
        part.notes["jobs_per_s_first_to_last_result"] = round((len(finished) - 1) / (finished[-1] - finished[0]), 1)
    part.notes["jobs_per_s"] = round(len(prompts) / seconds, 1)
    part.notes["batches"] = int(engine_delta("batches"))
    bundle = Settings().bundle
    part.notes["bundle"] = f"max_jobs={bundle.max_jobs} max_tokens={bundle.max_tokens}" if bundle.max_jobs > 1 \
        else "off"
    return part


def compare(naive_dir: Path, engine_paths: list[str], count: int) -> dict[str, Any]:
    """Engine files against the naive unbatched HF files: max abs error and relative (Frobenius)
    error, overall and per layer slot."""
    worst_abs, worst_rel, per_layer = 0.0, 0.0, []
    for index in range(min(count, len(engine_paths))):
        reference = load_file(str(naive_dir / f"{index}.safetensors"))["hidden_states"].float()
        got = load_file(engine_paths[index])["hidden_states"].float()
        worst_abs = max(worst_abs, (got - reference).abs().max().item())
        worst_rel = max(worst_rel, ((got - reference).norm() / reference.norm()).item())
        layer_rel = relative_error_per_layer(got, reference).tolist()
        per_layer = [max(a, b) for a, b in zip(per_layer, layer_rel)] if per_layer else layer_rel
    return {"max_abs_error": worst_abs, "max_relative_error": worst_rel, "relative_error_per_layer": per_layer,
            "prompts_compared": min(count, len(engine_paths))}


def fp32_reference_errors(loaded: LoadedModel, prompts: list[list[int]], layer_ids: list[int], naive_dir: Path,
                          engine_paths: list[str], count: int = 4) -> dict[str, list[float]]:
    """Relative error per layer of the naive bf16 files and of the engine's bf16 files against
    an unbatched float32 HF run of the same weights: how far each is from exact."""
    from transformers import AutoModelForCausalLM

    with torch.device(loaded.device):
        reference = AutoModelForCausalLM.from_config(loaded.model.config, dtype=torch.float32,
                                                     attn_implementation=loaded.native_attention).eval()
    reference.load_state_dict(loaded.model.state_dict())
    decoder_layers = reference.get_decoder().layers
    last: dict[str, torch.Tensor] = {}
    handle = decoder_layers[-1].register_forward_hook(lambda m, a, o: last.__setitem__("h", o[0] if isinstance(o, tuple) else o))
    naive_err: list[float] = []
    engine_err: list[float] = []
    try:
        for index in range(min(count, len(engine_paths))):
            with torch.inference_mode():
                out = reference(torch.tensor([prompts[index]], device=loaded.device), output_hidden_states=True,
                                use_cache=False)
            exact = torch.stack([last["h"][0] if i == loaded.num_layers else out.hidden_states[i][0]
                                 for i in layer_ids], 1).float().cpu()
            for errors, path in ((naive_err, naive_dir / f"{index}.safetensors"), (engine_err, Path(engine_paths[index]))):
                got = load_file(str(path))["hidden_states"].float()
                rel = relative_error_per_layer(got, exact).tolist()
                errors[:] = [max(a, b) for a, b in zip(errors, rel)] if errors else rel
    finally:
        handle.remove()
        del reference
        torch.cuda.empty_cache() if loaded.device.type == "cuda" else None
    return {"naive_bf16_vs_fp32": naive_err, "engine_vs_fp32": engine_err}


def memory_check(loaded: LoadedModel, layer_ids: list[int], budget: int) -> dict[str, Any]:
    """Peak device memory for one 16k-token prompt and for 64 prompts of 2k tokens."""
    from concurrent.futures import ThreadPoolExecutor

    report: dict[str, Any] = {}
    processor = build_processor(loaded, storage_root=Path("/dev/shm/layertap-memcheck"), worker_name="memcheck",
                                layers=layer_ids, limits=Limits(), token_budget=budget)
    weights = sum(p.numel() * p.element_size() for p in loaded.model.parameters()) / 1e9
    try:
        for label, prompts in (("one 16k prompt", random_prompts(1, 16384, 16384, loaded.vocab_size, 1)),
                               ("64 x 2k prompts", random_prompts(64, 2048, 2048, loaded.vocab_size, 2))):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(loaded.device)
            jobs = [{"model": loaded.name, "run": "mem", "job_id": f"m{i}", "token_ids": p} for i, p in enumerate(prompts)]
            with ThreadPoolExecutor(64) as pool:
                results = list(pool.map(processor.process, jobs))
            report[label] = {"ok": sum(r.ok for r in results), "jobs": len(results),
                             "peak_gb": torch.cuda.max_memory_allocated(loaded.device) / 1e9,
                             "errors": sorted({r.error_type.value for r in results if not r.ok})}
    finally:
        processor.engine.stop()
        shutil.rmtree("/dev/shm/layertap-memcheck", ignore_errors=True)
    report["weights_gb"] = weights
    return report


#: A file the bench leaves in its storage folder: the folder is the bench's to empty.
BENCH_MARKER = ".layertap-bench"


def claim_storage(storage: Path) -> None:
    """Make ``storage`` the bench's folder: new, empty, or made by an earlier bench (it has
    :data:`BENCH_MARKER`). A folder holding anything else is refused, never emptied."""
    if storage.exists() and any(storage.iterdir()) and not (storage / BENCH_MARKER).exists():
        raise ValueError(f"--storage {storage} is not empty and was not made by layertap bench; "
                         "give a new or empty folder (the bench deletes what it writes there)")
    storage.mkdir(parents=True, exist_ok=True)
    (storage / BENCH_MARKER).touch()
    for name in ("a", "c", "d"):  # an interrupted earlier bench's files
        shutil.rmtree(storage / name, ignore_errors=True)


def run_bench(cfg: BenchConfig, log: Any = print) -> dict[str, Any]:
    storage = Path(cfg.storage)
    claim_storage(storage)
    loaded = load_model(cfg.model, name="bench-model", device=cfg.device, dtype=cfg.dtype)
    layer_ids = resolve_layer_ids(cfg.layers, loaded.num_layers)
    if cfg.file:
        prompts = file_prompts(cfg.file, loaded.tokenizer, cfg.prompts)
    else:
        prompts = random_prompts(cfg.prompts, cfg.min_len, cfg.max_len, loaded.vocab_size, cfg.seed)
    lengths = [len(p) for p in prompts]
    batching = loaded.batching.describe()
    rate = matmul_rate(loaded.device)
    flops = useful_flops(loaded, layer_ids, lengths)
    log(f"model {cfg.model} ({loaded.num_layers} layers, {loaded.dtype}) on {loaded.device}; {len(prompts)} prompts, "
        f"{sum(lengths)} tokens; layers {layer_ids}; matmul {rate / 1e12:.1f} TFLOP/s; batching {batching}")
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
        parts["b"] = run_forward_only(loaded, prompts, layer_ids, cfg.token_budget, cfg.max_padding)
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
    memory = memory_check(loaded, layer_ids, cfg.token_budget) if cfg.memory_check and loaded.device.type == "cuda" else None
    if "d" in cfg.parts:
        if loaded.device.type == "cuda":
            del loaded
            torch.cuda.empty_cache()
        parts["d"] = run_queue(cfg, prompts, layer_ids, storage / "d")
        shutil.rmtree(storage / "d", ignore_errors=True)
        log(f"  {parts['d'].name}: {parts['d'].tokens / parts['d'].seconds:,.0f} tokens/s")
    for part in parts.values():
        part.tokens_per_s = part.tokens / part.seconds
        part.gb_per_s = part.bytes_written / part.seconds / 1e9
        part.mfu = flops / part.seconds / rate
    ratios = {}
    speed = {key: part.tokens_per_s for key, part in parts.items()}
    for top, bottom in (("c", "a"), ("d", "a"), ("d", "p"), ("d", "b"), ("c", "b")):
        if top in speed and bottom in speed:
            ratios[f"{top}/{bottom}"] = speed[top] / speed[bottom]
    return {
        "config": asdict(cfg), "device": device_name(), "software": software_versions(),
        "date": time.strftime("%Y-%m-%d"), "prompts": len(prompts), "tokens": sum(lengths), "batching": batching,
        "layer_ids": layer_ids, "matmul_tflops": rate / 1e12, "useful_gflop_per_token": flops / sum(lengths) / 1e9,
        "parts": {key: asdict(part) for key, part in parts.items()}, "ratios": ratios,
        "exactness_vs_unbatched_hf": exactness, "memory": memory,
    }


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    import platform

    return f"CPU {platform.processor() or platform.machine()} x{os.cpu_count()}"


def software_versions() -> dict[str, str]:
    import celery
    import safetensors
    import transformers

    return {"python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__,
            "safetensors": safetensors.__version__, "celery": celery.__version__,
            "cuda": torch.version.cuda or "none"}


def format_table(report: dict[str, Any]) -> str:
    """A markdown table of the parts, then ratios and notes."""
    lines = ["| part | tokens/s | GB/s written | MFU | device idle | seconds | errors |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for part in report["parts"].values():
        idle = "" if part["device_idle_share"] is None else f"{part['device_idle_share']:.1%}"
        lines.append(f"| {part['name']} | {part['tokens_per_s']:,.0f} | {part['gb_per_s']:.2f} | {part['mfu']:.1%} | "
                     f"{idle} | {part['seconds']:.2f} | {part['errors']} |")
    for key, part in report["parts"].items():
        if "jobs_per_s" in part["notes"]:
            lines.append(f"{part['name']}: {part['notes']['jobs_per_s']} jobs/s over the whole part, "
                         f"{part['notes'].get('jobs_per_s_first_to_last_result')} jobs/s first to last result")
    lines.append("")
    lines.append("ratios: " + ", ".join(f"{k} = {v:.2f}" for k, v in report["ratios"].items()))
    if report.get("exactness_vs_unbatched_hf"):
        e = report["exactness_vs_unbatched_hf"]
        per_layer = ", ".join(f"{layer}: {err:.2g}" for layer, err in zip(report["layer_ids"], e["relative_error_per_layer"]))
        lines.append(f"engine vs unbatched HF ({e['prompts_compared']} prompts): max abs error {e['max_abs_error']:.3g}, "
                     f"max relative error {e['max_relative_error']:.3g}; per layer {per_layer}")
        for key in ("naive_bf16_vs_fp32", "engine_vs_fp32"):
            if key in e:
                lines.append(f"{key} relative error per layer: "
                             + ", ".join(f"{layer}: {err:.2g}" for layer, err in zip(report["layer_ids"], e[key])))
    if report.get("memory"):
        lines.append("memory: " + json.dumps(report["memory"]))
    return "\n".join(lines)

