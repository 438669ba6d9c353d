"""Writing one job's file through its storage (``layertap.storage``), by the file-level protocol:

1. take the storage's writer lock of the file (local: exclusive ``flock`` on ``<file>.lock``;
   object stores: none, the object appears whole or not at all);
2. :func:`examine` the file at its address, if any: one that verifies (structure, header
   and tensor checksums) and has the same ``content_id`` (another worker won a race, or a
   redelivered job) is kept and nothing is written; one that verifies but holds another job's
   content under this job id (another ``spec_hash``) is overwritten only for a job that says
   ``replace`` (else :class:`FileTaken`); a damaged one, or one computed with something else
   (layers, dtype, model weights, tokenizer, format version), is replaced;
3. else write the file to the local path :meth:`Storage.write` gives, which commits it whole
   (local: fsync, rename, fsync folder; object stores: upload to the final key).

A file at its address is therefore always complete, on every backend.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import torch
from safetensors.torch import save_file

from layertap.protocol.fileformat import FileFormatError, FileHeader, MetaKey, sealed_metadata
from layertap.storage.base import Storage
from layertap.storage.registry import storage_at

log = logging.getLogger(__name__)

#: Threads that examine the files of one call side by side (:func:`examine_many`), shared by all
#: calls: one per core, the calling thread being one of them. Their reads and CRC-32s run outside the GIL.
EXAMINE_THREADS = max(1, (os.cpu_count() or 1) - 1)
_EXAMINERS = ThreadPoolExecutor(max_workers=EXAMINE_THREADS, thread_name_prefix="layertap-examine")


class OnDisk(str, Enum):
    """What is at a job's final name, against what the job would write there."""

    missing = "missing"  # no file: write it
    damaged = "damaged"  # a file that fails verification (header, truncation, checksums): replace it
    stale = "stale"  # a valid file of this job computed with something else (another content_id): replace it
    taken = "taken"  # a valid file of other job content (another spec_hash) under this job id: kept (unless replace)
    matches = "matches"  # the file this job would write: keep it, answer from it


@dataclass(frozen=True)
class Existing:
    """:func:`examine`'s verdict; ``header`` is set when the file verified, ``reason`` when it did not."""

    state: OnDisk
    header: FileHeader | None = None
    reason: str = ""


class FileTaken(Exception):
    """The job's final name holds a valid file of another job content (same run and job id)."""


def examine(path: str | Path, spec_hash: str, content_id: str, storage: Storage | None = None, *,
            shared: bool = False) -> Existing:
    """Verify the file at ``path`` in ``storage`` (by default the one its address names; checksums
    included) and compare it with what a job of this ``spec_hash`` and ``content_id`` would write
    there. Files appear only complete, so no lock is needed (``shared`` waits out a writer anyway)."""
    storage = storage_at(path) if storage is None else storage
    try:
        header = storage.verify(str(path), shared=shared)
    except FileNotFoundError:
        return Existing(OnDisk.missing)
    except (FileFormatError, OSError) as exc:
        return Existing(OnDisk.damaged, reason=str(exc))
    if header.metadata[MetaKey.SPEC_HASH] != spec_hash:
        return Existing(OnDisk.taken, header)
    if header.metadata.get(MetaKey.CONTENT_ID) != content_id:
        return Existing(OnDisk.stale, header)
    return Existing(OnDisk.matches, header)


def examine_many(requests: Sequence[tuple[str, str, str]], storage: Storage) -> list[Future]:
    """:func:`examine` of each ``(path, spec_hash, content_id)`` in ``storage``, in runs of
    consecutive requests side by side on the examiner threads and this one; returns when all are
    done. Each future holds its :class:`Existing`, or what :func:`examine` raised for it alone."""
    verdicts: list[Future] = [Future() for _ in requests]
    runs = max(1, min(len(requests), EXAMINE_THREADS + 1))
    bounds = [len(requests) * run // runs for run in range(runs + 1)]
    spread = [_EXAMINERS.submit(_examine_run, requests, verdicts, storage, start, end)
              for start, end in zip(bounds[1:-1], bounds[2:])]
    _examine_run(requests, verdicts, storage, bounds[0], bounds[1])
    wait(spread)
    return verdicts


def _examine_run(requests: Sequence[tuple[str, str, str]], verdicts: list[Future], storage: Storage,
                 start: int, end: int) -> None:
    for index in range(start, end):
        try:
            verdicts[index].set_result(examine(*requests[index], storage))
        except Exception as exc:  # a fault of this file's check alone: its job's error
            verdicts[index].set_exception(exc)


def write_job_file(path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str],
                   storage: Storage | None = None, *, replace: bool = False) -> bool:
    """Write ``tensors`` to ``path`` in ``storage`` (by default the one its address names) by the
    protocol above (``metadata`` has the job's ``spec_hash`` and ``content_id``). Returns False if
    an equal file was kept; raises :class:`FileTaken` for a file of other job content there,
    which only ``replace`` (the job's own ``replace``) writes over."""
    storage, path = (storage_at(path) if storage is None else storage), str(path)
    tensors = {name: tensor.contiguous() for name, tensor in tensors.items()}
    metadata = sealed_metadata(metadata, {name: tensor.view(torch.uint8).numpy() for name, tensor in tensors.items()},
                               {name: list(tensor.shape) for name, tensor in tensors.items()})
    with storage.lock(path):
        existing = examine(path, metadata[MetaKey.SPEC_HASH], metadata[MetaKey.CONTENT_ID], storage)
        if existing.state is OnDisk.matches:
            return False
        if existing.state is OnDisk.taken and not replace:
            theirs = existing.header.metadata[MetaKey.SPEC_HASH]  # type: ignore[union-attr]
            raise FileTaken(f"{path} already holds job {metadata[MetaKey.JOB_ID]!r} of other content "
                            f"(spec_hash {theirs[:12]}..., this job's {metadata[MetaKey.SPEC_HASH][:12]}...)")
        if existing.state is OnDisk.damaged:
            log.warning("replacing a damaged file: %s", existing.reason)
        if existing.state is OnDisk.taken:
            log.info("replacing %s: its job asked for other content (replace)", path)
        with storage.write(path) as local:
            save_file(tensors, str(local), metadata=metadata)
    return True
