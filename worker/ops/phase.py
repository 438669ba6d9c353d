"""A supervised worker's phase (``starting``, ``loading``, ``serving``), kept in a file its
supervisor names in ``LAYERTAP_WORKER_PHASE_FILE``, so that when the kernel kills the worker
(SIGKILL leaves it no last word) the supervisor can say what it was doing. Unsupervised
workers have no such file and write nothing."""

from __future__ import annotations

import os
from pathlib import Path

PHASE_FILE_ENV = "LAYERTAP_WORKER_PHASE_FILE"
STARTING, LOADING, SERVING = "starting", "loading", "serving"


def report_phase(phase: str) -> None:
    """Record ``phase`` (atomically: a reader sees the old phase or the new one)."""
    path = os.environ.get(PHASE_FILE_ENV)
    if not path:
        return
    temp = Path(f"{path}.tmp")
    temp.write_text(phase)
    os.replace(temp, path)


def read_phase(path: Path) -> str:
    """The last phase recorded in ``path``; ``starting`` before the worker wrote one."""
    try:
        return path.read_text().strip() or STARTING
    except FileNotFoundError:
        return STARTING
