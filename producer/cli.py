"""The ``layertap`` command. Client subcommands import no torch; ``worker``,
``make-tiny-model`` and ``bench`` import the worker package when they run.

Every flag maps to a setting (``producer.settings``); flags win over the environment.
Errors print one line (``error: ...``) and exit non-zero; ``LAYERTAP_DEBUG=1`` shows tracebacks.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console

from producer import __version__, cli_data, cli_dlq, cli_runs
from producer.cli_ops import folding_table
from producer.cli_ops import register as register_ops
from producer.extras import require
from producer.settings import LogFormat, Settings, WorkerSettings, unknown_settings

app = typer.Typer(name="layertap", help="A hidden-state factory: queue prompts, extract layer activations, "
                  "write safetensors files, publish their paths.", no_args_is_help=True,
                  pretty_exceptions_enable=False, rich_markup_mode=None,
                  context_settings={"max_content_width": 120, "show_default": True})
console = Console()
err_console = Console(stderr=True, soft_wrap=True)  # an error stays one line, however long


class CliError(Exception):
    """An error to print as one line and exit with ``code``."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


def show_version(value: bool) -> None:
    if value:
        print(f"layertap {__version__}")
        raise typer.Exit()


@app.callback()
def root(version: bool = typer.Option(False, "--version", callback=show_version, is_eager=True,
                                      help="Print the version and exit.")) -> None:
    for warning in unknown_settings():
        err_console.print(f"warning: {warning}", markup=False, highlight=False)


def load_settings(*, redis_url: str | None = None, storage: Path | None = None,
                  **worker_fields: Any) -> Settings:
    """Settings from the environment, with the given flags (those not None) on top."""
    settings = Settings()
    top: dict[str, Any] = {}
    if redis_url is not None:
        top["redis_url"] = redis_url
    if storage is not None:
        top["storage_root"] = storage
    changes = {key: value for key, value in worker_fields.items() if value is not None}
    if changes:  # validated like the environment is
        top["worker"] = type(settings.worker).model_validate({**settings.worker.model_dump(), **changes})
    return settings.model_copy(update=top) if top else settings


def worker_default(field: str) -> str:
    """``"default: <value>, setting worker.<field>"`` for a flag whose default is a setting."""
    value = WorkerSettings.model_fields[field].default
    return f"default: {getattr(value, 'value', value)}, setting worker.{field}"


def parse_layers(text: str | None) -> list[int] | None:
    from producer.layers import parse_layer_list

    return None if text is None else parse_layer_list(text)


@app.command()
def worker(
    model: str = typer.Option(..., "--model", help="Model folder or hub id to load."),
    name: Optional[str] = typer.Option(None, "--name", help="Model name jobs use (default: the folder's name, "
                                "org/name for a hub cache snapshot, else --model as given)."),
    layers: Optional[str] = typer.Option(None, help="Default layer ids, e.g. 2,18,-1 (default: EAGLE-3's)."),
    chat_template: Optional[str] = typer.Option(None, help="Jinja chat template file to use instead of the model's."),
    device: Optional[str] = typer.Option(None, help=f"auto | cpu | cuda | cuda:N ({worker_default('device')})."),
    dtype: Optional[str] = typer.Option(None, help="auto | bfloat16 | float16 | float32, or bf16 | fp16 | fp32 "
                                        f"({worker_default('dtype')}: bfloat16 on a GPU, float32 on the CPU)."),
    storage: Optional[Path] = typer.Option(None, "--storage-root", "--storage", help="Storage root for files "
                                           "(setting storage_root; default layertap-data, made absolute at start)."),
    node_name: Optional[str] = typer.Option(None, help="Celery node name (default layertap-<pid>@<host>)."),
    token_budget: Optional[int] = typer.Option(None, help="Tokens per batch, padded batches counting their padding "
                                               f"({worker_default('token_budget')})."),
    batching: Optional[str] = typer.Option(None, help="auto | packed | padded: how jobs share a forward (auto: "
                                           "from the model's structure; either way checked at start)."),
    concurrency: Optional[int] = typer.Option(None, help=f"Jobs in flight in this worker "
                                              f"({worker_default('concurrency')})."),
    compile: Optional[bool] = typer.Option(None, "--compile/--no-compile", help="torch.compile the decoder layers "
                                           f"({worker_default('compile')})."),
    gpus: Optional[str] = typer.Option(None, help="all | 0,1,...: one supervised worker process per GPU."),
    gpus_per_worker: Optional[int] = typer.Option(None, help="GPUs per worker process (model split across them; "
                                                  f"{worker_default('gpus_per_worker')})."),
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
                             token_budget=token_budget, batching=batching, concurrency=concurrency, compile=compile,
                             loglevel=loglevel,
                             gpus=gpus, gpus_per_worker=gpus_per_worker, chat_template=chat_template,
                             log_format=log_format, metrics_port=metrics_port)
    if settings.worker.gpus:
        raise typer.Exit(supervise(settings))
    # Before torch loads OpenMP: idle OpenMP threads sleep instead of spinning. A worker's
    # CPU time goes to its task threads and the Celery consumer between forwards (measured:
    # +9% small jobs/s on a 2-core machine, BENCHMARKS.md). Set it yourself to override.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from worker.main import run_worker

    raise typer.Exit(run_worker(settings))


