"""``layertap enqueue``, ``manifest`` and ``export``: datasets in, training data out.

Self-contained (it does not import ``layertap.producer.cli.app``, which runs as ``__main__`` under
``python -m layertap``): errors that need their own exit code print one
``error: ...`` line here and exit; others propagate to ``layertap.producer.cli.app.main``.
Nothing here imports torch; the data libraries are imported when a command needs them.
"""

from __future__ import annotations

import contextlib
import itertools
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)

from layertap.producer.cli.common import err_console, fail
from layertap.producer.ingest.formats import InputFormat

if TYPE_CHECKING:
    from layertap.producer.files.export_config import ExportLayers

MAX_REPORTED_ROWS = 100


def enqueue(
    model: str = typer.Option(..., "--model", help="Model the worker serves: its --name, or the same --model "
                              "string (a local folder means its basename, as the worker names it)."),
    run: str = typer.Option("default", "--run", help="Run name: output folder and result stream."),
    prompt: Optional[list[str]] = typer.Option(None, "--prompt", help="A prompt (repeatable)."),
    file: Optional[Path] = typer.Option(None, "--file", help="JSONL or JSON file, parquet file or folder, a "
                                        "dataset folder saved with datasets' save_to_disk, or - for JSONL on stdin."),
    input_format: InputFormat = typer.Option(InputFormat.auto, "--format", case_sensitive=False,
                                             help="Row format; auto: detected from the first row."),
    column: Optional[str] = typer.Option(None, help="Column holding the input (default: found by format)."),
    split: Optional[str] = typer.Option(None, help="Split of a saved DatasetDict or a parquet folder."),
    id_column: str = typer.Option("id", help="Column whose value is the job id; rows without it (or with "
                                  "--id-column '') get a content hash."),
    max_inflight: Optional[int] = typer.Option(None, min=1, help="Most jobs of the run submitted but not "
                                               "finished (default: setting enqueue.max_inflight)."),
    inflight_until: Optional[str] = typer.Option(None, help="finished | consumed: a job stops counting in flight "
                                                 "at its result, or once a streaming consumer took it (default: "
                                                 "setting enqueue.inflight_until)."),
    consumer_group: Optional[str] = typer.Option(None, help="With --inflight-until consumed: the streaming "
                                                 "consumer group that counts (default: setting "
                                                 "enqueue.consumer_group, 'train')."),
    layers: Optional[str] = typer.Option(None, help="Layer ids for every job, e.g. 2,18,-1."),
    max_length: Optional[int] = typer.Option(None, help="Token limit per job."),
    truncate: bool = typer.Option(False, help="Cut jobs longer than --max-length instead of failing them."),
    loss_on: Optional[str] = typer.Option(None, help="Chats: all | last assistant turn(s) in the loss mask, or "
                                          "none (analysis: no assistant turn needed, mask all 0)."),
    generation_prompt: bool = typer.Option(False, help="Chats: end each with the template's generation prompt "
                                           "(the states where an answer starts; never trained on)."),
    final_hidden_states: bool = typer.Option(False, help="Also store the last layer's output after the final norm."),
    topk: Optional[int] = typer.Option(None, help="Also store the teacher's top-k next-token log-probs."),
    topk_on: Optional[str] = typer.Option(None, help="mask (positions predicting a loss-mask token) | all."),
    dtype: Optional[str] = typer.Option(None, help="auto | bfloat16 | float16 | float32 | float8 (stored dtype; "
                                        "bf16, fp16, fp32, fp8 too)."),
    check: Optional[bool] = typer.Option(None, "--check/--no-check", show_default=False, help="--check: refuse "
                                         "unless a live worker serves --model; --no-check: only warn; default "
                                         "(as Client.submit): refuse when other workers are live, warn when none is; "
                                         "unless --no-check, jobs asking for layers the served model lacks are bad "
                                         "rows."),
    limit: Optional[int] = typer.Option(None, "--limit", min=1, help="Read at most this many rows (prompts "
                                        "first, then the file's)."),
    keep_existing: bool = typer.Option(False, "--keep-existing", help="Rows whose jobs (by their own ids) are ok "
                                       "in the run with other content than asked (other options or input): keep "
                                       "those files, send nothing for them."),
    replace: bool = typer.Option(False, "--replace", help="Rows whose jobs (by their own ids) are ok in the run "
                                 "with other content than asked: extract what is asked in place of those files."),
    yes: bool = typer.Option(False, "--yes", help="Send even when the files' estimated size is more than the "
                             "free space of the workers' storage."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Read and check the rows, print the job ids, send "
                                 "nothing (Redis is not contacted)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Do not print the ids of the jobs sent."),
    redis_url: Optional[str] = typer.Option(None, help="Redis URL."),
) -> None:
    """Stream jobs into the queue (one per row); skips jobs already ok in the run. Prints one job id per line.

    Before sending, a file or --prompt input is read once to print the files' expected size and
    to refuse (nothing sent) rows whose jobs are ok with other content, and files larger than
    the storage's free space (--yes sends anyway).

    Exit codes: 0 sent (or already ok); 1 refused, or no rows at all (empty input); 2 bad rows or
    arguments; 130 interrupted (Ctrl-C: run the same command again to send the rest)."""
    from layertap.producer.cli.preflight import changed_refusal, check_before_sending
    from layertap.producer.client.client import Client, NoWorker, NoWorkerWarning
    from layertap.producer.client.fleet import served_shape
    from layertap.producer.ingest.enqueue import (
        BadRow,
        Enqueuer,
        OnChange,
        Outcome,
        Planned,
        job_from_data,
        plan_jobs,
    )
    from layertap.producer.ingest.formats import RowConverter
    from layertap.producer.ingest.sources import open_source
    from layertap.producer.ingest.survey import survey
    from layertap.protocol.layers import parse_layer_list
    from layertap.protocol.naming import check_name, served_model_name
    from layertap.settings import Settings

    if not prompt and file is None:
        raise fail("nothing to enqueue: give --prompt TEXT or --file F", 2)
    if keep_existing and replace:
        raise fail("give one of --keep-existing (keep the files there) or --replace (extract what is asked)", 2)
    on_change = OnChange.replace if replace else OnChange.keep if keep_existing else OnChange.refuse
    model = served_model_name(model)
    defaults: dict[str, Any] = {"model": model, "run": run, "max_length": max_length, "truncate": truncate,
                                "layers": parse_layer_list(layers) if layers is not None else None,
                                "loss_on": loss_on, "topk": topk, "topk_on": topk_on, "dtype": dtype,
                                "final_hidden_states": final_hidden_states or None,
                                "generation_prompt": generation_prompt or None}
    defaults = {key: value for key, value in defaults.items() if value is not None}
    settings = Settings()
    max_job_bytes = settings.limits.max_job_bytes
    until = inflight_until or settings.enqueue.inflight_until
    if until not in ("finished", "consumed"):
        raise fail(f"--inflight-until must be finished or consumed, not {until!r}", 2)
    try:  # the flags, checked once before any row is read
        check_name(run, "--run")
        job_from_data({"messages": [{"role": "user", "content": "flags"}]}, defaults, max_job_bytes)
    except ValueError as exc:
        raise fail(str(exc) if str(exc).startswith("--run") else f"invalid flags: {exc}", 2) from None
    prompts = [Planned(f"--prompt {i + 1}", job_from_data({"prompt": text}, defaults, max_job_bytes))
               for i, text in enumerate(prompt or [])]

    def read_items() -> tuple[Iterable[Planned | BadRow], int | None]:
        """The input's items, prompts first, up to --limit, and how many if known (the file opened afresh)."""
        items: Iterable[Planned | BadRow] = prompts
        total: int | None = len(prompts)
        if file is not None:
            with one_line_errors():
                source = open_source(file, split=split)
            total = None if source.total is None else len(prompts) + source.total
            converter = RowConverter(input_format, column=column, id_column=id_column)
            items = itertools.chain(prompts, plan_jobs(source.rows, converter, defaults, origin=str(file),
                                                       max_job_bytes=max_job_bytes, images_root=settings.images_root,
                                                       limits=settings.limits))
        if limit is not None:
            items = itertools.islice(items, limit)
            total = None if total is None else min(total, limit)
        return items, total

    items, total = read_items()
    if dry_run:
        raise typer.Exit(dry_run_report(items, run, quiet))
    counts: Counter[Outcome] = Counter()
    with Client(settings, redis_url=redis_url) as client, warnings.catch_warnings():
        warnings.simplefilter("ignore", NoWorkerWarning)  # said once below, as a line
        try:
            client.check_served(model, check)
        except NoWorker as exc:
            raise fail(f"{exc}; use --no-check to enqueue anyway") from None
        shape = served_shape(client.workers(), model)
        if shape is None:
            err_console.print(f"warning: no live worker serves model {model!r}; its jobs wait in the queue "
                              "until one does", markup=False, highlight=False)
        if file is None or (str(file) != "-" and file.exists()):  # an input read twice: this look, then the send
            again, again_total = read_items()
            with progress(again_total, "look ahead") as step, one_line_errors():
                found = survey(client.redis, again, shape, on_change, step, settings.redis_wait_s)
            check_before_sending(run, model, found, shape, yes=yes)
        else:
            err_console.print(f"note: {file} is read once: neither the files' size nor rows ok with other content "
                              "are checked before sending", markup=False, highlight=False)
        enqueuer = Enqueuer(client, max_inflight or settings.enqueue.max_inflight,
                            until=until, group=consumer_group or settings.enqueue.consumer_group,  # type: ignore[arg-type]
                            check=check, on_change=on_change, shape=shape)
        with (resume_hint(run, counts), progress(total, "enqueue") as step, one_line_errors(),
              contextlib.closing(enqueuer.run(items)) as outcomes):  # closed at once: what it holds is sent
            for outcome, item in outcomes:
                counts[outcome] += 1
                if outcome in (Outcome.bad, Outcome.changed) and counts[outcome] <= MAX_REPORTED_ROWS:
                    assert isinstance(item, BadRow)
                    err_console.print(f"error: {item.where}: {item.reason}", markup=False, highlight=False)
                elif outcome in (Outcome.submitted, Outcome.replaced) and not quiet:
                    assert isinstance(item, Planned)
                    print(item.job.job_id, flush=True)
                step(f"sent {counts[Outcome.submitted] + counts[Outcome.replaced]} · already ok "
                     f"{counts[Outcome.already_ok]} · bad {counts[Outcome.bad]} · "
                     f"in flight ≤ {enqueuer.limiter.in_flight}")
    sent, replaced = counts[Outcome.submitted] + counts[Outcome.replaced], counts[Outcome.replaced]
    parts = [f"{sent} job(s) sent" + (f" ({replaced} replacing files of other content)" if replaced else ""),
             f"{counts[Outcome.already_ok]} already ok"]
    parts += [f"{counts[Outcome.kept]} kept with other content"] if counts[Outcome.kept] else []
    parts += [f"{counts[Outcome.changed]} ok with other content (not sent)"] if counts[Outcome.changed] else []
    parts += [f"{counts[Outcome.repeated]} repeated row(s) skipped", f"{counts[Outcome.bad]} bad row(s)"]
    err_console.print(f"run {run}: {', '.join(parts)}", markup=False, highlight=False)
    if counts[Outcome.changed]:
        refusal = changed_refusal(counts[Outcome.changed], run, "see above")
        if not counts[Outcome.bad]:
            raise fail(refusal)
        err_console.print(f"error: {refusal}", markup=False, highlight=False)
    if counts[Outcome.bad]:
        shown = "" if counts[Outcome.bad] <= MAX_REPORTED_ROWS else f"; the first {MAX_REPORTED_ROWS} are shown"
        raise fail(f"{counts[Outcome.bad]} row(s) were not enqueued (see above{shown})", 2)
    if not counts:
        err_console.print(f"warning: {'standard input' if str(file) == '-' else file or 'the input'} has no rows: "
                          "nothing was sent", markup=False, highlight=False)
        raise typer.Exit(1)


