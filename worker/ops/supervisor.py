"""``layertap worker --gpus all|0,1,...``: one worker process per GPU (or GPU group), supervised.

Each child is a plain ``layertap worker`` with its own ``CUDA_VISIBLE_DEVICES`` and Celery
node name ``gpu<i>@<host>`` (``gpu<i>-<j>@<host>`` for a group). A child that exits is
restarted after a backoff that grows while it keeps dying quickly; SIGTERM/SIGINT are
passed to every child (warm shutdown: running jobs finish, reserved ones go back to the
queue) and the supervisor exits when they have; a child still running ``kill_after_s``
after its SIGTERM gets SIGKILL (its leases lapse and its jobs go back to the queue). No CUDA is
touched here: children are started with ``subprocess`` (no fork of a CUDA process).

Invariants: a child never supervises in turn (its environment says ``--gpus`` is unset,
whatever ``.env`` or the parent's environment say); on Linux a child gets SIGTERM when
the supervisor dies, even by SIGKILL, so no worker outlives it holding a GPU; with
``metrics_port`` set, child ``i`` serves metrics on ``metrics_port + i``.

A child that dies is explained (:func:`exit_reason`): its last phase (``layertap.worker.ops.phase``:
starting, loading, serving) and, for a SIGKILL, whether the kernel's out-of-memory killer
sent it (the ``oom_kill`` counter of this cgroup's ``memory.events`` rose), e.g. "killed by
the kernel: out of memory while loading". The reason is logged and handed to ``on_exit``
(``layertap worker --gpus`` records it in Redis for ``layertap status``).
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from layertap.command import layertap_argv
from layertap.transport.backoff import Backoff
from layertap.worker.ops.phase import PHASE_FILE_ENV, read_phase

log = logging.getLogger("layertap.supervisor")
RESTART_BACKOFF = Backoff(first_s=1.0, max_s=30.0)  # a child that keeps dying quickly waits longer
HEALTHY_AFTER_S = 60.0
#: Time a child gets after its own shutdown deadline before the supervisor sends SIGKILL.
SIGKILL_GRACE_S = 30.0
PR_SET_PDEATHSIG = 1  # linux/prctl.h
CGROUP_ROOT = Path("/sys/fs/cgroup")


def oom_kill_count() -> int | None:
    """Processes of this process's cgroup (and below) the kernel's OOM killer has killed, from
    ``memory.events`` (cgroup v2) or ``memory.oom_control`` (v1); None where neither is readable."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    candidates = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            candidates.append(CGROUP_ROOT / path.lstrip("/") / "memory.events")
        elif "memory" in controllers.split(","):
            candidates.append(CGROUP_ROOT / "memory" / path.lstrip("/") / "memory.oom_control")
    # in a container the cgroup namespace's root is the process's own cgroup
    candidates += [CGROUP_ROOT / "memory.events", CGROUP_ROOT / "memory" / "memory.oom_control"]
    for candidate in candidates:
        try:
            fields = dict(line.split() for line in candidate.read_text().splitlines() if line.strip())
        except (OSError, ValueError):
            continue
        if "oom_kill" in fields:
            return int(fields["oom_kill"])
    return None


def exit_reason(returncode: int, phase: str, oom_kills: int | None) -> str:
    """Why a child ended, in words. ``oom_kills``: how much the cgroup's OOM-kill counter rose
    while the child ran (None: no counter to read)."""
    if returncode == -signal.SIGKILL:
        if oom_kills:
            return f"killed by the kernel: out of memory while {phase}"
        if oom_kills is None:
            return (f"killed by SIGKILL while {phase} (the kernel's out-of-memory killer sends SIGKILL; "
                    "no cgroup memory.events here to confirm it)")
        return (f"killed by SIGKILL while {phase} (not by the kernel's out-of-memory killer: "
                "its cgroup count did not rise)")
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name} while {phase}"
    return f"exited with code {returncode} while {phase}"


def visible_gpus(spec: str) -> list[str]:
    """``all`` -> every GPU ``nvidia-smi`` lists (or ``CUDA_VISIBLE_DEVICES``); else the given list."""
    if spec != "all":
        ids = [part.strip() for part in spec.split(",") if part.strip()]
        if not ids:
            raise ValueError(f"--gpus {spec!r} names no GPU")
        return ids
    if os.environ.get("CUDA_VISIBLE_DEVICES"):
        return [part for part in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if part]
    if shutil.which("nvidia-smi"):
        out = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True,
                             text=True, check=False)
        ids = [line.strip() for line in out.stdout.splitlines() if line.strip()]
        if ids:
            return ids
    raise ValueError("--gpus all: no GPU found (no nvidia-smi output and CUDA_VISIBLE_DEVICES unset)")


def group(gpus: list[str], per_worker: int) -> list[list[str]]:
    """``gpus`` in consecutive groups of ``per_worker``, one per worker; ``ValueError`` unless they divide evenly."""
    if per_worker < 1 or len(gpus) % per_worker:
        raise ValueError(f"{len(gpus)} GPUs cannot be split into groups of {per_worker}")
    return [gpus[i:i + per_worker] for i in range(0, len(gpus), per_worker)]