def supervise(settings: Settings) -> int:
    """Run one child worker per GPU group; children read the same settings from the environment."""
    from worker.logs import configure_logging
    from worker.supervisor import SIGKILL_GRACE_S, Supervisor, visible_gpus

    ws = settings.worker
    configure_logging(ws.loglevel, ws.log_format)
    env = {f"LAYERTAP_WORKER__{key.upper()}": json.dumps(value) if not isinstance(value, str) else value
           for key, value in ws.model_dump(mode="json", exclude={"gpus", "node_name", "model"}).items()
           if value is not None}
    env["LAYERTAP_STORAGE_ROOT"] = str(settings.storage_root)
    if settings.redis_url:
        env["LAYERTAP_REDIS_URL"] = settings.redis_url
    os.environ.update(env)
    device = ["--device", "cuda"] if ws.device == "auto" else []
    supervisor = Supervisor(["--model", str(ws.model), *device], visible_gpus(ws.gpus or "all"), ws.gpus_per_worker,
                            metrics_port=ws.metrics_port,
                            kill_after_s=ws.shutdown_deadline_s(settings.limits.max_tokens) + SIGKILL_GRACE_S)
    return supervisor.run()


@app.command()
def results(
    run: str = typer.Option("default", "--run", help="Run name."),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep waiting for new results until every "
                                "submitted job has one."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per line."),
    every_entry: bool = typer.Option(False, "--every-entry", help="Print every stream entry, a job's repeats "
                                     "included (default: a job again only when its status changes)."),
    timeout: Optional[float] = typer.Option(None, help="With --follow: stop after this many idle seconds."),
    redis_url: Optional[str] = typer.Option(None, help="Redis URL."),
) -> None:
    """Print a run's results so far (or keep following with --follow)."""
    from producer import runs
    from producer.client import Client

    with Client(load_settings(redis_url=redis_url)) as client:
        if not follow and not runs.exists(client.redis, run):
            raise CliError(f"no run named {run!r}: it has no jobs and no results (see `layertap runs`)")
        printed: dict[str, str] = {}  # job id -> status last printed
        for result in client.results(run, follow=follow, timeout=timeout, until_complete=True):
            if not every_entry and printed.get(result.job_id) == result.status.value:
                continue
            printed[result.job_id] = result.status.value
            if as_json:
                print(result.model_dump_json(), flush=True)
            elif result.ok:
                print(f"ok     {result.job_id}  {result.num_tokens} tokens  {result.path}", flush=True)
            else:
                print(f"error  {result.job_id}  {result.error_type.value if result.error_type else ''}: "
                      f"{result.error}", flush=True)