@contextlib.contextmanager
def resume_hint(run: str, counts: Counter[Any]) -> Iterator[None]:
    """On Ctrl-C: say how many jobs were sent (every one counted is in Redis) and how to resume; exit 130."""
    from layertap.producer.ingest.enqueue import Outcome

    try:
        yield
    except KeyboardInterrupt:
        err_console.print(f"interrupted: run {run}: {counts[Outcome.submitted]} job(s) sent, "
                          f"{counts[Outcome.already_ok]} already ok. Run the same command again to resume: jobs "
                          "already ok are skipped, the others sent again", markup=False, highlight=False)
        raise typer.Exit(130) from None


def dry_run_report(items: Iterable[Any], run: str, quiet: bool) -> int:
    """``enqueue --dry-run``: print each valid row's job id and each bad row's error; the exit code."""
    from layertap.producer.ingest.enqueue import BadRow

    good = bad = 0
    with one_line_errors():
        for item in items:
            if isinstance(item, BadRow):
                bad += 1
                if bad <= MAX_REPORTED_ROWS:
                    err_console.print(f"error: {item.where}: {item.reason}", markup=False, highlight=False)
            else:
                good += 1
                if not quiet:
                    print(item.job.job_id, flush=True)
    err_console.print(f"run {run} (dry run, nothing sent): {good} job(s) would be sent, {bad} bad row(s)",
                      markup=False, highlight=False)
    return 2 if bad else 0


