"""Writing one job's file: exclusive lock, temp name, fsync, atomic rename, fsync folder.

Protocol (``producer.protocol.locking``; readers: ``producer.files.reader``):
1. open ``<file>.lock`` (created if missing) and take an exclusive ``flock``;
2. if a complete file with the same ``spec_hash`` is already at the final name (another
   worker won a race, or a redelivered job), keep it and write nothing;
3. else write ``.<name>.<pid>.<random>.tmp`` in the same folder, fsync it, ``rename`` it
   over the final name, fsync the folder;
4. release the lock (the lock file stays, as vLLM's readers expect).

A file at its final name is therefore always complete; a crash leaves at most a temp
file, which :func:`remove_stale_temp_files` deletes on the next start.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
import uuid
from pathlib import Path

import torch
from safetensors.torch import save_file

from producer.protocol.fileformat import (
    FileFormatError,
    MetaKey,
    crc32_hex,
    metadata_of,
)
from producer.protocol.locking import exclusive_lock

TEMP_SUFFIX = ".tmp"
#: Temp files of another host are removed only when older than this (its writer may be alive).
FOREIGN_TEMP_AGE_S = 24 * 3600
_HOST_TAG = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def tensor_checksums(tensors: dict[str, torch.Tensor]) -> str:
    """JSON {name: crc32 of the tensor's raw bytes}, as stored in the header."""
    sums = {name: crc32_hex(tensor.contiguous().view(torch.uint8).numpy()) for name, tensor in tensors.items()}
    return json.dumps(sums, sort_keys=True)


def existing_spec_hash(path: Path) -> str | None:
    """The ``spec_hash`` of a complete file at ``path``, or None if there is none (or it is unreadable)."""
    try:
        return metadata_of(path).get(MetaKey.SPEC_HASH)
    except (FileNotFoundError, FileFormatError, OSError):
        return None


def _fsync_path(path: Path | str, flags: int = os.O_RDONLY) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_job_file(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bool:
    """Write ``tensors`` to ``path`` by the protocol above. Returns False if an equal file was kept."""
    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = {**metadata, MetaKey.CHECKSUMS: tensor_checksums(tensors)}
    tensors = {name: tensor.contiguous() for name, tensor in tensors.items()}
    with exclusive_lock(path):
        if existing_spec_hash(path) == metadata[MetaKey.SPEC_HASH]:
            return False
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
