"""The file lock protocol shared by writer and readers (vLLM's): ``<file>.lock`` beside each file.

A writer holds an exclusive ``flock`` on it while it writes (temp file, fsync, rename); a
reader takes a shared ``flock`` first, which sleeps while a writer holds the lock. The
lock file stays after the write (readers expect it); a file whose lock file was removed
(``cleanup_hidden_states``) is read without locking, since files only ever appear at
their final name complete. ``fcntl.flock`` is used directly because the protocol is
defined by flock semantics (filelock has no shared mode).
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from producer.protocol.naming import LOCK_SUFFIX


def lock_path(path: str | Path) -> str:
    """The lock file of the file at ``path``."""
    return f"{path}{LOCK_SUFFIX}"


@contextmanager
def shared_lock(path: str | Path) -> Iterator[None]:
    """Hold a shared flock on ``<path>.lock`` if it exists (blocks while a writer holds it)."""
    try:
        fd = os.open(lock_path(path), os.O_RDONLY)
    except FileNotFoundError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)  # closing releases the lock


@contextmanager
def exclusive_lock(path: str | Path) -> Iterator[None]:
    """Hold the exclusive flock on ``<path>.lock``, creating the lock file if missing."""
    fd = os.open(lock_path(path), os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