@app.command()
def inspect(
    file: Path = typer.Argument(..., help="A layertap .safetensors file."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
    verify: bool = typer.Option(True, help="Check shapes and checksums first."),
    plot: Optional[Path] = typer.Option(None, help="Also draw per-layer statistics to this PNG file."),
) -> None:
    """Show a file's tensors, metadata and per-layer statistics."""
    from producer.file_stats import describe_file

    info = describe_file(file, verify=verify)
    if plot is not None:
        from producer.plots import plot_file

        plot_file(file, plot)
    if as_json:
        print(json.dumps(info, indent=2))
        return
    print_file_description(info)


def print_file_description(info: dict[str, Any]) -> None:
    console.print(f"[bold]{info['path']}[/bold]  ({info['bytes']:,} bytes)", soft_wrap=True)
    tensors = folding_table("tensor", "shape", "dtype", title="tensors")
    for name, tensor in info["tensors"].items():
        tensors.add_row(name, str(tensor["shape"]), tensor["dtype"])
    console.print(tensors)
    meta = folding_table("key", "value", title="metadata")
    for key, value in sorted(info["metadata"].items()):
        meta.add_row(key, value if len(value) < 100 else value[:97] + "...")
    console.print(meta)
    stats = folding_table("layer", "mean", "std", "min", "max", "mean |h|", "finite", title="hidden_states per layer")
    for row in info["layer_stats"]:
        stats.add_row(str(row["layer"]), f"{row['mean']:.4g}", f"{row['std']:.4g}", f"{row['min']:.4g}",
                      f"{row['max']:.4g}", f"{row['mean_token_norm']:.4g}", str(row["finite"]))
    console.print(stats)


@app.command("make-tiny-model")
def make_tiny_model(
    directory: Path = typer.Argument(..., help="Folder to save the model and tokenizer in."),
    arch: str = typer.Option("qwen3", help="qwen3 | llama | gpt2"),
    layers: int = typer.Option(4, help="Number of decoder layers."),
    hidden_size: int = typer.Option(64, help="Hidden size."),
    seed: int = typer.Option(0, help="Random seed for the weights."),
) -> None:
    """Build a tiny random-weight model with a trained tokenizer and chat template."""
    require("`layertap make-tiny-model`")
    from worker.tiny_model import make_tiny_model as build

    print(build(directory, arch, num_layers=layers, hidden_size=hidden_size, seed=seed))


@app.command()
def demo(
    workdir: Optional[Path] = typer.Option(None, help="Keep the model and files here (default: a temp folder)."),
    redis_url: Optional[str] = typer.Option(None, help="Use this Redis instead of an embedded one."),
    timeout: float = typer.Option(300.0, help="Give up after this many seconds."),
) -> None:
    """Run the whole pipeline on a tiny model on the CPU, with an embedded Redis."""
    require("`layertap demo`")
    from producer.demo import run_demo

    run_demo(load_settings(redis_url=redis_url), workdir=workdir, timeout=timeout, console=console)


@app.command()
def bench(
    model: str = typer.Option("shape:qwen3-8b", help="Model folder, or a random-weight shape: "
                              "shape:qwen3-8b, shape:llama3-8b, shape:qwen3-tiny."),
    device: str = typer.Option("auto", help="auto | cpu | cuda"),
    dtype: str = typer.Option("auto", help="auto | bfloat16 | float16 | float32"),
    layers: str = typer.Option("2,18,33,36", help="Layer ids to extract."),
    prompts: int = typer.Option(128, help="Number of prompts."),
    min_len: int = typer.Option(128, help="Shortest random prompt (tokens)."),
    max_len: int = typer.Option(2047, help="Longest random prompt (tokens)."),
    file: Optional[Path] = typer.Option(None, help="JSONL of prompts ({'prompt'} or {'token_ids'}) instead."),
    storage: Path = typer.Option(Path("/dev/shm/layertap-bench"), help="Where files go: a new or empty folder, or one an "
                                 "earlier bench made (any other folder is refused, never emptied)."),
    token_budget: int = typer.Option(16384, help="Tokens per batch (padded batches count their padding)."),
    max_padding: float = typer.Option(0.25, help="Padded batches: the largest share of a batch that is padding."),
    parts: str = typer.Option("a,b,c,d", help="Which parts to run (a naive, p plain HF padded batches of 8, "
                                               "b ceiling, c engine, d queue)."),
    concurrency: int = typer.Option(64, help="Jobs in flight for (c) and (d)."),
    memory_check: bool = typer.Option(False, help="Also report peak GPU memory for 1x16k and 64x2k prompts."),
    compile: bool = typer.Option(False, "--compile", help="torch.compile the decoder layers in (b), (c), (d)."),
    gpus: Optional[str] = typer.Option(None, help="For (d): one worker per GPU, e.g. 0,1 (default: one worker)."),
    backlog: bool = typer.Option(False, "--backlog", help="For (d): enqueue every job before the worker "
                                 "starts, then time how fast it drains the queue (no client sharing the CPU)."),
    redis_url: Optional[str] = typer.Option(None, help="Redis for (d) (default: an embedded one)."),
    report_out: Optional[Path] = typer.Option(None, "--report", help="Write the full report here (JSON)."),
) -> None:
    """Measure naive HF, the bare forward, the engine and the whole queue path on the same prompts."""
    require("`layertap bench`")
    from worker.bench import BenchConfig, format_table, run_bench

    config = BenchConfig(model=model, device=device, dtype=dtype, layers=parse_layers(layers) or [],
                         prompts=prompts, min_len=min_len, max_len=max_len, file=str(file) if file else None,
                         storage=str(storage), token_budget=token_budget, max_padding=max_padding,
                         parts=tuple(p.strip() for p in parts.split(",") if p.strip()), redis_url=redis_url,
                         concurrency=concurrency, memory_check=memory_check, compile=compile, gpus=gpus,
                         backlog=backlog)
    report = run_bench(config, log=lambda line: console.print(line, markup=False, highlight=False))
    console.print(format_table(report), markup=False, highlight=False)
    if report_out:
        report_out.write_text(json.dumps(report, indent=2))


cli_data.register(app)
cli_dlq.register(app)
cli_runs.register(app)
register_ops(app)


def describe_invalid(exc: Any) -> str:
    """One line for a pydantic ``ValidationError``; a setting is named with its variable (a bad
    ``LAYERTAP_*`` value stops every command that reads the settings, so say which)."""
    first = exc.errors()[0]
    where = ".".join(str(part) for part in first["loc"])
    group = {"Settings": "", "WorkerSettings": "worker."}.get(exc.title)
    if group is None or not where:
        return f"invalid {where or exc.title}: {first['msg']}"
    setting = group + where
    return (f"invalid setting {setting} (LAYERTAP_{setting.upper().replace('.', '__')}, layertap.toml or its flag): "
            f"{first['msg']}")


def main() -> None:
    """Entry point: run the app, turning expected failures into one line and an exit code."""
    import redis
    from pydantic import ValidationError

    try:
        app()
    except CliError as exc:
        err_console.print(f"error: {exc}", markup=False, highlight=False)
        sys.exit(exc.code)
    except redis.exceptions.ConnectionError as exc:
        url = Settings().broker_url
        err_console.print(f"error: cannot reach Redis ({exc}); is it running at {url}? "
                          "Set LAYERTAP_REDIS_URL or pass --redis-url", markup=False, highlight=False)
        sys.exit(1)
    except (ValidationError, ValueError, OSError, RuntimeError, redis.exceptions.RedisError) as exc:
        if os.environ.get("LAYERTAP_DEBUG"):
            raise
        if isinstance(exc, ValidationError):
            message = describe_invalid(exc)
        else:
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        err_console.print(f"error: {message}", markup=False, highlight=False)
        sys.exit(1)


if __name__ == "__main__":
    main()