@contextlib.contextmanager
def one_line_errors() -> Iterator[None]:
    """Expected failures as one ``error:`` line: exit 2 for a file whose format cannot be told, else 1."""
    from layertap.producer.ingest.formats import UndetectableFormat

    try:
        yield
    except UndetectableFormat as exc:
        raise fail(str(exc), 2) from None
    except (ValueError, OSError, RuntimeError) as exc:
        raise fail(str(exc)) from None


class RunListing:
    """A run's ok results as manifest entries, in order; a result without a valid file is printed
    as one ``error:`` line (the first 100), counted in ``skipped`` and left out."""

    def __init__(self, run: str, redis_url: str | None, *, verify: bool = False):
        from layertap.producer.client import runs
        from layertap.producer.client.client import Client
        from layertap.producer.client.runs import ok_files
        from layertap.settings import Settings

        with Client(Settings(), redis_url=redis_url) as client:
            if not runs.exists(client.redis, run):
                raise fail(f"no run named {run!r}: it has no jobs and no results (see `layertap runs`)")
            self.results = ok_files(client.redis, run)
            self.storage_options = client.settings.storage_options
            self.roots = client.settings.reading_storages()
        self.run = run
        self.verify = verify
        self.skipped = self.tokens = self.passes = 0

    def __iter__(self) -> Iterator[Any]:
        """One pass over the entries; each pass counts afresh, and only the first prints."""
        from layertap.producer.files.manifest import Skipped, collect

        first_pass, self.passes = self.passes == 0, self.passes + 1
        self.skipped = self.tokens = 0
        for entry in collect(self.results, run=self.run, roots=self.roots, verify=self.verify,
                             storage_options=self.storage_options):
            if isinstance(entry, Skipped):
                self.skipped += 1
                if first_pass and self.skipped <= MAX_REPORTED_ROWS:
                    err_console.print(f"error: job {entry.job_id}: {entry.reason}", markup=False, highlight=False)
                continue
            self.tokens += entry.num_tokens
            yield entry

    def fail_if_skipped(self) -> None:
        if self.skipped:
            raise fail(f"{self.skipped} ok result(s) have no valid file and are left out (see above)", 2)


