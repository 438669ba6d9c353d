"""Before an enqueue sends anything: how many jobs it would send, how many tokens and bytes of
files they would make, and which rows' jobs are ok in their runs with other content.

The tokens are known for token ids and estimated for text (``Job.estimated_tokens``: characters /
``CHARS_PER_TOKEN``) with a bound (``Job.token_bound``: one per byte of text); neither counts
chat-template or image tokens. The bytes are ``fileformat.file_bytes`` of each job's tokens,
layers, dtype and tensors, with the hidden size, default layers, compute dtype and residual copies
the live workers serving the model report (``fleet.ServedShape``); unknown without them. A row
repeated in the input is counted each time.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import redis

from layertap.producer.client.fleet import ServedShape
from layertap.producer.ingest.enqueue import BadRow, OnChange, Planned, look_up
from layertap.protocol import fileformat as ff
from layertap.protocol.schema import Job, Status

BATCH = 256


@dataclass
class Survey:
    """What an enqueue would do (see the module doc): jobs to send, their tokens (estimate and
    bound) and file bytes (estimate and bound; None when the workers' shape is not known), jobs
    already ok, and the rows whose jobs are ok with other content (with the first's reason)."""

    to_send: int = 0
    tokens: int = 0
    token_bound: int = 0
    bytes: int | None = 0
    byte_bound: int | None = 0
    already_ok: int = 0
    changed: int = 0
    first_change: BadRow | None = None


def survey(client: redis.Redis, items: Iterable[Planned | BadRow], shape: ServedShape | None, on_change: OnChange,
           step: Callable[[str], None] = lambda status: None, wait_s: float = 0.0) -> Survey:
    """Read every item once (``step`` after each) and the ledger's state of each job, sending nothing;
    each read waited out for up to ``wait_s`` while Redis is away."""
    found = Survey()
    planned = _planned(items, step)
    while batch := list(itertools.islice(planned, BATCH)):
        for item, ledgered in zip(batch, look_up(client, [item.job for item in batch], shape, wait_s)):
            if ledgered.status == Status.ok.value and ledgered.change is None:
                found.already_ok += 1
            elif ledgered.status == Status.ok.value and on_change is OnChange.refuse:
                found.changed += 1
                found.first_change = found.first_change or BadRow(item.where, ledgered.change or "")
            elif ledgered.status != Status.ok.value or on_change is OnChange.replace:
                _count(found, item.job, shape)
    return found


def _planned(items: Iterable[Planned | BadRow], step: Callable[[str], None]) -> Iterator[Planned]:
    for item in items:
        step("")
        if isinstance(item, Planned):
            yield item


def _count(found: Survey, job: Job, shape: ServedShape | None) -> None:
    tokens, bound = job.estimated_tokens(), job.token_bound()
    found.to_send += 1
    found.tokens += tokens
    found.token_bound += bound
    size = job_bytes(job, shape, tokens)
    found.bytes = None if size is None or found.bytes is None else found.bytes + size
    size = job_bytes(job, shape, bound)
    found.byte_bound = None if size is None or found.byte_bound is None else found.byte_bound + size


def job_bytes(job: Job, shape: ServedShape | None, tokens: int) -> int | None:
    """The bytes of ``job``'s file with ``tokens`` tokens, written by workers of ``shape``; None
    when they do not report their hidden size or cannot store the job's dtype."""
    dtype = shape.stored_dtype(job.dtype) if shape is not None else None
    if shape is None or shape.hidden_size is None or dtype is None:
        return None
    layers = len(job.layers) if job.layers is not None else len(shape.default_layers)
    return ff.file_bytes(tokens, layers, shape.hidden_size, dtype, copies=shape.copies,
                         loss_mask=job.messages is not None or job.loss_mask is not None,
                         final_hidden_states=job.final_hidden_states, topk=job.topk or 0)


def describe_bytes(size: int) -> str:
    """``size`` in decimal units, three significant figures: ``29 GB``, ``1.57 MB``."""
    for unit, scale in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if size >= scale:
            return f"{size / scale:.3g} {unit}"
    return f"{size} B"
