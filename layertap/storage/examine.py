"""What is at a job's final name against what the job would write there (step 2 of the file-level
protocol in ``layertap.worker.job.writer``), and the same for many files of one local folder in a
helper process (``python -m layertap.storage.examine``: a JSON request per line on stdin, the JSON
verdicts per line on stdout; :func:`examine_local_json`). Torch-free: a helper starts in a fraction
of a second."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TextIO

from layertap.protocol.fileformat import FileFormatError, FileHeader, MetaKey
from layertap.storage.base import Storage
from layertap.storage.local import LocalStorage
from layertap.storage.registry import storage_at


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


def examine_local_json(request: str) -> str:
    """:func:`examine` of each file of a local folder, for a helper process: ``request`` is the JSON
    of ``{"root": folder, "files": [[path, spec_hash, content_id], ...]}``; returns the JSON list of
    the verdicts in order (:func:`verdict_from_json` reads one), a fault of one file's check being
    its own verdict (``{"error": ...}``), never the others'."""
    asked = json.loads(request)
    storage = LocalStorage(asked["root"])
    verdicts = []
    for path, spec_hash, content_id in asked["files"]:
        try:
            verdicts.append(_to_json(examine(path, spec_hash, content_id, storage)))
        except Exception as exc:  # a fault of this file's check alone: its job's error
            verdicts.append({"error": f"{type(exc).__name__}: {exc}"})
    return json.dumps(verdicts)


class ExamineFault(RuntimeError):
    """A file's check failed in a helper process with an unexpected error (its text)."""


def verdict_from_json(verdict: dict) -> Existing:
    """One verdict of :func:`examine_local_json` as an :class:`Existing`; raises :class:`ExamineFault`
    for a check that failed there."""
    if "error" in verdict:
        raise ExamineFault(verdict["error"])
    header = verdict["header"]
    return Existing(OnDisk(verdict["state"]), None if header is None else FileHeader(
        Path(header["path"]), header["tensors"], header["metadata"], header["data_start"]), verdict["reason"])


def _to_json(existing: Existing) -> dict:
    header = existing.header
    return {"state": existing.state.value, "reason": existing.reason,
            "header": None if header is None else {"path": str(header.path), "tensors": header.tensors,
                                                   "metadata": header.metadata, "data_start": header.data_start}}


def serve(requests: TextIO, answers: TextIO) -> None:
    """A helper process's loop: :func:`examine_local_json` of each line of ``requests``, its answer a
    line of ``answers``, until ``requests`` ends."""
    for line in requests:
        answers.write(examine_local_json(line) + "\n")
        answers.flush()


if __name__ == "__main__":
    serve(sys.stdin, sys.stdout)
