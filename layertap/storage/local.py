"""Job files in a local (or mounted) folder: the storage a bare path names.

Writing (:meth:`LocalStorage.lock` + :meth:`LocalStorage.write`), as vLLM's readers expect:

1. open ``<file>.lock`` (created if missing) and take an exclusive ``flock`` (``locking``);
2. the writer checks what is at the final name (``layertap.storage.examine``);
3. write ``.<name>.<host>-<pid>.<random>.tmp`` in the same folder, fsync it, ``rename`` it over
   the final name, fsync the folder;
4. release the lock (the lock file stays).

A file at its final name is therefore always complete; a crash leaves at most a temp file,
which :meth:`LocalStorage.sweep_stale` deletes on the next start. Readers take the shared
lock first (:meth:`LocalStorage.open`, :meth:`LocalStorage.local`), which waits out a writer.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shutil
import socket
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

from layertap.protocol.naming import FILE_SUFFIX, file_under_root, storage_root_of
from layertap.storage.base import Storage
from layertap.storage.locking import exclusive_lock, lock_path, shared_lock

TEMP_SUFFIX = ".tmp"
#: Temp files of another host are removed only when older than this (its writer may be alive).
FOREIGN_TEMP_AGE_S = 24 * 3600
HOST_TAG = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]
#: Errors of ``os.link`` after which a copy is made instead (another filesystem, no links there).
LINK_FALLBACK_ERRORS = {errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP}


def temp_name(path: Path) -> Path:
    """A writer's temp file beside ``path``: its host and pid in the name (:func:`sweep_temp_files`)."""
    return path.with_name(f".{path.name}.{HOST_TAG}-{os.getpid()}.{uuid.uuid4().hex[:8]}{TEMP_SUFFIX}")


def is_stale_temp(name: str, mtime: Callable[[], float]) -> bool:
    """Whether the writer of the temp file ``name`` (:func:`temp_name`) is dead: one of this host
    when its pid is gone, one of another host (a shared mount) only when older (``mtime()``) than
    :data:`FOREIGN_TEMP_AGE_S`. Raises what ``mtime`` raises (``FileNotFoundError``: gone)."""
    owner = name.rsplit(".", 3)[-3] if name.count(".") >= 3 else ""
    host_tag, _, pid = owner.partition("-")
    if host_tag == HOST_TAG and pid.isdigit():
        return int(pid) == os.getpid() or not _process_alive(int(pid))  # at start we write nothing yet
    return time.time() - mtime() > FOREIGN_TEMP_AGE_S


def sweep_temp_files(temps: Iterable[Path]) -> int:
    """Delete the temp files whose writer is dead (:func:`is_stale_temp`); returns how many."""
    removed = 0
    for temp in temps:
        try:
            stale = is_stale_temp(temp.name, lambda temp=temp: temp.stat().st_mtime)
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


def add_lock_file(path: Path) -> None:
    """Create the (unlocked) lock file of a local file that is complete before anyone reads it (an
    export's ``hs_{i}``): vLLM's ``load_hidden_states`` opens ``<file>.lock`` first and fails without one."""
    os.close(os.open(lock_path(path), os.O_CREAT | os.O_WRONLY, 0o644))


def _fsync_path(path: Path | str, flags: int = os.O_RDONLY) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalStorage(Storage):
    """Files under a local folder (made absolute: published paths are absolute)."""

    def __init__(self, root: str | Path, options: dict | None = None):
        super().__init__(Path(str(root).removeprefix("file://")).expanduser().resolve(), options)

    def owned(self, address: str, run: str, job_id: str) -> str | None:
        """The real path of ``address`` if, every symlink resolved, it is exactly the file of
        ``run``/``job_id`` under the root (``naming.file_under_root``)."""
        found = file_under_root(address, self.root, run, job_id)
        return None if found is None else str(found)

    @contextlib.contextmanager
    def lock(self, address: str) -> Iterator[None]:
        Path(address).parent.mkdir(parents=True, exist_ok=True)
        with exclusive_lock(address):
            yield

    @contextlib.contextmanager
    def write(self, address: str) -> Iterator[Path]:
        path = Path(address)
        path.parent.mkdir(parents=True, exist_ok=True)
        temp = temp_name(path)
        try:
            yield temp
            _fsync_path(temp)
            os.replace(temp, path)
        except BaseException:
            temp.unlink(missing_ok=True)
            raise
        _fsync_path(path.parent)

    @contextlib.contextmanager
    def open(self, address: str, *, shared: bool = True) -> Iterator[BinaryIO]:
        with shared_lock(address) if shared else contextlib.nullcontext(), open(address, "rb") as handle:
            yield handle

    @contextlib.contextmanager
    def local(self, address: str) -> Iterator[Path]:
        with shared_lock(address):
            yield Path(address)

    def size(self, address: str) -> int:
        return os.stat(address).st_size

    def exists(self, address: str) -> bool:
        return os.path.exists(address)

    def copy_to(self, address: str, target: Path) -> bool:
        """A hard link (no bytes copied on one filesystem), else a copy."""
        try:
            os.link(address, target)
            return True
        except OSError as exc:
            if exc.errno not in LINK_FALLBACK_ERRORS:
                raise
        shutil.copyfile(address, target)
        return False

    def remove(self, address: str, *, keep_data: bool = False) -> None:
        for target in ([lock_path(address)] if keep_data else [lock_path(address), address]):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(target)

    def prune(self, addresses: Iterable[str], run: str) -> int:
        """Only folders of the file layout (``<root>/<run>/<fan-out>``) are touched, never the root."""
        fanouts = set()
        for path in map(Path, addresses):
            if storage_root_of(path, run, path.name.removesuffix(FILE_SUFFIX)) is not None:
                fanouts.add(path.parent)
        removed = 0
        for folder in [*sorted(fanouts), *sorted({fanout.parent for fanout in fanouts})]:
            with contextlib.suppress(OSError):  # not empty (another file, a temp file), or gone
                folder.rmdir()
                removed += 1
        return removed

    def sweep_stale(self) -> int:
        root = Path(self.root)
        return sweep_temp_files(root.glob(f"*/*/.*{TEMP_SUFFIX}")) if root.exists() else 0