def manifest(
    run: str = typer.Option("default", "--run", help="Run name."),
    out: Optional[Path] = typer.Option(None, "--out", help="F.parquet or F.jsonl (default: <run>.manifest.parquet, "
                                       "or .jsonl without pyarrow)."),
    verify: bool = typer.Option(False, help="Also check every tensor's checksum (reads every file whole)."),
    redis_url: Optional[str] = typer.Option(None, help="Redis URL."),
) -> None:
    """Write a run's manifest: one row per job with an ok result (job id, path, tokens, layers, checksums)."""
    from layertap.producer.files.manifest import default_manifest_path, write_manifest

    out = out or default_manifest_path(run)
    listing = RunListing(run, redis_url, verify=verify)
    with progress(len(listing.results), "manifest") as step, one_line_errors():
        count = write_manifest(counted(listing, step), out)
    err_console.print(f"run {run}: {count} job(s), {listing.tokens} tokens -> {out}", markup=False, highlight=False)
    listing.fail_if_skipped()


def export(
    out: Path = typer.Option(..., "--out", help="Folder to create (must be new or empty)."),
    run: Optional[str] = typer.Option(None, "--run", help="Run to export (its ok results)."),
    from_manifest: Optional[Path] = typer.Option(None, "--manifest", help="Export this manifest instead of --run."),
    export_format: str = typer.Option("speculators", "--format", help="speculators (the only layout so far)."),
    any_layers: bool = typer.Option(False, "--any-layers", help="Skip the check that every file ends with the "
                                    "model's last layer."),
    redis_url: Optional[str] = typer.Option(None, help="Redis URL."),
) -> None:
    """Export a run as training data for another trainer (vLLM speculators: hs_{i}.safetensors + a datasets folder,
    float8 files as bfloat16 copies, the layer ids in speculators.yaml); prints the layer ids."""
    from layertap.producer.files.export import check_entries, export_speculators
    from layertap.producer.files.manifest import iter_manifest
    from layertap.settings import Settings

    if export_format != "speculators":
        raise fail(f"--format {export_format!r}: only 'speculators' is supported", 2)
    if (run is None) == (from_manifest is None):
        raise fail("give one of --run R or --manifest F", 2)
    listing = RunListing(run, redis_url) if run is not None else None

    def entries() -> Any:
        return listing if listing is not None else iter_manifest(from_manifest)  # type: ignore[arg-type]

    with one_line_errors():  # every file's layers agree before anything is written
        check_entries(entries(), check_layers=not any_layers, storage_options=Settings().storage_options)
    with progress(len(listing.results) if listing else None, "export") as step, one_line_errors():
        quiet_datasets()
        report = export_speculators(counted(entries(), step), out, check_layers=not any_layers,
                                    storage_options=Settings().storage_options)
    freq = ", token_freq.pt" if report.token_freq else " (no token_freq.pt: torch is not installed)"
    dequantized = f", {report.dequantized} float8 written as bfloat16" if report.dequantized else ""
    err_console.print(f"{report.rows} rows, {report.tokens} tokens -> {out} ({report.linked} files linked, "
                      f"{report.copied} copied{dequantized}{freq})", markup=False, highlight=False)
    assert report.layers is not None  # an export has rows
    print_export_layers(report.layers, out)
    if listing is not None:
        listing.fail_if_skipped()


