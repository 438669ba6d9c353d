"""``layertap runs list|show|cancel|trim|delete``: a run's lifecycle (``layertap.producer.client.runs``).

The older forms stay as hidden aliases: ``layertap runs`` alone lists, and ``layertap run ...``
takes the same subcommands."""

from __future__ import annotations

import json
import time
from typing import Optional

import typer

from layertap.producer.cli.common import require_run

CANCEL_POLL_S = 0.5


def register(app: typer.Typer) -> None:
    """Add ``runs list|show|cancel|trim|delete`` (and the hidden alias ``run``) to the ``layertap`` app."""
    runs_app = typer.Typer(help="Runs: list them; show, cancel, trim or delete one.", invoke_without_command=True)
    run_app = typer.Typer(no_args_is_help=True)
    app.add_typer(runs_app, name="runs")
    app.add_typer(run_app, name="run", hidden=True)

    @runs_app.callback()
    def runs_group(ctx: typer.Context,
                   as_json: bool = typer.Option(False, "--json", help="One JSON object per line."),
                   redis_url: Optional[str] = typer.Option(None, help="Redis URL.")) -> None:
        """Runs: list them; show, cancel, trim or delete one (`layertap runs` alone lists)."""
        if ctx.invoked_subcommand is None:
            list_command(as_json, redis_url)

    @runs_app.command("list")
    def list_command(
        as_json: bool = typer.Option(False, "--json", help="One JSON object per line."),
        redis_url: Optional[str] = typer.Option(None, help="Redis URL."),
    ) -> None:
        """List runs: jobs submitted, jobs finished, state (running, cancelling, complete, cancelled: jobs
        ended `cancelled`, counted apart), bytes in Redis."""
        from layertap.producer.client import runs
        from layertap.producer.client.client import Client

        with Client(redis_url=redis_url) as client:
            found = runs.list_runs(client.redis)
        for summary in found:
            if as_json:
                print(json.dumps({**summary.__dict__, "state": summary.state}))
            else:
                cancelled = f" ({summary.cancelled_jobs} cancelled)" if summary.cancelled_at is not None else ""
                print(f"{summary.run}  {summary.finished}/{summary.submitted} finished  {summary.state}{cancelled}  "
                      f"{summary.redis_bytes:,} B in Redis")
        if not as_json:
            print(f"{len(found)} run(s)")

    @runs_app.command("cancel")
    def cancel_command(
        run: str = typer.Argument(..., help="Run name."),
        wait: bool = typer.Option(False, "--wait", help="Wait until every job has a result, then print "
                                  "how they ended."),
        redis_url: Optional[str] = typer.Option(None, help="Redis URL."),
    ) -> None:
        """Cancel a run: its jobs not yet in a worker's engine get a `cancelled` result instead of running;
        lost ones are not sent again; new jobs for it are refused. Jobs already computing finish."""
        from layertap.producer.client import runs
        from layertap.producer.client.client import Client

        with Client(redis_url=redis_url) as client:
            require_run(client.redis, run)
            runs.cancel(client.redis, run)
            while wait and not runs.is_complete(client.redis, run):
                time.sleep(CANCEL_POLL_S)
            counts = runs.outcomes(client.redis, run)
        ended = f"{counts['ok']} ok, {counts['failed']} failed, {counts['cancelled']} cancelled"
        if not counts["pending"]:
            print(f"run {run} cancelled: {ended}")
            return
        print(f"run {run} cancelled: {ended} so far; {counts['pending']} job(s) without a result yet end "
              f"`cancelled` unless a worker's engine already has them (`layertap runs cancel {run} --wait` "
              "prints how they all ended)")

    @runs_app.command("delete")
    def delete_command(
        run: str = typer.Argument(..., help="Run name."),
        files: bool = typer.Option(False, "--files", help="Also delete the files its ok results name."),
        force: bool = typer.Option(False, "--force", help="Delete even with jobs still without a result: "
                                   "cancel the run, take its messages out of the queues, wait for those workers "
                                   "hold to end."),
        yes: bool = typer.Option(False, "--yes", help="Do not ask."),
        storage: Optional[str] = typer.Option(None, help="The storage root, folder or URL (storage_root): --files "
                                               "deletes only the run's own files under it, and nothing if a "
                                               "result names any other path."),
        redis_url: Optional[str] = typer.Option(None, help="Redis URL."),
    ) -> None:
        """Delete a run's results, status and records from Redis (and with --files its files)."""
        from layertap.producer.cli.common import load_settings
        from layertap.producer.client import runs
        from layertap.producer.client.client import Client

        with Client(load_settings(redis_url=redis_url, storage=storage)) as client:
            require_run(client.redis, run)
            what = f"run {run}'s results and records" + (" and its files" if files else "")
            if not yes and not typer.confirm(f"Delete {what}?"):
                raise typer.Exit(1)
            store = client.settings.storage() if files else None
            paths = runs.delete(client.redis, run, force=force, files_under=store,
                                on_wait=lambda held: print(
                                    f"run {run}: waiting for {held} message(s) workers hold to end (cancelled)",
                                    flush=True))
        if store is not None:
            for path in paths:
                store.remove(path)
            store.prune(paths, run)
        print(f"deleted run {run}" + (f" and {len(paths)} file(s)" if files else ""))

    @runs_app.command("trim")
    def trim_command(
        run: str = typer.Argument(..., help="Run name."),
        redis_url: Optional[str] = typer.Option(None, help="Redis URL."),
    ) -> None:
        """Drop a run's results-stream entries now (what the retention sweep does to old ones), except
        those a consumer group has not acknowledged. Manifest, resume, `runs` and waiting still work
        (from the run's status hash and its files). Safe while workers run."""
        from layertap.producer.client import runs
        from layertap.producer.client.client import Client

        with Client(redis_url=redis_url) as client:
            require_run(client.redis, run)
            dropped = runs.trim(client.redis, run)
            left = runs.redis_bytes(client.redis, run)
        print(f"run {run}: dropped {dropped} result stream entries; {left:,} B left in Redis")

    @runs_app.command("show")
    def show_command(
        run: str = typer.Argument(..., help="Run name."),
        as_json: bool = typer.Option(False, "--json", help="Print JSON."),
        redis_url: Optional[str] = typer.Option(None, help="Redis URL."),
    ) -> None:
        """Show one run: jobs submitted, ok, failed, cancelled and waiting, state, bytes in Redis, models no live
        worker serves."""
        from layertap.producer.client import runs
        from layertap.producer.client.client import Client
        from layertap.producer.ops.monitor import RunTracker

        with Client(redis_url=redis_url) as client:
            require_run(client.redis, run)
            found = runs.summary(client.redis, run, count_cancelled=True)
            progress = RunTracker(client.redis, run).poll()
            unserved = sorted(runs.waiting_models(client.redis, run) - client.served_models())
            shown = {"run": run, "state": found.state, "submitted": found.submitted, "ok": progress.done,
                     "failed": progress.failed, "cancelled": progress.cancelled,
                     "waiting": found.submitted - found.finished,
                     "redis_bytes": runs.redis_bytes(client.redis, run), "unserved_models": unserved}
        if as_json:
            print(json.dumps(shown))
            return
        print(f"run {run}: {shown['state']}; {found.submitted} submitted, {progress.done} ok, {progress.failed} "
              f"failed, {progress.cancelled} cancelled, {shown['waiting']} waiting; "
              f"{shown['redis_bytes']:,} B in Redis")
        if unserved:
            print(f"no live worker serves {', '.join(unserved)}: those jobs wait in the queue until one does")

    for name, command in (("list", list_command), ("show", show_command), ("cancel", cancel_command),
                          ("delete", delete_command), ("trim", trim_command)):
        run_app.command(name)(command)
