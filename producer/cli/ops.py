"""Operations commands: ``layertap status`` (queues, workers, dead letters) and
``layertap watch --run R`` (a live progress bar until the run is complete). Client
side: no torch. Errors raise ``ValueError``/``RuntimeError``, which ``cli.main`` prints
as one ``error:`` line.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Optional

import typer
from rich.measure import Measurement
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from layertap.extras import require
from layertap.producer.cli.common import console, folding_table, require_run
from layertap.producer.client import runs
from layertap.producer.client.client import Client
from layertap.producer.client.fleet import running_jobs
from layertap.producer.client.results import stream_results
from layertap.producer.ops.monitor import (
    FleetStatus,
    RunProgress,
    RunTracker,
    WorkerState,
    fleet_status,
    throughput_history,
)
from layertap.rates import overall_tokens_per_s
from layertap.transport.redis_url import redacted_url


def format_eta(seconds: float | None) -> str:
    """``ETA h:mm:ss`` of ``seconds`` (rounded), or ``ETA -:--:--`` when unknown (None)."""
    if seconds is None:
        return "ETA -:--:--"
    seconds = int(round(seconds))
    return f"ETA {seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def render_status(status: FleetStatus, running: dict[str, int], redis_url: str) -> None:
    """Print ``layertap status``: queues (queued and running per model), workers, how each last ended, dead letters and
    Redis memory (in bold red when Redis refuses writes)."""
    console.print(f"redis: {redacted_url(redis_url)}", highlight=False)
    queues = folding_table("model", "queued", "running", title="queues")
    for model in sorted({*status.queues, *running}):
        queues.add_row(model, str(status.queues.get(model, 0)), str(running.get(model, 0)))
    console.print(queues)
    if not any(state.alive for state in status.workers):
        console.print("no live workers: queued jobs wait until one starts (`layertap worker --model ...`)",
                      style="bold", highlight=False)
    render_workers(status.workers)
    for state in status.workers:
        if state.last_exit:
            age = "" if state.last_exit_age_s is None else f" ({state.last_exit_age_s:.0f}s ago)"
            console.print(f"{state.node} last ended{age}: {state.last_exit}", highlight=False, soft_wrap=True)
    console.print(f"dead letters: {status.dead_letters}", highlight=False)
    memory = status.redis
    limit = f"{memory.max_bytes:,} bytes ({memory.policy})" if memory.max_bytes else "no limit"
    console.print(f"redis memory: {memory.used_bytes:,} bytes used, maxmemory {limit}", highlight=False)
    if memory.refusing_writes:
        console.print("REDIS IS FULL: it refuses writes (OOM); workers wait, holding their jobs, until memory "
                      "is freed or maxmemory raised", style="bold red", highlight=False)


WORKER_FIELDS = ("node", "alive", "device", "gpus", "model", "batching", "tokens/s", "jobs", "pending", "weights",
                 "last beat")


def worker_cells(state: WorkerState) -> list[str]:
    """One worker's values, in :data:`WORKER_FIELDS` order."""
    beat = "-" if state.beat_age_s is None else f"{state.beat_age_s:.0f}s ago"
    return [state.node, "yes" if state.alive else "no", state.device, state.gpus or "-", state.model,
            state.batching or "-", f"{state.tokens_per_s:,.0f}", str(state.jobs), str(state.pending),
            state.weights or "-", beat]


def render_workers(workers: list[WorkerState]) -> None:
    """The workers as a table when it fits the terminal; else one block per worker (its node, then
    ``field value`` pairs filling lines as wide as the terminal), so no name or value is cut."""
    rows = [worker_cells(state) for state in workers]
    table = folding_table(*WORKER_FIELDS, title="workers")
    for row in rows:
        table.add_row(*row)
    if Measurement.get(console, console.options.update_width(10_000), table).maximum <= console.width:
        console.print(table)
        return
    console.print("workers:", highlight=False)
    for node, *values in rows:
        lines = [f"  {node}"]
        for pair in (f"{name} {value}" for name, value in zip(WORKER_FIELDS[1:], values)):
            if len(lines) > 1 and len(lines[-1]) + len(pair) + 3 <= console.width:
                lines[-1] += f" · {pair}"
            else:
                lines.append(f"    {pair}")
        for line in lines:
            console.print(line, highlight=False, markup=False, soft_wrap=True)


