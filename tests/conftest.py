"""Shared fixtures: a real Redis server, real tiny HF models, real worker processes.

Nothing here is faked: Redis is a ``redis-server`` process on a free port (killable and
restartable), models are built with ``make-tiny-model`` and loaded back with
``from_pretrained``, and workers are ``layertap worker`` processes with a Celery pool.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from producer.client import Client
from producer.redis_server import RedisServer
from producer.settings import Settings

ARCHES = ("qwen3", "llama", "gpt2")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with RedisServer(data_dir=tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny float32 models of three architectures (4 layers, hidden 64), built on the fly."""
    from worker.tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("models")
    return {arch: make_tiny_model(root / arch, arch) for arch in ARCHES}


@pytest.fixture(scope="session")
def storage_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("files")


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "producer.cli", *args]


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


@pytest.fixture(scope="session")
def workers(redis_server: RedisServer, tiny_models: dict[str, Path], storage_root: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, WorkerProcess]]:
    """One worker per tiny architecture, serving ``tiny-<arch>``, for the whole session."""
    logs = tmp_path_factory.mktemp("logs")
    started = {
        arch: WorkerProcess(tiny_models[arch], f"tiny-{arch}", redis_server.url, storage_root,
                            node=f"test-{arch}@localhost", log_path=logs / f"{arch}.log").start(wait=False)
        for arch in ARCHES
    }
    try:
        for process in started.values():
            process.wait_ready()
        yield started
    finally:
        for process in started.values():
            process.stop()


@pytest.fixture
def client(redis_server: RedisServer) -> Iterator[Client]:
    with Client(Settings(redis_url=redis_server.url)) as value:
        yield value


@pytest.fixture
def run_name(request: pytest.FixtureRequest) -> str:
    """A run name unique to the test (results streams don't mix)."""
    safe = "".join(ch if ch.isalnum() else "-" for ch in request.node.name)[:80].strip("-")
    return f"{safe}-{os.getpid()}-{time.monotonic_ns() % 10**9}"
