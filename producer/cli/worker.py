"""``layertap worker``, ``make-tiny-model`` and ``bench``: the commands that run the worker
package (torch). The only module of ``producer`` that imports ``worker``, and only inside
the commands, so the client install runs every other command."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Optional

import typer

from layertap.extras import require
from layertap.producer.cli.common import console, load_settings, parse_layers, worker_default
from layertap.settings import LogFormat, Settings


def register(app: typer.Typer) -> None:
    """Add the worker-side commands to the ``layertap`` app."""
    app.command()(worker)
    app.command("make-tiny-model")(make_tiny_model)
    app.command()(bench)


def worker(
    model: str = typer.Option(..., "--model", help="Model folder or hub id to load."),
    name: Optional[str] = typer.Option(None, "--name", help="Model name jobs use (default: the folder's name, "
                                "org/name for a hub cache snapshot, else --model as given)."),
    layers: Optional[str] = typer.Option(None, help="Default layer ids, e.g. 2,18,-1 (default: EAGLE-3's)."),
    chat_template: Optional[str] = typer.Option(None, help="Jinja chat template file to use instead of the model's."),
    device: Optional[str] = typer.Option(None, help=f"auto | cpu | cuda | cuda:N ({worker_default('device')})."),
    dtype: Optional[str] = typer.Option(None, help="auto | bfloat16 | float16 | float32, or bf16 | fp16 | fp32 "
                                        f"({worker_default('dtype')}: bfloat16 on a GPU, float32 on the CPU)."),
    storage: Optional[str] = typer.Option(None, "--storage-root", "--storage", help="Storage root for files: a "
                                          "folder or an object store URL such as s3://bucket/prefix (setting "
                                          "storage_root; default layertap-data, made absolute at start)."),
    node_name: Optional[str] = typer.Option(None, help="Celery node name (default layertap-<pid>@<host>)."),
    token_budget: Optional[int] = typer.Option(None, help="Tokens per batch, padded batches counting their padding "
                                               f"({worker_default('token_budget')})."),
    batching: Optional[str] = typer.Option(None, help="auto, or a batching layout to force "
                                           "(layertap.worker.model.batching.LAYOUTS): how jobs share a forward (auto: "
                                           "from the model's structure; either way checked at start)."),
    quant_compute: Optional[str] = typer.Option(None, help="Quantized checkpoints: auto | dequant | fp8 (auto: fp8 "
                                                "matmuls where the GPU has them, else dequantize layer by layer; "
                                                f"{worker_default('quant_compute')})."),
    concurrency: Optional[int] = typer.Option(None, help=f"Messages in flight in this worker (a bundle counts once) "
                                              f"({worker_default('concurrency')})."),
    compile: Optional[bool] = typer.Option(None, "--compile/--no-compile", help="torch.compile the decoder layers "
                                           f"({worker_default('compile')})."),
    gpus: Optional[str] = typer.Option(None, help="all | 0,1,...: one supervised worker process per GPU."),
    gpus_per_worker: Optional[int] = typer.Option(None, help="GPUs per worker process: one model split over "
                                                  "them by layers, every GPU busy "
                                                  f"({worker_default('gpus_per_worker')})."),
    split_stages: Optional[int] = typer.Option(None, help="Stages the layers are split into (0: one per visible "
                                               "GPU; 2 on one GPU measures the split's own cost; "
                                               f"{worker_default('split_stages')})."),
    redis_url: Optional[str] = typer.Option(None, help="Redis URL (default $LAYERTAP_REDIS_URL or localhost)."),
    loglevel: Optional[str] = typer.Option(None, help=f"DEBUG | INFO | WARNING ({worker_default('loglevel')})."),
    log_format: Optional[LogFormat] = typer.Option(None, help="json: one object per line, with job_id and run "
                                                   f"({worker_default('log_format')})."),
    metrics_port: Optional[int] = typer.Option(None, min=0, max=65535, help="Serve Prometheus metrics on this "
                                               "port (0 = off; with --gpus, worker i uses port + i; "
                                               f"{worker_default('metrics_port')})."),
) -> None:
    """Serve one model: load it once, take jobs from its queue, write files, publish results."""
    require("`layertap worker`")
    settings = load_settings(redis_url=redis_url, storage=storage, model=model, served_model_name=name,
                             layers=parse_layers(layers), device=device, dtype=dtype, node_name=node_name,
                             token_budget=token_budget, batching=batching, quant_compute=quant_compute,
                             concurrency=concurrency, compile=compile,
                             loglevel=loglevel,
                             gpus=gpus, gpus_per_worker=gpus_per_worker, split_stages=split_stages,
                             chat_template=chat_template,
                             log_format=log_format, metrics_port=metrics_port)
    if settings.worker.gpus:
        raise typer.Exit(supervise(settings))
    # Before torch loads OpenMP: idle OpenMP threads sleep instead of spinning. A worker's
    # CPU time goes to its task threads and the Celery consumer between forwards (measured:
    # +9% small jobs/s on a 2-core machine, BENCHMARKS.md). Set it yourself to override.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from layertap.worker.main import run_worker

    raise typer.Exit(run_worker(settings))


def supervise(settings: Settings) -> int:
    """Run one child worker per GPU group; children read the same settings from the environment."""
    from layertap.worker.job.examiners import helpers_per_worker
    from layertap.worker.ops.logs import configure_logging
    from layertap.worker.ops.supervisor import SIGKILL_GRACE_S, Supervisor, visible_gpus

    ws = settings.worker
    configure_logging(ws.loglevel, ws.log_format)
    env = {f"LAYERTAP_WORKER__{key.upper()}": json.dumps(value) if not isinstance(value, str) else value
           for key, value in ws.model_dump(mode="json", exclude={"gpus", "node_name", "model"}).items()
           if value is not None}
    gpus = visible_gpus(ws.gpus or "all")
    if ws.examine_processes is None:  # the host's cores shared out between its workers
        env["LAYERTAP_WORKER__EXAMINE_PROCESSES"] = str(helpers_per_worker(max(1, len(gpus) // ws.gpus_per_worker)))
    env["LAYERTAP_STORAGE_ROOT"] = str(settings.storage_root)
    if settings.redis_url:
        env["LAYERTAP_REDIS_URL"] = settings.redis_url
    os.environ.update(env)
    device = ["--device", "cuda"] if ws.device == "auto" else []
    supervisor = Supervisor(["--model", str(ws.model), *device], gpus, ws.gpus_per_worker,
                            metrics_port=ws.metrics_port,
                            kill_after_s=ws.shutdown_deadline_s(settings.limits.max_tokens) + SIGKILL_GRACE_S,
                            on_exit=exit_recorder(settings))
    return supervisor.run()


def exit_recorder(settings: Settings) -> Callable[[str, dict], None]:
    """``on_exit`` for the supervisor: record how a worker ended in ``keys.WORKER_EXITS_HASH`` (for
    ``layertap status``); Redis unreachable, the reason is only logged."""
    import logging

    import redis

    from layertap.protocol import keys
    from layertap.transport.redis_conn import connect

    client = connect(settings)

    def record(node: str, info: dict) -> None:
        try:
            client.hset(keys.WORKER_EXITS_HASH, node, json.dumps(info))
        except redis.RedisError as exc:
            logging.getLogger("layertap.supervisor").warning("could not record %s's exit in Redis: %s", node, exc)

    return record


def make_tiny_model(
    directory: Path = typer.Argument(..., help="Folder to save the model and tokenizer in."),
    arch: str = typer.Option("qwen3", help="qwen3 | llama | gpt2"),
    layers: int = typer.Option(4, help="Number of decoder layers."),
    hidden_size: int = typer.Option(64, help="Hidden size."),
    seed: int = typer.Option(0, help="Random seed for the weights."),
) -> None:
    """Build a tiny random-weight model with a trained tokenizer and chat template."""
    require("`layertap make-tiny-model`")
    from layertap.worker.model.tiny_model import make_tiny_model as build

    print(build(directory, arch, num_layers=layers, hidden_size=hidden_size, seed=seed))


def bench(
    model: str = typer.Option("shape:qwen3-8b", help="Model folder, or a random-weight shape: "
                              "shape:qwen3-8b, shape:llama3-8b, shape:qwen3-tiny (the only one a CPU takes)."),
    device: str = typer.Option("auto", help="auto | cpu | cuda"),
    dtype: str = typer.Option("auto", help="auto | bfloat16 | float16 | float32"),
    layers: Optional[str] = typer.Option(None, help="Layer ids to extract (default: EAGLE-3's [2, L//2, L-3, L] "
                                         "of the model, e.g. 2,18,33,36 for an 8B)."),
    prompts: int = typer.Option(128, help="Number of prompts."),
    min_len: int = typer.Option(128, help="Shortest random prompt (tokens)."),
    max_len: int = typer.Option(2047, help="Longest random prompt (tokens)."),
    file: Optional[Path] = typer.Option(None, help="JSONL of prompts ({'prompt'} or {'token_ids'}) instead."),
    storage: Path = typer.Option(Path("/dev/shm/layertap-bench"), help="Where files go: a new or empty folder, or "
                                 "one an earlier bench made (any other folder is refused, never emptied)."),
    token_budget: int = typer.Option(16384, help="Tokens per batch (padded batches count their padding)."),
    max_padding: float = typer.Option(0.25, help="Padded batches: the largest share of a batch that is padding."),
    parts: str = typer.Option("a,b,c,d", help="Which parts to run (a naive, p plain HF padded batches of 8, "
                                               "b ceiling, c engine, d queue)."),
    concurrency: int = typer.Option(64, help="Jobs in flight for (c) and (d)."),
    memory_check: bool = typer.Option(False, help="Also report peak GPU memory for 1x16k and 64x2k prompts."),
    compile: bool = typer.Option(False, "--compile", help="torch.compile the decoder layers in (b), (c), (d)."),
    gpus: Optional[str] = typer.Option(None, help="For (d): one worker per GPU, e.g. 0,1 (default: one worker)."),
    gpus_per_worker: int = typer.Option(1, min=1, help="For (d) with --gpus: one worker per group of this many "
                                        "GPUs, the model split over them."),
    split_stages: int = typer.Option(1, min=0, help="Split the model's layers into this many stages (b, c, d; "
                                     "2 on one GPU: the split's own cost against 1; 0: one per visible GPU)."),
    backlog: bool = typer.Option(False, "--backlog", help="For (d): enqueue every job before the worker "
                                 "starts, then time how fast it drains the queue (no client sharing the CPU)."),
    redis_url: Optional[str] = typer.Option(None, help="Redis for (d) (default: an embedded one)."),
    report_out: Optional[Path] = typer.Option(None, "--report", help="Write the full report here (JSON)."),
) -> None:
    """Measure naive HF, the bare forward, the engine and the whole queue path on the same prompts."""
    require("`layertap bench`")
    from layertap.worker.bench.bench import BenchConfig, format_table, run_bench

    config = BenchConfig(model=model, device=device, dtype=dtype, layers=parse_layers(layers),
                         prompts=prompts, min_len=min_len, max_len=max_len, file=str(file) if file else None,
                         storage=str(storage), token_budget=token_budget, max_padding=max_padding,
                         parts=tuple(p.strip() for p in parts.split(",") if p.strip()), redis_url=redis_url,
                         concurrency=concurrency, memory_check=memory_check, compile=compile, gpus=gpus,
                         backlog=backlog, split_stages=split_stages, gpus_per_worker=gpus_per_worker)
    report = run_bench(config, log=lambda line: console.print(line, markup=False, highlight=False))
    console.print(format_table(report), markup=False, highlight=False)
    if report_out:
        report_out.write_text(json.dumps(report, indent=2))
