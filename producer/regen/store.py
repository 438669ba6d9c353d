"""The resumable output: finished conversations in a JSONL file, failures in an errors file.

Invariants: a row is written whole, by one ``write`` of one line, and flushed to the OS before
it counts as done (so a Ctrl-C or a SIGKILL of the command loses no row); the file is fsynced at
most :data:`FSYNC_EVERY_S` after a row and on closing (a power loss costs at most that much
work, redone on the re-run: an fsync per row would stall every conversation in flight); on
opening, a torn last line (a kill during a write) is cut off, so the file holds only whole
rows; a row's ``id`` is in the file at most once (done ids are skipped). The
errors file lists the failures of the latest run only: it is emptied when the store opens,
because a re-run tries those conversations again.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

#: Longest time between fsyncs of the output while rows are written.
FSYNC_EVERY_S = 1.0


def errors_path_for(out: Path) -> Path:
    """``regen.jsonl`` -> ``regen.errors.jsonl``."""
    return out.with_name(out.stem + ".errors" + (out.suffix or ".jsonl"))


def cut_torn_tail(path: Path) -> None:
    """Truncate ``path`` after its last newline (a line without one was torn by a kill)."""
    with open(path, "rb+") as handle:
        size = handle.seek(0, os.SEEK_END)
        if size == 0:
            return
        position = size
        while position > 0:
            step = min(65536, position)
            handle.seek(position - step)
            chunk = handle.read(step)
            newline = chunk.rfind(b"\n")
            if newline >= 0:
                keep = position - step + newline + 1
                break
            position -= step
        else:
            keep = 0
        if keep != size:
            handle.truncate(keep)


class OutputStore:
    """Rows done (``done``: their ids) and appending new ones. Use as a context manager."""

    def __init__(self, out: Path, errors: Path | None = None):
        self.out, self.errors = out, errors or errors_path_for(out)
        self.done: set[str] = set()
        self._out: TextIO | None = None
        self._errors: TextIO | None = None
        self._synced_at = time.monotonic()

    def __enter__(self) -> OutputStore:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        if self.out.exists():
            cut_torn_tail(self.out)
            self.done = {row["id"] for row in self.rows()}
        self._out = open(self.out, "a", encoding="utf-8")
        self._errors = open(self.errors, "w", encoding="utf-8")
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in (self._out, self._errors):
            if handle is not None:
                handle.flush()
                os.fsync(handle.fileno())
                handle.close()

    def rows(self) -> Iterator[dict[str, Any]]:
        """The rows in the output file, in order."""
        with open(self.out, encoding="utf-8") as handle:
            for line in handle:
                if line.strip():
                    yield json.loads(line)

    def write(self, row: dict[str, Any]) -> None:
        """Append one finished row (with an ``id``) durably and count it done."""
        assert self._out is not None, "the store is not open"
        _append(self._out, row)
        self.done.add(row["id"])
        if time.monotonic() - self._synced_at >= FSYNC_EVERY_S:
            os.fsync(self._out.fileno())
            self._synced_at = time.monotonic()

    def write_error(self, row_id: str | None, where: str, reason: str) -> None:
        """Record one failed conversation (or unreadable row)."""
        assert self._errors is not None, "the store is not open"
        _append(self._errors, {"id": row_id, "where": where, "reason": reason})


def _append(handle: TextIO, row: dict[str, Any]) -> None:
    handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    handle.flush()
