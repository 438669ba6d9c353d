"""``layertap dlq list|requeue|purge``: look at and act on the dead-letter stream."""

from __future__ import annotations

import json
import time
from typing import Optional

import typer


def register(app: typer.Typer) -> None:
    """Add ``dlq list|requeue|purge`` to the ``layertap`` app."""
    dlq = typer.Typer(help="Jobs that failed max_attempts times: list, requeue, purge.", no_args_is_help=True)
    app.add_typer(dlq, name="dlq")

    @dlq.command("list")
    def list_command(
        as_json: bool = typer.Option(False, "--json", help="One JSON object per line."),
        redis_url: Optional[str] = typer.Option(None, help="Redis URL."),
    ) -> None:
        """Show dead letters, oldest first."""
        from layertap.producer.cli.common import load_settings
        from layertap.producer.client.client import Client
        from layertap.producer.client.dlq import list_dead

        with Client(load_settings(redis_url=redis_url)) as client:
            letters = list_dead(client)
        for letter in letters:
            if as_json:
                print(json.dumps(letter.__dict__))
            else:
                when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(letter.at))
                print(f"{letter.entry_id}  {when}  run={letter.run}  job={letter.job_id}  attempts={letter.attempts}  "
                      f"{letter.error_type}: {letter.error}")
        if not as_json:
            print(f"{len(letters)} dead letter(s)")

    @dlq.command("requeue")
    def requeue_command(
        entry_ids: Optional[list[str]] = typer.Argument(None, help="Entry ids (default: all, after asking)."),
        yes: bool = typer.Option(False, "--yes", help="Do not ask."),
        redis_url: Optional[str] = typer.Option(None, help="Redis URL."),
    ) -> None:
        """Submit dead jobs again with a fresh attempt count."""
        from layertap.producer.cli.common import load_settings
        from layertap.producer.client.client import Client
        from layertap.producer.client.dlq import requeue

        if not entry_ids and not yes and not typer.confirm("Requeue ALL dead letters?"):
            raise typer.Exit(1)
        with Client(load_settings(redis_url=redis_url)) as client:
            job_ids = requeue(client, entry_ids)
        for job_id in job_ids:
            print(job_id)
        print(f"requeued {len(job_ids)} job(s)")

    @dlq.command("purge")
    def purge_command(
        entry_ids: Optional[list[str]] = typer.Argument(None, help="Entry ids (default: all)."),
        yes: bool = typer.Option(False, "--yes", help="Do not ask."),
        redis_url: Optional[str] = typer.Option(None, help="Redis URL."),
    ) -> None:
        """Delete dead letters."""
        from layertap.producer.cli.common import load_settings
        from layertap.producer.client.client import Client
        from layertap.producer.client.dlq import purge

        if not yes and not typer.confirm("Delete " + ("these dead letters" if entry_ids else "ALL dead letters") + "?"):
            raise typer.Exit(1)
        with Client(load_settings(redis_url=redis_url)) as client:
            print(f"purged {purge(client, entry_ids)} dead letter(s)")
