"""The storage interface: where job files live, in files (never tensors), torch-free.

A :class:`Storage` has a root (a local folder, or a URL such as ``s3://bucket/prefix``) and
addresses each job's file there (:meth:`Storage.locate`: ``<root>/<run>/<fan-out>/<job_id>.safetensors``).
Its invariant, on every backend: a file at its address is always complete. Writers get a
local path to write to and the file appears at its address whole or not at all
(:meth:`Storage.write`); readers never see a partial file. What the backends differ in:

* ``local``: an exclusive ``flock`` on ``<file>.lock`` while a writer checks and writes, temp
  file, fsync, rename (vLLM's reader protocol, ``layertap.storage.locking``);
* object stores: spooled to local disk, uploaded to the final key on commit; the only lock is
  the object appearing whole (a ``PUT`` or a completed multipart upload), so two writers of
  one job race harmlessly (equal content) and the last complete upload stays.

Adding a backend is one module with a subclass and one line in ``layertap.storage.registry``.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, BinaryIO

from layertap.protocol.fileformat import FileHeader, parse_header, verify_stream
from layertap.protocol.naming import is_safe_name, job_location


class Storage(ABC):
    """Job files under one root. Addresses are strings: local paths or URLs of this backend."""

    def __init__(self, root: str | Path, options: dict[str, Any] | None = None):
        self.root = str(root)
        self.options = dict(options or {})

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.root!r})"

    def holds(self, address: str) -> bool:
        """Whether ``address`` lies under this storage's root."""
        return address.startswith(self.root.rstrip("/") + "/")

    def locate(self, run: str, job_id: str) -> str:
        """Where ``run``/``job_id``'s file is (names checked by ``naming.check_name``)."""
        return job_location(self.root, run, job_id)

    def owned(self, address: str, run: str, job_id: str) -> str | None:
        """``address`` as this storage acts on it if it is exactly the file of ``run``/``job_id``
        under the root, else None (a forged result path never leads elsewhere)."""
        if not (is_safe_name(run) and is_safe_name(job_id)):
            return None
        return address if address == self.locate(run, job_id) else None

    # Writing -----------------------------------------------------------------------------

    @abstractmethod
    def lock(self, address: str) -> AbstractContextManager[None]:
        """Held by a writer while it checks what is at ``address`` and writes it."""

    @abstractmethod
    def write(self, address: str) -> AbstractContextManager[Path]:
        """A local path to write the whole file to; on a clean exit it appears at ``address``
        complete, on an exception nothing appears (and the local file is removed)."""

    # Reading -----------------------------------------------------------------------------

    @abstractmethod
    def open(self, address: str, *, shared: bool = True) -> AbstractContextManager[BinaryIO]:
        """A seekable binary reader of the file; ``shared``: wait out a writer first (local)."""

    @abstractmethod
    def local(self, address: str) -> AbstractContextManager[Path]:
        """A local path holding the file's bytes for as long as the context lasts (the file
        itself under its shared lock, or a downloaded copy)."""

    @abstractmethod
    def size(self, address: str) -> int:
        """The file's size in bytes (``FileNotFoundError`` if there is none)."""

    @abstractmethod
    def exists(self, address: str) -> bool:
        """Whether a file is at ``address``."""

    def read_header(self, address: str) -> FileHeader:
        """The file's header (``fileformat.parse_header``), read without its tensors (its ``array``
        reads a local path: for an object, take :meth:`local` first)."""
        with self.open(address) as handle:
            return parse_header(handle, address)

    def verify(self, address: str, *, checksums: bool = True, shared: bool = True) -> FileHeader:
        """``fileformat.verify_file`` on the stored file; ``shared=False`` for a writer holding :meth:`lock`."""
        with self.open(address, shared=shared) as handle:
            return verify_stream(handle, address, self.size(address), checksums=checksums)

    def copy_to(self, address: str, target: Path) -> bool:
        """Put the file at local ``target`` (a hard link where the backend can: True), else a copy."""
        with self.local(address) as path, open(path, "rb") as source, open(target, "wb") as out:
            while chunk := source.read(16 << 20):
                out.write(chunk)
        return False

    # Removing ----------------------------------------------------------------------------

    @abstractmethod
    def remove(self, address: str, *, keep_data: bool = False) -> None:
        """Remove the file (and what the backend keeps beside it); nothing if it is gone. With
        ``keep_data`` only what is beside it (the local lock file), as vLLM's cleanup helper."""

    def prune(self, addresses: Iterable[str], run: str) -> int:
        """Remove the folders of ``run``'s removed files that are left empty; how many went
        (object stores have no folders: none)."""
        return 0

    @abstractmethod
    def sweep_stale(self) -> int:
        """Remove what dead writers left (temp or spool files); call at worker start. How many."""


@contextlib.contextmanager
def removing(path: Path) -> Iterator[Path]:
    """``path``, removed when the context ends however it ends."""
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)
