"""The file lock protocol shared by writer and readers (vLLM's): ``<file>.lock`` beside each file.

A writer holds an exclusive ``flock`` on it while it writes (temp file, fsync, rename); a
reader takes a shared ``flock`` first, which sleeps while a writer holds the lock. The
lock file stays after the write (readers expect it); a file whose lock file was removed
(``cleanup_hidden_states``) is read without locking, since files only ever appear at
their final name complete. ``fcntl.flock`` is used directly because the protocol is
defined by flock semantics (filelock has no shared mode).

A writer waits for the lock at most ``wait_s`` (a reader stopped with SIGSTOP, or hung on a
dead mount, while holding its shared lock would otherwise block it forever), then raises
:class:`LockTimeout`, an ``OSError``: the worker answers ``write_failed``, which is retried.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from layertap.protocol.naming import LOCK_SUFFIX


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


#: Seconds a writer waits for a file's lock before it gives up with :class:`LockTimeout`.
WRITER_LOCK_WAIT_S = 30.0
#: Longest pause between two tries for the lock.
_LOCK_POLL_MAX_S = 0.05


class LockTimeout(TimeoutError):
    """The exclusive lock of a file was held by another process for longer than the writer waits."""


@contextmanager
def exclusive_lock(path: str | Path, wait_s: float = WRITER_LOCK_WAIT_S) -> Iterator[None]:
    """Hold the exclusive flock on ``<path>.lock``, creating the lock file if missing. Waits at most
    ``wait_s`` for readers (or another writer) to let go, then raises :class:`LockTimeout`."""
    fd = os.open(lock_path(path), os.O_CREAT | os.O_RDWR, 0o644)
    try:
        deadline, pause = time.monotonic() + wait_s, 0.001
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise LockTimeout(f"{lock_path(path)} stayed locked by another process for {wait_s:g}s "
                                      "(a reader holding it, stopped or hung?)") from None
                time.sleep(pause)
                pause = min(2 * pause, _LOCK_POLL_MAX_S)
        yield
    finally:
        os.close(fd)