def describe_progress(progress: RunProgress) -> dict[str, Any]:
    """The progress bar's state and text fields."""
    waiting = "" if progress.total else " (no jobs yet)"
    return {"description": f"run {progress.run}{waiting}", "total": progress.total or None,
            "completed": progress.finished,
            "failed": f"{progress.failed} failed" + (f" {progress.cancelled} cancelled" if progress.cancelled else ""),
            "rate": f"{progress.tokens_per_s:,.0f} tokens/s", "eta": format_eta(progress.eta_s)}


def register(app: typer.Typer) -> None:
    """Add ``status`` and ``watch`` to the ``layertap`` app."""

    @app.command()
    def status(
        as_json: bool = typer.Option(False, "--json", help="Print JSON."),
        redis_url: Optional[str] = typer.Option(None, help="Redis URL."),
    ) -> None:
        """Show jobs queued and running per model, workers (alive, device, GPUs, model, tokens/s), dead letters."""
        with Client(redis_url=redis_url) as client:
            fleet = fleet_status(client.redis)
            running = running_jobs(client.redis)
            url = client.settings.broker_url
        if as_json:
            print(json.dumps({"redis_url": redacted_url(url), **fleet.as_json(), "running": running}, indent=2))
        else:
            render_status(fleet, running, url)

    @app.command()
    def watch(
        run: str = typer.Option("default", "--run", help="Run name."),
        plot: Optional[Path] = typer.Option(None, help="When complete, write a throughput-over-time chart (PNG)."),
        interval: float = typer.Option(1.0, min=0.05, help="Seconds between refreshes."),
        redis_url: Optional[str] = typer.Option(None, help="Redis URL."),
    ) -> None:
        """Show a run's progress (done / failed / total, tokens/s, ETA) until every job has a result; then
        the run's overall rate (tokens of its ok results over the time from the first start to the last finish;
        once retention trimmed the results stream, over the results it kept, and said so).
        A run with no jobs and no results is an error (exit 1), as for `results`."""
        if plot is not None:
            require("watch --plot", ("matplotlib",))
        with Client(redis_url=redis_url) as client:
            require_run(client.redis, run)
            tracker = RunTracker(client.redis, run)
            current = tracker.poll()
            unserved = sorted(runs.waiting_models(client.redis, run) - client.served_models())
            if not current.complete and unserved:
                console.print(f"warning: no live worker serves {', '.join(unserved)}: the run's jobs wait in the "
                              "queue (no ETA) until one does", highlight=False, soft_wrap=True)
            columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                       TextColumn("{task.fields[failed]}"), TextColumn("{task.fields[rate]}"),
                       TextColumn("{task.fields[eta]}"))
            with Progress(*columns, console=console) as bar:
                task = bar.add_task(**describe_progress(current))
                while not current.complete:
                    time.sleep(interval)
                    current = tracker.poll()
                    bar.update(task, **describe_progress(current))
                overall = overall_tokens_per_s(result for _, result in stream_results(client.redis, run))
                # the ledger keeps no tokens or times of the results retention trimmed from the stream
                scope = "over the results retention kept" if runs.was_trimmed(client.redis, run) else "overall"
                bar.update(task, rate=f"{overall:,.0f} tokens/s {scope}")
            cancelled = f", {current.cancelled} cancelled" if current.cancelled else ""
            console.print(f"run {run} complete: {current.done} ok, {current.failed} failed{cancelled}, "
                          f"{current.total} jobs, {overall:,.0f} tokens/s {scope}", highlight=False)
            if plot is not None:
                from layertap.producer.files.plots import plot_throughput

                plot_throughput(throughput_history(client.redis, run), plot, title=f"run {run}")
                console.print(f"wrote {plot}", highlight=False)
