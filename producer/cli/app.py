"""The ``layertap`` command. Client subcommands import no torch; ``worker``,
``make-tiny-model`` and ``bench`` import the worker package when they run.

Every flag maps to a setting (``layertap.settings``); flags win over the environment.
Errors print one line (``error: ...``) and exit non-zero; ``LAYERTAP_DEBUG=1`` shows tracebacks.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Optional

import typer

from layertap.extras import require
from layertap.producer import __version__
from layertap.producer.cli import data as cli_data
from layertap.producer.cli import dlq as cli_dlq
from layertap.producer.cli import draft as cli_draft
from layertap.producer.cli import regen as cli_regen
from layertap.producer.cli import runs as cli_runs
from layertap.producer.cli import serve as cli_serve
from layertap.producer.cli import verify as cli_verify
from layertap.producer.cli import worker as cli_worker
from layertap.producer.cli.common import (
    CliError,
    console,
    err_console,
    load_settings,
    print_file_description,
    redis_url_in_use,
    require_run,
)
from layertap.producer.cli.ops import register as register_ops
from layertap.settings import unknown_settings

app = typer.Typer(name="layertap", help="A hidden-state factory: queue prompts, extract layer activations, "
                  "write safetensors files, publish their paths.", no_args_is_help=True,
                  pretty_exceptions_enable=False, rich_markup_mode=None,
                  context_settings={"max_content_width": 120, "show_default": True})


def show_version(value: bool) -> None:
    """``--version``'s callback: print the version and exit before any command runs."""
    if value:
        print(f"layertap {__version__}")
        raise typer.Exit()


@app.callback()
def root(version: bool = typer.Option(False, "--version", callback=show_version, is_eager=True,
                                      help="Print the version and exit.")) -> None:
    """Before every command: warn on stderr about each ``LAYERTAP_*`` variable and ``layertap.toml`` key that is
    no setting. Not the app's ``--help`` text: ``Typer(help=...)`` takes precedence."""
    for warning in unknown_settings():
        err_console.print(f"warning: {warning}", markup=False, highlight=False)


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
    """Print a run's results so far (or keep following with --follow): first, by job id, those
    trimmed from its stream at the retention (from the run's ledger), then the stream's."""
    from layertap.producer.client import runs
    from layertap.producer.client.client import Client

    with Client(load_settings(redis_url=redis_url)) as client:
        if not follow:
            require_run(client.redis, run)
        printed: dict[str, str] = {}  # job id -> status last printed
        from_ledger = 0
        for trimmed in runs.trimmed_results(client.redis, run):
            from_ledger += 1
            print_result(trimmed, as_json, printed)
        for result in client.results(run, follow=follow, timeout=timeout, until_complete=True):
            if every_entry or printed.get(result.job_id) != result.status.value:
                print_result(result, as_json, printed)
        for trimmed in runs.trimmed_results(client.redis, run, shown=printed):  # trimmed while the stream was read
            from_ledger += 1
            print_result(trimmed, as_json, printed)
    if from_ledger:
        err_console.print(f"run {run}: {from_ledger} of these results come from the run's ledger: their stream "
                          "entries were trimmed at the retention (retention.results_s); an error's type and message "
                          "are not kept there", markup=False, highlight=False)


def print_result(result: Any, as_json: bool, printed: dict[str, str]) -> None:
    """One line of ``layertap results``; ``printed`` records the job's status."""
    printed[result.job_id] = result.status.value
    if as_json:
        print(result.model_dump_json(), flush=True)
    elif result.ok:
        tokens = "?" if result.num_tokens is None else result.num_tokens
        print(f"ok     {result.job_id}  {tokens} tokens  {result.path}", flush=True)
    else:
        print(f"error  {result.job_id}  {result.error_type.value if result.error_type else ''}: "
              f"{result.error}", flush=True)


@app.command()
def inspect(
    file: str = typer.Argument(..., help="A layertap .safetensors file (a path, or a URL such as s3://...)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
    verify: bool = typer.Option(True, help="Check shapes and checksums first."),
    plot: Optional[Path] = typer.Option(None, help="Also draw per-layer statistics to this PNG file."),
) -> None:
    """Show a file's tensors, metadata and per-layer statistics."""
    from layertap.producer.files.file_stats import describe_file
    from layertap.protocol.fileformat import FileFormatError, MetaKey
    from layertap.storage.registry import storage_at

    try:
        info = describe_file(file, verify=verify)
    except FileFormatError as exc:
        if MetaKey.CHECKSUMS in storage_at(file).read_header(file).metadata:
            raise  # a layertap file that fails its check: damaged, never to be waved through
        raise CliError(f"{exc}; it has no layertap checksums and is not laid out as vLLM writes its files: "
                       "`layertap inspect --no-verify` reads it unchecked") from None
    if plot is not None:
        from layertap.producer.files.plots import plot_file

        plot_file(file, plot)
    if as_json:
        print(json.dumps(info, indent=2))
        return
    print_file_description(info)


@app.command()
def demo(
    workdir: Path = typer.Option(Path("layertap-demo"), help="Where the model, Redis data and files go (kept "
                                 "afterwards; emptied first when an earlier demo made it)."),
    redis_url: Optional[str] = typer.Option(None, help="Use this Redis instead of an embedded one."),
    timeout: float = typer.Option(300.0, help="Give up after this many seconds."),
) -> None:
    """Run the whole pipeline on a tiny model on the CPU, with an embedded Redis."""
    require("`layertap demo`")
    from layertap.producer.dev.demo import run_demo

    run_demo(load_settings(redis_url=redis_url), workdir=workdir, timeout=timeout, console=console,
             show_file=print_file_description)


cli_data.register(app)
cli_draft.register(app)
cli_regen.register(app)
cli_worker.register(app)
cli_dlq.register(app)
cli_runs.register(app)
cli_serve.register(app)
cli_verify.register(app)
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

    from layertap.transport.redis_url import redacted_url

    try:
        app()
    except CliError as exc:
        err_console.print(f"error: {exc}", markup=False, highlight=False)
        sys.exit(exc.code)
    except redis.exceptions.ConnectionError as exc:
        url = redacted_url(redis_url_in_use(sys.argv[1:]))
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
