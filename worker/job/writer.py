"""Writing one job's file: exclusive lock, temp name, fsync, atomic rename, fsync folder.

Protocol (``producer.protocol.locking``; readers: ``producer.files.reader``):
1. open ``<file>.lock`` (created if missing) and take an exclusive ``flock``;
2. :func:`examine` the file at the final name, if any: one that verifies (structure, header
   and tensor checksums) and has the same ``content_id`` (another worker won a race, or a
   redelivered job) is kept and nothing is written; one that verifies but holds another job's
   content under this job id (another ``spec_hash``) is never overwritten (:class:`FileTaken`);
   a damaged one, or one computed with something else (layers, dtype, model weights,
   tokenizer, format version), is replaced;
3. else write ``.<name>.<pid>.<random>.tmp`` in the same folder, fsync it, ``rename`` it
   over the final name, fsync the folder;
4. release the lock (the lock file stays, as vLLM's readers expect).

A file at its final name is therefore always complete; a crash leaves at most a temp
file, which :func:`remove_stale_temp_files` deletes on the next start.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import torch
from safetensors.torch import save_file

from producer.protocol.fileformat import (
    FileFormatError,
    FileHeader,
    MetaKey,
    crc32_hex,
    header_checksum,
    verify_file,
)
from producer.protocol.locking import exclusive_lock

log = logging.getLogger(__name__)

TEMP_SUFFIX = ".tmp"
#: Temp files of another host are removed only when older than this (its writer may be alive).
FOREIGN_TEMP_AGE_S = 24 * 3600
_HOST_TAG = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def tensor_checksums(tensors: dict[str, torch.Tensor]) -> str:
    """JSON {name: crc32 of the tensor's raw bytes}, as stored in the header."""
    sums = {name: crc32_hex(tensor.contiguous().view(torch.uint8).numpy()) for name, tensor in tensors.items()}
    return json.dumps(sums, sort_keys=True)


class OnDisk(str, Enum):
    """What is at a job's final name, against what the job would write there."""

    missing = "missing"  # no file: write it
    damaged = "damaged"  # a file that fails verification (header, truncation, checksums): replace it
    stale = "stale"  # a valid file of this job computed with something else (another content_id): replace it
    taken = "taken"  # a valid file of other job content (another spec_hash) under this job id: never touch it
    matches = "matches"  # the file this job would write: keep it, answer from it


@dataclass(frozen=True)
class Existing:
    """:func:`examine`'s verdict; ``header`` is set when the file verified, ``reason`` when it did not."""

    state: OnDisk
    header: FileHeader | None = None
    reason: str = ""


class FileTaken(Exception):
    """The job's final name holds a valid file of another job content (same run and job id)."""


def examine(path: Path, spec_hash: str, content_id: str) -> Existing:
    """Verify the file at ``path`` (checksums included) and compare it with what a job of this
    ``spec_hash`` and ``content_id`` would write there."""
    try:
        header = verify_file(path)
    except FileNotFoundError:
        return Existing(OnDisk.missing)
    except (FileFormatError, OSError) as exc:
        return Existing(OnDisk.damaged, reason=str(exc))
    if header.metadata[MetaKey.SPEC_HASH] != spec_hash:
        return Existing(OnDisk.taken, header)
    if header.metadata.get(MetaKey.CONTENT_ID) != content_id:
        return Existing(OnDisk.stale, header)
    return Existing(OnDisk.matches, header)


def _fsync_path(path: Path | str, flags: int = os.O_RDONLY) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_job_file(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bool:
    """Write ``tensors`` to ``path`` by the protocol above (``metadata`` has the job's ``spec_hash``
    and ``content_id``). Returns False if an equal file was kept; raises :class:`FileTaken`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = {**metadata, MetaKey.CHECKSUMS: tensor_checksums(tensors)}
    metadata[MetaKey.HEADER_CHECKSUM] = header_checksum(metadata, {name: list(t.shape) for name, t in tensors.items()})
    tensors = {name: tensor.contiguous() for name, tensor in tensors.items()}
    with exclusive_lock(path):
        existing = examine(path, metadata[MetaKey.SPEC_HASH], metadata[MetaKey.CONTENT_ID])
        if existing.state is OnDisk.matches:
            return False
        if existing.state is OnDisk.taken:
            theirs = existing.header.metadata[MetaKey.SPEC_HASH]  # type: ignore[union-attr]
            raise FileTaken(f"{path} already holds job {metadata[MetaKey.JOB_ID]!r} of other content "
                            f"(spec_hash {theirs[:12]}..., this job's {metadata[MetaKey.SPEC_HASH][:12]}...)")
        if existing.state is OnDisk.damaged:
            log.warning("replacing a damaged file: %s", existing.reason)
        temp = path.with_name(f".{path.name}.{_HOST_TAG}-{os.getpid()}.{uuid.uuid4().hex[:8]}{TEMP_SUFFIX}")
        try:
            save_file(tensors, str(temp), metadata=metadata)
            _fsync_path(temp)
            os.replace(temp, path)
        except BaseException:
            temp.unlink(missing_ok=True)
            raise
        _fsync_path(path.parent)
    return True


def remove_stale_temp_files(root: Path) -> int:
    """Delete temp files whose writer is dead. Call at worker start, before writing. Returns how many.

    A temp file of this host is stale when its writer's pid is gone; one of another host
    (a shared mount) only when older than :data:`FOREIGN_TEMP_AGE_S`.
    """
    removed = 0
    if not root.exists():
        return 0
    for temp in root.glob(f"*/*/.*{TEMP_SUFFIX}"):
        owner = temp.name.rsplit(".", 3)[-3] if temp.name.count(".") >= 3 else ""
        host_tag, _, pid = owner.partition("-")
        if host_tag == _HOST_TAG and pid.isdigit():
            stale = int(pid) == os.getpid() or not _process_alive(int(pid))  # at start we write nothing yet
        else:
            try:
                stale = time.time() - temp.stat().st_mtime > FOREIGN_TEMP_AGE_S
            except FileNotFoundError:
                continue
        if stale:
            temp.unlink(missing_ok=True)
            removed += 1
    return removed


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
