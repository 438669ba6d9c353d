"""The ``layertap`` command as a child process: the one argv builder for everything that starts
one (the supervisor's workers, the bench's queue part, the demo, tests and benchmarks). It runs
``python -m layertap`` with this interpreter, so a child uses the same environment as its parent
whether or not the ``layertap`` script is on ``PATH``."""

from __future__ import annotations

import sys


def layertap_argv(*args: str) -> list[str]:
    """``[python, -m, layertap, *args]``: ``layertap *args`` in this interpreter."""
    return [sys.executable, "-m", "layertap", *args]
