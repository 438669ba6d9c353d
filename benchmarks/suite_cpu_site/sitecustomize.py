"""Loaded by every Python process started with ``benchmarks/suite_cpu_site`` on ``PYTHONPATH`` (see
``benchmarks/suite_cpu.py``): at exit, appends one JSON line to ``$SUITE_CPU_OUT`` with the process's
CPU seconds (user + system), wall seconds, argv and the test that started it (``PYTEST_CURRENT_TEST``,
which child processes inherit). A process killed by a signal writes nothing."""

import atexit
import json
import os
import resource
import sys
import time

_STARTED = time.time()


def _record() -> None:
    out = os.environ.get("SUITE_CPU_OUT")
    if not out:
        return
    usage = resource.getrusage(resource.RUSAGE_SELF)
    line = {"argv": sys.argv[:4], "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
            "wall_s": round(time.time() - _STARTED, 2), "test": os.environ.get("PYTEST_CURRENT_TEST", "")}
    with open(out, "a") as handle:
        handle.write(json.dumps(line) + "\n")


atexit.register(_record)
