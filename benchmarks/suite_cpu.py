"""Where the test suite's CPU goes: every Python process it starts, grouped by what it runs.

    python benchmarks/suite_cpu.py [pytest arguments]      # default: -n 4 --dist loadgroup, as make test

Runs pytest with ``benchmarks/suite_cpu_site`` on ``PYTHONPATH``: its ``sitecustomize`` makes each Python
process (pytest and its xdist processes, workers, CLI commands, examples) write its own CPU seconds at
exit. Prints the suite's CPU (``getrusage`` of all children reaped), the recorded share, and the
largest groups (``layertap <command>``; ``pytest`` and ``python -c``, which holds pytest-xdist's test
processes and the tests' own ``python -c`` scripts; other scripts by name)
with the tests that spent most. Processes killed by a signal (most workers a test stops with SIGKILL)
and non-Python ones (redis-server, pip's builds) are in the total but not in the groups.
"""

from __future__ import annotations

import collections
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DEFAULT_ARGS = ["-n", "4", "--dist", "loadgroup"]


def group(argv: list[str]) -> str:
    """What a process ran: ``layertap <command>``, ``pytest``, ``python -c`` (pytest-xdist's test
    processes among them) or its script's name. Only ``argv[0]`` decides: the others name test paths."""
    if not argv:
        return "?"
    if argv[0].endswith("layertap/__main__.py"):
        return f"layertap {argv[1] if len(argv) > 1 else ''}".strip()
    if argv[0] == "-c":
        return "python -c"
    return "pytest" if "pytest" in Path(argv[0]).parts else Path(argv[0]).name


def main() -> int:
    args = sys.argv[1:] or DEFAULT_ARGS
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "processes.jsonl"
        path = [str(HERE / "suite_cpu_site"), *filter(None, [os.environ.get("PYTHONPATH")])]
        env = {**os.environ, "SUITE_CPU_OUT": str(out), "PYTHONPATH": os.pathsep.join(path)}
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "pytest", *args], cwd=REPO, env=env)
        wall = time.monotonic() - started
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        records = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    total = usage.ru_utime + usage.ru_stime
    recorded = sum(record["cpu_s"] for record in records)
    print(f"pytest exit {done.returncode}; {wall:.0f} s wall, {total:.0f} CPU s in all, "
          f"{recorded:.0f} recorded by {len(records)} Python processes")
    groups: dict[str, list[dict]] = collections.defaultdict(list)
    for record in records:
        groups[group(record["argv"])].append(record)
    print(f"{'group':<28} {'processes':>9} {'CPU s':>8} {'per process':>11}")
    for name, members in sorted(groups.items(), key=lambda item: -sum(r["cpu_s"] for r in item[1]))[:20]:
        cpu = sum(r["cpu_s"] for r in members)
        print(f"{name:<28} {len(members):>9} {cpu:>8.0f} {cpu / len(members):>11.1f}")
    by_test = collections.Counter()
    for record in records:
        if record["test"]:
            by_test[record["test"].rsplit(" ", 1)[0]] += record["cpu_s"]
    print("\ntests whose processes spent most (their own test process not counted):")
    for test, cpu in by_test.most_common(15):
        print(f"{cpu:8.1f}  {test}")
    return done.returncode


if __name__ == "__main__":
    raise SystemExit(main())