def die_with_parent(parent_pid: int) -> None:
    """Run in a child between fork and exec: ask Linux to SIGTERM it when its parent dies."""
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM) != 0:
        return
    if os.getppid() != parent_pid:  # the parent died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


@dataclass
class Child:
    """One supervised worker process: its GPUs, command and environment, and its restart bookkeeping."""

    gpus: list[str]
    argv: list[str]
    env: dict[str, str]
    process: subprocess.Popen | None = None
    started: float = 0.0
    restarts: int = 0
    quick_deaths: int = 0  # deaths in a row, each within HEALTHY_AFTER_S of its start
    next_start: float = 0.0
    node: str = field(default="")
    stop_sent_at: float | None = None  # monotonic time of the SIGTERM passed on
    phase_file: Path | None = None  # where the child records its phase (layertap.worker.ops.phase)
    oom_kills_at_start: int | None = None

    def start(self) -> None:
        parent = os.getpid()
        preexec = (lambda: die_with_parent(parent)) if sys.platform.startswith("linux") else None
        env = self.env
        if self.phase_file is not None:
            self.phase_file.unlink(missing_ok=True)
            env = {**env, PHASE_FILE_ENV: str(self.phase_file)}
        self.oom_kills_at_start = oom_kill_count()
        self.process = subprocess.Popen(self.argv, env=env, preexec_fn=preexec)
        self.started = time.monotonic()
        self.stop_sent_at = None
        log.info("started %s (pid %d) on GPU %s", self.node, self.process.pid, ",".join(self.gpus))

    def why_ended(self, returncode: int) -> str:
        phase = read_phase(self.phase_file) if self.phase_file is not None else "running"
        now, before = oom_kill_count(), self.oom_kills_at_start
        return exit_reason(returncode, phase, None if now is None or before is None else now - before)


class Supervisor:
    """Starts, restarts and stops the children."""

    def __init__(self, worker_args: list[str], gpus: list[str], per_worker: int = 1, host: str | None = None,
                 metrics_port: int = 0, kill_after_s: float = 900.0,
                 on_exit: Callable[[str, dict], None] | None = None):
        host = host or socket.gethostname()
        self.kill_after_s = kill_after_s
        self.on_exit = on_exit  # (node, {"reason", "code", "at"}) for each child that ended
        self._phases = tempfile.TemporaryDirectory(prefix="layertap-phases-")
        self.children = []
        for index, ids in enumerate(group(gpus, per_worker)):
            node = f"gpu{'-'.join(ids)}@{host}"
            argv = layertap_argv("worker", *worker_args, "--node-name", node)
            if metrics_port:
                argv += ["--metrics-port", str(metrics_port + index)]
            # An empty LAYERTAP_WORKER__GPUS (it beats .env and layertap.toml) makes the child a plain worker.
            env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(ids), "LAYERTAP_WORKER__GPUS": ""}
            self.children.append(Child(ids, argv, env, node=node,
                                       phase_file=Path(self._phases.name) / f"{index}.phase"))
        self._stopping = False

    def _on_signal(self, signum: int, _frame: object) -> None:
        if not self._stopping:
            log.info("signal %d: stopping %d workers", signum, len(self.children))
        self._stopping = True  # the loop passes SIGTERM on: a child started meanwhile gets it too

    def _stop_children(self) -> None:
        now = time.monotonic()
        for child in self.children:
            if not (child.process and child.process.poll() is None):
                continue
            if child.stop_sent_at is None:
                child.process.send_signal(signal.SIGTERM)
                child.stop_sent_at = now
            elif now - child.stop_sent_at > self.kill_after_s:
                log.warning("%s still running %.0fs after SIGTERM; sending SIGKILL", child.node, self.kill_after_s)
                child.process.kill()

    def run(self, poll_s: float = 0.5) -> int:
        """Supervise until SIGTERM/SIGINT; returns 0 when every child stopped cleanly."""
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        for child in self.children:
            child.start()
        while True:
            if self._stopping:
                self._stop_children()
            now = time.monotonic()
            alive = 0
            for child in self.children:
                process = child.process
                if process is not None and process.poll() is None:
                    alive += 1
                    continue
                if self._stopping:
                    continue
                if process is not None:  # it died: schedule a restart
                    code = process.returncode
                    child.process = None
                    quick = now - child.started < HEALTHY_AFTER_S
                    child.quick_deaths = child.quick_deaths + 1 if quick else 0
                    delay = RESTART_BACKOFF.delay(child.quick_deaths)
                    child.next_start = now + delay
                    reason = child.why_ended(code)
                    log.warning("%s %s (exit code %s); restarting in %.0fs", child.node, reason, code, delay)
                    if self.on_exit is not None:
                        self.on_exit(child.node, {"reason": reason, "code": code, "at": time.time()})
                if now >= child.next_start:
                    child.restarts += 1
                    child.start()
                    alive += 1
            if self._stopping and alive == 0:
                codes = [child.process.returncode for child in self.children if child.process]
                self._phases.cleanup()
                return 0 if all(code in (0, -signal.SIGTERM) for code in codes) else 1
            time.sleep(poll_s)
