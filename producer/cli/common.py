"""What every ``layertap`` command shares: the consoles, the one-line error, settings from
flags on top of the environment, and table helpers."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console
from rich.table import Table

from layertap.settings import Settings, WorkerSettings

if TYPE_CHECKING:
    import redis

console = Console()
err_console = Console(stderr=True, soft_wrap=True)  # an error stays one line, however long


class CliError(Exception):
    """An error to print as one line and exit with ``code``."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


def require_run(client: redis.Redis, run: str) -> None:
    """Raise :class:`CliError` (exit 1) unless ``run`` has jobs or results."""
    from layertap.producer.client import runs

    if not runs.exists(client, run):
        raise CliError(f"no run named {run!r}: it has no jobs and no results (see `layertap runs`)")


def redis_url_in_use(argv: list[str]) -> str:
    """The Redis URL a command line runs with: its ``--redis-url``, else the settings' (environment,
    ``layertap.toml``; localhost by default), so an error names the server that was asked."""
    for index, arg in enumerate(argv):
        if arg == "--redis-url" and index + 1 < len(argv):
            return argv[index + 1]
        if arg.startswith("--redis-url="):
            return arg.partition("=")[2]
    return Settings().broker_url


def fail(message: str, code: int = 1) -> typer.Exit:
    """Print one ``error:`` line; return the exit to raise."""
    err_console.print(f"error: {message}", markup=False, highlight=False)
    return typer.Exit(code)


def load_settings(*, redis_url: str | None = None, storage: str | Path | None = None,
                  **worker_fields: Any) -> Settings:
    """Settings from the environment, with the given flags (those not None) on top."""
    settings = Settings()
    top: dict[str, Any] = {}
    if redis_url is not None:
        top["redis_url"] = redis_url
    if storage is not None:
        top["storage_root"] = str(storage)
    changes = {key: value for key, value in worker_fields.items() if value is not None}
    if changes:  # validated like the environment is
        top["worker"] = type(settings.worker).model_validate({**settings.worker.model_dump(), **changes})
    return settings.model_copy(update=top) if top else settings


def worker_default(field: str) -> str:
    """``"default: <value>, setting worker.<field>"`` for a flag whose default is a setting."""
    value = WorkerSettings.model_fields[field].default
    return f"default: {getattr(value, 'value', value)}, setting worker.{field}"


def parse_layers(text: str | None) -> list[int] | None:
    """A ``--layers`` value (``2,18,-1``) as layer ids; None when the flag is not given. Raises ``LayerIdError``."""
    from layertap.protocol.layers import parse_layer_list

    return None if text is None else parse_layer_list(text)


def folding_table(*headers: str, title: str) -> Table:
    """A table whose cells wrap in a narrow terminal instead of being cut with an ellipsis."""
    table = Table(title=title)
    for header in headers:
        table.add_column(header, overflow="fold")
    return table


def print_file_description(info: dict[str, Any]) -> None:
    """Print ``info`` (``file_stats.describe_file``) as ``layertap inspect`` shows it: path and size, then tables of
    tensors, metadata (long values cut to 100 characters) and per-layer statistics."""
    console.print(f"[bold]{info['path']}[/bold]  ({info['bytes']:,} bytes)", soft_wrap=True)
    tensors = folding_table("tensor", "shape", "dtype", title="tensors")
    for name, tensor in info["tensors"].items():
        tensors.add_row(name, str(tensor["shape"]), tensor["dtype"])
    console.print(tensors)
    meta = folding_table("key", "value", title="metadata")
    for key, value in sorted(info["metadata"].items()):
        meta.add_row(key, value if len(value) < 100 else value[:97] + "...")
    console.print(meta)
    stats = folding_table("layer", "mean", "std", "min", "max", "mean token L2 norm", "finite",
                          title="hidden_states per layer")
    for row in info["layer_stats"]:
        stats.add_row(str(row["layer"]), f"{row['mean']:.4g}", f"{row['std']:.4g}", f"{row['min']:.4g}",
                      f"{row['max']:.4g}", f"{row['mean_token_norm']:.4g}", str(row["finite"]))
    console.print(stats)