def print_export_layers(found: ExportLayers, out: Path) -> None:
    """Say which layer ids an export holds and how speculators is to be told (``export_config``)."""
    from layertap.producer.files.export_config import SPECULATORS_CONFIG

    head = f"layers {found.layers} (vLLM ids, L = {found.num_hidden_layers})"
    target = found.target_layer_ids
    if target is None:
        tail = f"; they do not end with {found.num_hidden_layers}: no {SPECULATORS_CONFIG} written"
    else:
        tail = (f": target layer ids {target} in {out / SPECULATORS_CONFIG} (speculators train --config it, "
                f"or --target-layer-ids {' '.join(map(str, target))})")
    print(head + tail, flush=True)


def quiet_datasets() -> None:
    """Quiet the datasets library's own progress bars (ours is drawn instead)."""
    from layertap.extras import need

    need("datasets").disable_progress_bars()


@contextlib.contextmanager
def progress(total: int | None, label: str) -> Iterator[Callable[[str], None]]:
    """A progress bar on stderr when it is a terminal; yields ``step(status)``, one call per item."""
    with Progress(TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[status]}"), console=err_console,
                  disable=not err_console.is_terminal) as bar:
        task = bar.add_task(label, total=total, status="")
        yield lambda status="": bar.update(task, advance=1, status=status)


def counted(items: Iterable[Any], step: Callable[[str], None]) -> Iterator[Any]:
    """``items``, calling ``step`` after each."""
    for item in items:
        yield item
        step("")


def register(app: typer.Typer) -> None:
    """Add ``enqueue``, ``manifest`` and ``export`` to the ``layertap`` app."""
    app.command()(enqueue)
    app.command()(manifest)
    app.command()(export)
