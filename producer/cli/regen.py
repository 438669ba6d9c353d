"""``layertap regenerate``: on-policy data from an OpenAI-compatible endpoint serving the target.

Self-contained like ``layertap.producer.cli.data``; nothing here imports torch. The work is in
``layertap.producer.regen`` (walking a chat, the endpoint client, the resumable store, the enqueue sink).
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any, Optional

import typer

from layertap.producer.cli.common import err_console, fail
from layertap.producer.cli.data import one_line_errors
from layertap.producer.ingest.formats import InputFormat


def regenerate(
    endpoint: str = typer.Option(..., "--endpoint", help="Base URL of the OpenAI-compatible API, e.g. "
                                 "http://127.0.0.1:8000/v1."),
    model: str = typer.Option(..., "--model", help="Model name the endpoint serves (sent with each request)."),
    file: Path = typer.Option(..., "--file", help="Chats to regenerate: any input `enqueue` reads (JSONL, JSON, "
                              "parquet, a saved dataset)."),
    out: Path = typer.Option(..., "--out", help="Output JSONL (appended; rows already there are skipped). "
                             "`layertap enqueue --file OUT` takes it as is."),
    errors: Optional[Path] = typer.Option(None, help="Errors JSONL, one row (id, where, reason) per failed "
                                          "conversation (not written to OUT) and, with --enqueue, per row of OUT "
                                          "the run refused (default: OUT with .errors before the suffix)."),
    input_format: InputFormat = typer.Option(InputFormat.auto, "--format", case_sensitive=False,
                                             help="Row format; auto: detected from the first row."),
    column: Optional[str] = typer.Option(None, help="Column holding the input (default: found by format)."),
    split: Optional[str] = typer.Option(None, help="Split of a saved DatasetDict or a parquet folder."),
    id_column: str = typer.Option("id", help="Column whose value is the row id; rows without it get a content hash."),
    limit: Optional[int] = typer.Option(None, "--limit", min=1, help="Read at most this many source rows."),
    samples: int = typer.Option(1, "--n", min=1, help="Samples per source row, as separate rows (ids <id>, "
                                "<id>-s1, <id>-s2, ...)."),
    concurrency: int = typer.Option(8, "--concurrency", min=1, help="Conversations in flight at once."),
    temperature: Optional[float] = typer.Option(None, help="Sampling temperature (default: the server's)."),
    top_p: Optional[float] = typer.Option(None, help="Nucleus sampling (default: the server's)."),
    max_tokens: Optional[int] = typer.Option(None, min=1, help="Most tokens per assistant turn."),
    seed: Optional[int] = typer.Option(None, help="Seed of sample 0 of each row; sample k uses seed + k."),
    extra_body: Optional[str] = typer.Option(None, help="JSON object merged into every request (top_k, "
                                             "chat_template_kwargs, ...)."),
    reasoning_parser: Optional[str] = typer.Option(None, help="Reasoning parser the server runs (vLLM/SGLang "
                                                   "choose it at start); recorded in the provenance. The parsed "
                                                   "reasoning is kept as reasoning_content."),
    tool_parser: Optional[str] = typer.Option(None, help="Tool-call parser the server runs; recorded in the "
                                              "provenance. Parsed tool calls are kept as tool_calls."),
    token_ids: bool = typer.Option(True, help="Ask for the token ids (vLLM's return_token_ids) and keep them, "
                                   "so extraction uses the exact ids and the loss mask comes from them."),
    retries: int = typer.Option(8, min=0, help="Tries again per request on 408/409/425/429/5xx and lost "
                                "connections."),
    backoff_max: float = typer.Option(30.0, help="Longest wait between tries, in seconds (starts at 0.5 s, doubles)."),
    timeout: float = typer.Option(600.0, help="Seconds one request may take."),
    enqueue_run: Optional[str] = typer.Option(None, "--enqueue", help="Also send each finished conversation into "
                                              "this run as it completes (back-pressure as in `enqueue`)."),
    worker_model: Optional[str] = typer.Option(None, help="With --enqueue: model name the workers serve "
                                               "(default: --model)."),
    layers: Optional[str] = typer.Option(None, help="With --enqueue: layer ids for every job, e.g. 2,18,-1."),
    max_inflight: Optional[int] = typer.Option(None, min=1, help="With --enqueue: most jobs of the run submitted "
                                               "but not finished (default: setting enqueue.max_inflight)."),
    redis_url: Optional[str] = typer.Option(None, help="With --enqueue: Redis URL."),
) -> None:
    """Regenerate every assistant turn with the target model (on-policy data); resumable. Prints a summary."""
    from layertap.producer.ingest.enqueue import plan_jobs
    from layertap.producer.ingest.formats import RowConverter
    from layertap.producer.ingest.sources import open_source
    from layertap.producer.regen.sink import id_of
    from layertap.producer.regen.store import OutputStore
    from layertap.transport.backoff import Backoff

    try:
        from layertap.producer.regen.endpoint import ChatEndpoint
        from layertap.producer.regen.runner import Regenerator, conversations
    except ImportError as exc:  # httpx2 is installed with the client on Python 3.11+
        raise fail(f"layertap regenerate needs httpx2 (Python 3.11 or later): {exc}") from None
    sampling: dict[str, Any] = {"temperature": temperature, "top_p": top_p, "max_tokens": max_tokens}
    sampling = {key: value for key, value in sampling.items() if value is not None}
    if extra_body:
        try:
            extra = json.loads(extra_body)
        except json.JSONDecodeError as exc:
            raise fail(f"--extra-body is not JSON: {exc}", 2) from None
        if not isinstance(extra, dict):
            raise fail("--extra-body must be a JSON object", 2)
        sampling.update(extra)
    provenance = {"endpoint": endpoint, "model": model, "sampling": dict(sampling),
                  **({"reasoning_parser": reasoning_parser} if reasoning_parser else {}),
                  **({"tool_parser": tool_parser} if tool_parser else {})}
    if token_ids:
        sampling["return_token_ids"] = True
    with one_line_errors():
        source = open_source(file, split=split)
    converter = RowConverter(input_format, column=column, id_column=id_column)
    rows = source.rows if limit is None else (row for _, row in zip(range(limit), source.rows))
    planned = plan_jobs(rows, converter, {"model": model}, origin=str(file))

    with one_line_errors(), OutputStore(out, errors) as store:
        sink = open_sink(enqueue_run, worker_model or model, layers, max_inflight, redis_url)
        interrupted = True
        try:
            if sink is not None:
                for row in store.rows():  # written before but perhaps never sent (a Ctrl-C)
                    sink.put(row)
            endpoint_client = ChatEndpoint(endpoint, model, sampling, retries=retries,
                                           backoff=Backoff(0.5, backoff_max), timeout_s=timeout,
                                           api_key=os.environ.get("OPENAI_API_KEY"), max_connections=concurrency)
            regenerator = Regenerator(endpoint_client, store, provenance, concurrency=concurrency, seed=seed,
                                      sink=sink)

            async def main() -> None:
                async with endpoint_client:
                    await regenerator.run(conversations(planned, samples))

            asyncio.run(main())
            interrupted = False
        finally:
            if sink is not None:
                sink.close(interrupted=interrupted)
        for bad in sink.bad if sink is not None else []:
            store.write_error(id_of(bad.where), bad.where, f"not enqueued into run {enqueue_run}: {bad.reason}")
    counts = regenerator.counts
    err_console.print(f"{out}: {counts.written} conversation(s) regenerated ({counts.cut} cut where tool calls "
                      f"diverged), {counts.skipped} already done, {counts.failed} failed; "
                      f"{endpoint_client.retried} request(s) retried", markup=False, highlight=False)
    if token_ids and counts.without_ids:
        why = ("it refused return_token_ids" if endpoint_client.token_ids_refused
               else "it returned none for some replies")
        err_console.print(f"warning: {counts.without_ids} row(s) of {out} carry no token ids ({why}): enqueue "
                          "tokenizes their chats, which may not give the ids the model sampled", markup=False,
                          highlight=False)
    problems = [f"{counts.failed} conversation(s) failed: not written to {out}, each in {store.errors} with "
                "its reason (a re-run tries them again)"] if counts.failed else []
    if sink is not None:
        sent = {outcome.value: count for outcome, count in sink.outcomes.items()}
        err_console.print(f"run {enqueue_run}: {json.dumps(sent)}", markup=False, highlight=False)
        for bad in sink.bad[:100]:
            err_console.print(f"error: {bad.where}: {bad.reason}", markup=False, highlight=False)
        if sink.bad:
            problems.append(f"{len(sink.bad)} row(s) written to {out} were not enqueued into run {enqueue_run}: "
                            f"they stay in {out}, listed above and in {store.errors} with the reason")
    if problems:
        raise fail("; ".join(problems), 2)


def open_sink(run: str | None, model: str, layers: str | None, max_inflight: int | None,
              redis_url: str | None) -> Any:
    """The enqueue sink for ``--enqueue RUN``, or None without it."""
    if run is None:
        return None
    from layertap.producer.client.client import Client
    from layertap.producer.ingest.enqueue import Enqueuer
    from layertap.producer.regen.sink import EnqueueSink
    from layertap.protocol.layers import parse_layer_list
    from layertap.settings import Settings

    settings = Settings()
    client = Client(settings, redis_url=redis_url)
    defaults: dict[str, Any] = {"model": model, "run": run}
    if layers is not None:
        defaults["layers"] = parse_layer_list(layers)
    enqueuer = Enqueuer(client, max_inflight or settings.enqueue.max_inflight, batch_size=1,
                        until=settings.enqueue.inflight_until, group=settings.enqueue.consumer_group)
    return EnqueueSink(client, enqueuer, defaults)


def register(app: typer.Typer) -> None:
    """Add ``regenerate`` to the ``layertap`` app."""
    app.command()(regenerate)
