"""The regeneration loop: source rows become conversations to regenerate, at most
``concurrency`` at a time; each finished one is written to the store and handed to a sink.

Invariants: rows are read exactly as ``enqueue`` reads them (``plan_jobs``); a conversation's row
id is the source row's id (its ``id`` column) or else the job's content hash, as ``enqueue`` would
give it; sample ``k > 0`` of ``--n`` gets ``<id>-s<k>``, so adding samples later
adds rows and repeats none. An id already in the store, or already started in this run (a
repeated row), is skipped. A conversation that fails writes no row and one error row. A reply is
kept as the endpoint gave it, control characters included (``docs/training-data.md``). A
cancelled run (Ctrl-C) leaves every finished row written and no partial one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from layertap.producer.ingest.enqueue import BadRow, Planned
from layertap.producer.regen.conversation import regenerate
from layertap.producer.regen.endpoint import ChatEndpoint, EndpointError
from layertap.producer.regen.store import OutputStore

Sink = Callable[[dict[str, Any]], Awaitable[None]]


@dataclass(frozen=True)
class Conversation:
    """One sample to regenerate: its row id, the source row's place and id, and the chat."""

    row_id: str
    where: str
    source_id: str
    sample: int
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None


def sample_id(base: str, sample: int) -> str:
    """The row id of sample ``sample``: ``base`` itself for sample 0, else ``<base>-s<sample>``."""
    return base if sample == 0 else f"{base}-s{sample}"


def conversations(items: Iterable[Planned | BadRow], samples: int) -> Iterator[Conversation | BadRow]:
    """``samples`` conversations per job that ``enqueue`` would plan from a row (its id: the row's
    id or the job's content hash), or a :class:`BadRow`."""
    for item in items:
        if isinstance(item, BadRow):
            yield item
            continue
        job = item.job
        if job.prompt is not None:
            messages = [{"role": "user", "content": job.prompt}]
        elif job.messages is not None:
            messages = [message.model_dump(exclude_none=True) for message in job.messages]
        else:
            yield BadRow(item.where, "a row of token ids has no chat to regenerate")
            continue
        base = job.job_id or ""
        for sample in range(samples):
            yield Conversation(sample_id(base, sample), item.where, base, sample, messages, job.tools)


@dataclass
class Counts:
    """What a regeneration did so far (``on_progress`` gets it after each conversation, :meth:`Regenerator.run`
    returns it): rows written, skipped, failed (each with an error row); of those written, how many were cut or
    have no token ids."""

    written: int = 0
    skipped: int = 0  # already in the output (or repeated in this run)
    failed: int = 0
    cut: int = 0  # written, but cut where the tool calls diverged
    without_ids: int = 0  # written without token ids (the endpoint returned none for some reply)


@dataclass
class Regenerator:
    """Regenerates conversations through ``endpoint`` into ``store``; ``provenance`` (endpoint,
    model, sampling) goes into every row with the row's own source id and sample."""

    endpoint: ChatEndpoint
    store: OutputStore
    provenance: dict[str, Any]
    concurrency: int = 8
    seed: int | None = None
    sink: Sink | None = None
    counts: Counts = field(default_factory=Counts)
    on_progress: Callable[[Counts], None] = lambda counts: None

    async def run(self, items: Iterable[Conversation | BadRow]) -> Counts:
        """Regenerate every conversation not done yet; returns the counts."""
        slots = asyncio.Semaphore(self.concurrency)
        started: set[str] = set()
        running: set[asyncio.Task[None]] = set()
        try:
            for item in items:
                if isinstance(item, BadRow):
                    self.store.write_error(None, item.where, item.reason)
                    self.counts.failed += 1
                    continue
                if item.row_id in self.store.done or item.row_id in started:
                    self.counts.skipped += 1
                    continue
                started.add(item.row_id)
                await slots.acquire()
                task = asyncio.create_task(self._one(item))
                running.add(task)
                task.add_done_callback(lambda done: (running.discard(done), slots.release()))
            await asyncio.gather(*running)
        finally:
            for task in running:
                task.cancel()
        return self.counts

    async def _one(self, conversation: Conversation) -> None:
        seed = None if self.seed is None else self.seed + conversation.sample
        try:
            result = await regenerate(conversation.messages,
                                      lambda messages: self.endpoint.complete(messages, conversation.tools, seed))
        except (EndpointError, ValueError) as exc:
            self.store.write_error(conversation.row_id, conversation.where, str(exc))
            self.counts.failed += 1
            self.on_progress(self.counts)
            return
        row = self._row(conversation, result, seed)
        self.store.write(row)
        self.counts.written += 1
        self.counts.cut += result.cut is not None
        self.counts.without_ids += "token_ids" not in row
        self.on_progress(self.counts)
        if self.sink is not None:
            await self.sink(row)

    def _row(self, conversation: Conversation, result: Any, seed: int | None) -> dict[str, Any]:
        served = next((reply.model for reply in result.replies if reply.model), None)
        regeneration: dict[str, Any] = {**self.provenance, "served_model": served, "seed": seed,
                                        "source_id": conversation.source_id, "source": conversation.where,
                                        "sample": conversation.sample, "replies": len(result.replies)}
        if result.cut is not None:
            regeneration["cut"] = result.cut
        row: dict[str, Any] = {"id": conversation.row_id, "messages": result.messages}
        if conversation.tools:
            row["tools"] = conversation.tools
        if result.token_ids is not None:
            row["token_ids"], row["loss_mask"] = result.token_ids, result.loss_mask
            regeneration["masked_replies"] = result.masked_replies
        row["provenance"] = {"regeneration": regeneration}
        return row
