"""``layertap demo``: the whole pipeline on one machine, on the CPU, in about a minute.

Starts an embedded Redis (unless a URL is configured), builds a tiny model, starts a
real worker process, enqueues the bundled prompts and chats, follows the results with
a progress bar, prints a summary and one inspected file, then stops everything, on
Ctrl-C too. Imports no torch itself: the model builder and the worker are subprocesses.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)

from layertap.command import layertap_argv
from layertap.producer.client.client import Client
from layertap.producer.dev.demo_data import demo_jobs
from layertap.producer.dev.redis_server import RedisServer
from layertap.settings import Settings

DEMO_MODEL = "tiny-qwen3"
DEMO_RUN = "demo"


def _cli(*args: str) -> list[str]:
    return layertap_argv(*args)


def _wait_for_worker(client: Client, worker: subprocess.Popen, deadline: float) -> None:
    while DEMO_MODEL not in client.served_models():
        if worker.poll() is not None:
            raise RuntimeError(f"the demo worker exited with code {worker.returncode} before serving")
        if time.monotonic() > deadline:
            raise TimeoutError("the demo worker did not come up in time")
        time.sleep(0.2)


def _stop(process: subprocess.Popen | None) -> None:
    if process is None or process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@contextlib.contextmanager
def step(console: Console, what: str) -> Iterator[None]:
    """Say ``what`` starts, as a line (a spinner shows nothing where the output is not a terminal:
    ``make demo`` piped or logged), and how long it took."""
    console.print(f"{what}...", highlight=False, soft_wrap=True)
    started = time.monotonic()
    yield
    console.print(f"  done in {time.monotonic() - started:.1f}s", highlight=False)


#: A file the demo leaves in its folder: the folder is the demo's to empty on the next run.
DEMO_MARKER = ".layertap-demo"


def claim_workdir(workdir: Path) -> Path:
    """``workdir`` (absolute) made the demo's: new, empty, or made by an earlier demo (whose Redis
    data and files are removed, so its results are not taken for this run's). A folder holding
    anything else is refused, never emptied."""
    workdir = workdir.expanduser().resolve()
    if workdir.exists() and any(workdir.iterdir()) and not (workdir / DEMO_MARKER).exists():
        raise ValueError(f"--workdir {workdir} is not empty and was not made by layertap demo; give a new or "
                         "empty folder")
    for part in ("redis", "files", "model"):
        shutil.rmtree(workdir / part, ignore_errors=True)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / DEMO_MARKER).touch()
    return workdir


def run_demo(settings: Settings, *, workdir: Path, timeout: float, console: Console,
             show_file: Callable[[dict[str, Any]], None]) -> None:
    """The whole pipeline on an embedded Redis; ``show_file`` prints one file's description. The
    model and files stay in ``workdir``, and it ends with commands to run next on them."""
    from layertap.producer.files.file_stats import describe_file

    deadline = time.monotonic() + timeout
    workdir = claim_workdir(workdir)
    with contextlib.ExitStack() as stack:
        if settings.redis_url is None:
            server = stack.enter_context(RedisServer(data_dir=workdir / "redis"))
            settings = settings.model_copy(update={"redis_url": server.url})
            console.print(f"[dim]embedded Redis at {server.url}[/dim]")
        storage = workdir / "files"
        model_dir = workdir / "model"
        env = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", **os.environ, "LAYERTAP_REDIS_URL": settings.broker_url,
               "LAYERTAP_STORAGE_ROOT": str(storage)}
        with step(console, "building a tiny qwen3-style model and tokenizer"):
            subprocess.run(_cli("make-tiny-model", str(model_dir), "--arch", "qwen3"), check=True, env=env,
                           stdout=subprocess.DEVNULL)
        log_path = workdir / "worker.log"
        log_file = stack.enter_context(open(log_path, "w"))
        worker = subprocess.Popen(
            _cli("worker", "--model", str(model_dir), "--name", DEMO_MODEL, "--device", "cpu",
                 "--layers", "0,2,-1", "--node-name", f"demo-{os.getpid()}@localhost"),
            env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
        stack.callback(_stop, worker)
        client = stack.enter_context(Client(settings))
        with step(console, f"starting a worker (loading the model; its log: {log_path})"):
            _wait_for_worker(client, worker, deadline)
        jobs = [client.submit(data, model=DEMO_MODEL, run=DEMO_RUN) for data in demo_jobs()]
        wanted = {job.job_id for job in jobs}
        started = time.monotonic()
        done: dict[str, object] = {}
        with Progress(TextColumn("[bold]extracting"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console) as progress:
            bar = progress.add_task("jobs", total=len(wanted))
            for result in client.results(DEMO_RUN, follow=True, block_ms=200,
                                         timeout=max(1.0, deadline - time.monotonic())):
                if result.job_id in wanted and result.job_id not in done:
                    done[result.job_id] = result
                    progress.advance(bar)
                if len(done) == len(wanted):
                    break
        elapsed = time.monotonic() - started
        if len(done) < len(wanted):
            raise TimeoutError(f"only {len(done)} of {len(wanted)} demo jobs finished; see {log_path}")
        results = list(done.values())
        ok = [r for r in results if r.ok]  # type: ignore[attr-defined]
        tokens = sum(r.num_tokens or 0 for r in ok)  # type: ignore[attr-defined]
        console.print(f"\n[bold green]{len(ok)}/{len(results)} jobs ok[/bold green], {tokens} tokens in "
                      f"{elapsed:.2f}s ({tokens / elapsed:,.0f} tokens/s end to end)")
        console.print(f"files under {storage / DEMO_RUN}", soft_wrap=True)
        failed = [r for r in results if not r.ok]  # type: ignore[attr-defined]
        for result in failed:
            console.print(f"[red]error[/red] {result.job_id}: {result.error}")  # type: ignore[attr-defined]
        chat = next((r for r in ok if r.num_tokens and "loss_mask" in describe_file(r.path)["tensors"]), ok[0])  # type: ignore
        console.print()
        show_file(describe_file(chat.path))  # type: ignore[attr-defined]
        if failed:
            raise RuntimeError(f"{len(failed)} demo job(s) failed")
    console.print("[dim]worker and Redis stopped[/dim]")
    console.print("\n[bold]next[/bold] (the model and files stay):", highlight=False)
    for line in (f"layertap inspect {chat.path}",  # type: ignore[attr-defined]
                 f"python -c \"from layertap import load_hidden_states; "
                 f"print(load_hidden_states('{chat.path}')['hidden_states'].shape)\"",  # type: ignore[attr-defined]
                 f"layertap worker --model {model_dir} --device cpu   # serve the tiny model on your own Redis",
                 "README.md, 'Five minutes on a CPU': worker, enqueue, watch, results, load, step by step"):
        console.print(f"  {line}", highlight=False, markup=False, soft_wrap=True)
