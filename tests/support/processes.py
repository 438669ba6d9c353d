"""Real ``layertap`` processes for the tests: the CLI command line and a worker subprocess."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from layertap.command import layertap_argv
from layertap.producer.client.client import Client
from layertap.settings import Settings


def cli(*args: str) -> list[str]:
    return layertap_argv(*args)


@dataclass
class WorkerProcess:
    """A ``layertap worker`` subprocess serving one model."""

    model_dir: Path
    name: str
    redis_url: str
    storage_root: Path
    node: str
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    log_path: Path | None = None
    client_settings: Settings | None = None  # how the test reaches Redis (default: redis_url alone)
    process: subprocess.Popen | None = None

    def start(self, wait: bool = True, timeout: float = 120.0) -> WorkerProcess:
        env = {**os.environ, "LAYERTAP_REDIS_URL": self.redis_url, "LAYERTAP_STORAGE_ROOT": str(self.storage_root),
               **self.env}
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self.process = subprocess.Popen(
            cli("worker", "--model", str(self.model_dir), "--name", self.name, "--device", "cpu",
                "--node-name", self.node, *self.extra_args),
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        if wait:
            self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 120.0) -> None:
        with Client(self.client_settings or Settings(redis_url=self.redis_url)) as client:
            deadline = time.monotonic() + timeout
            while self.node not in client.workers():
                assert self.process is not None
                if self.process.poll() is not None:
                    raise RuntimeError(f"worker {self.node} exited with {self.process.returncode}; log: "
                                       f"{self.log_text()[-3000:]}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"worker {self.node} not ready; log: {self.log_text()[-3000:]}")
                time.sleep(0.1)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path and self.log_path.exists() else ""

    def kill(self) -> None:
        """SIGKILL the worker (a crash)."""
        if self.process and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM (warm shutdown) and wait."""
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.process.returncode if self.process else None


def run_through_full_redis(argv: list[str], env: dict[str, str], redis_client: Any, deadline_s: float = 300.0,
                           ) -> subprocess.CompletedProcess:
    """Run ``argv`` while Redis is at ``maxmemory``, lifting the limit only once the command has
    said it meets a refusal ("Redis refuses writes") and is still running (waiting, not failed).
    Order, not a fixed window: on a busy machine the command may take long to start."""
    redis_client.config_set("maxmemory", 1)
    process = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []

    def read_stderr() -> None:
        for line in process.stderr:  # type: ignore[union-attr]
            lines.append(line)

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + deadline_s
        while not any("Redis refuses writes" in line for line in lines):
            assert process.poll() is None, "".join(lines)[-2000:]  # waiting, not failed
            assert time.monotonic() < deadline, "".join(lines)[-2000:]
            time.sleep(0.2)
        assert process.poll() is None, "".join(lines)[-2000:]
    finally:
        redis_client.config_set("maxmemory", 0)
    stdout = process.stdout.read()  # type: ignore[union-attr]
    process.wait(timeout=deadline_s)
    reader.join(timeout=30)
    return subprocess.CompletedProcess(argv, process.returncode, stdout, "".join(lines))
