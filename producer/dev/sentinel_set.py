"""A Redis Sentinel set on 127.0.0.1 for the tests and benchmarks: one primary, its replicas and
its sentinels, each a real ``redis-server`` process (sentinels run as ``redis-server <conf>
--sentinel``), so a test can SIGKILL the primary and watch the sentinels promote a replica.

Invariants: :attr:`SentinelSet.url` is the ``sentinel://`` URL layertap takes
(``layertap.transport.redis_url``), naming every sentinel; with a password, the servers
and the sentinels ask for it (``password``, ``sentinel_password``); with ``tls`` (a CA, a
certificate and its key) every server and sentinel also listens with TLS, replicates and
monitors over it, and the URL names the TLS ports (plain ports stay open for the set's own
checks); :meth:`SentinelSet.link_replicas` puts a link (a proxy) between the replicas and the primary.
"""

from __future__ import annotations

import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import quote

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from layertap.producer.dev.redis_server import RedisServer, RedisServerError, find_redis_server, free_port

MASTER_NAME = "layertap"


class SentinelSet:
    """A primary, ``replicas`` replicas and ``sentinels`` sentinels (quorum: a majority). Use as a
    context manager. ``down_after_ms``: how long the primary must be silent before a failover."""

    def __init__(self, folder: str | Path | None = None, *, replicas: int = 1, sentinels: int = 3,
                 password: str | None = None, sentinel_password: str | None = None,
                 tls: dict[str, str] | None = None, down_after_ms: int = 1000):
        self._tmp = None if folder else tempfile.TemporaryDirectory(prefix="layertap-sentinel-")
        self.folder = Path(folder or self._tmp.name)  # type: ignore[union-attr]
        self.password, self.sentinel_password, self.tls = password, sentinel_password, tls
        self.down_after_ms = down_after_ms
        self.servers = [RedisServer(data_dir=self.folder / f"redis{i}", extra_args=self._server_args())
                        for i in range(1 + replicas)]
        self.replica_link: int | None = None  # the port the replicas reach the primary on, if not its own
        #: plain port -> the port the set's members and clients reach that server on (its TLS port)
        self.addresses = {server.port: free_port() for server in self.servers} if tls else {}
        for server in self.servers:
            server.extra_args += self._tls_args(self.addresses.get(server.port))
        self.sentinel_ports = [free_port() for _ in range(sentinels)]
        self.sentinel_tls_ports = [free_port() for _ in range(sentinels)] if tls else []
        self.sentinel_processes: list[subprocess.Popen[bytes]] = []

    @property
    def url(self) -> str:
        """``sentinel://`` URL of every sentinel, with the primary's name and the passwords."""
        ports = self.sentinel_tls_ports or self.sentinel_ports
        login = f":{quote(self.password, safe='')}@" if self.password else ""
        params = [f"master_name={MASTER_NAME}"]
        if self.sentinel_password:
            params.append(f"sentinel_password={quote(self.sentinel_password, safe='')}")
        if self.tls:
            params.append("ssl=true")
        addresses = ";".join(f"sentinel://{login}127.0.0.1:{port}" for port in ports)
        return f"{addresses}/0?{'&'.join(params)}"

    def _server_args(self) -> list[str]:
        args = ["--repl-diskless-sync-delay", "0"]  # a replica syncs at once, not after Redis's 5 s wait
        if self.password:
            args += ["--requirepass", self.password, "--masterauth", self.password]
        return args

    def _tls_args(self, tls_port: int | None) -> list[str]:
        if not self.tls or tls_port is None:
            return []
        return ["--tls-port", str(tls_port), "--tls-cert-file", self.tls["cert"], "--tls-key-file", self.tls["key"],
                "--tls-ca-cert-file", self.tls["ca"], "--tls-auth-clients", "no", "--tls-replication", "yes"]

    def client(self, port: int) -> redis.Redis:
        """A plain client of the server on ``port`` (the set's own checks)."""
        return redis.Redis(port=port, password=self.password, socket_timeout=5, decode_responses=True)

    def sentinel_client(self, index: int) -> redis.Redis:
        return redis.Redis(port=self.sentinel_ports[index], password=self.sentinel_password, socket_timeout=5,
                           decode_responses=True)

    def start(self, timeout: float = 60.0) -> SentinelSet:
        """Start the servers, wait until every replica is in sync, then start the sentinels and wait
        until each knows every replica and every other sentinel."""
        primary, *replicas = self.servers
        primary.start()
        for replica in replicas:
            replica.extra_args += ["--replicaof", "127.0.0.1",
                                   str(self.replica_link or self.announced_port(primary.port))]
            replica.start()
        self._wait(lambda: all(self.client(replica.port).info("replication").get("master_link_status") == "up"
                               for replica in replicas), timeout, "the replicas to sync")
        for index, port in enumerate(self.sentinel_ports):
            self.sentinel_processes.append(self._start_sentinel(index, port, primary.port))
        self._wait(lambda: self._sentinels_know_the_set(primary.port), timeout, "the sentinels to know the set")
        return self

    def announced_port(self, port: int) -> int:
        """The port the set's members and clients reach a server on (its TLS port with TLS)."""
        return self.addresses.get(port, port)

    def link_replicas(self, via: int) -> None:
        """Before :meth:`start`: the replicas reach the primary through ``via`` (a proxy in front of
        it, such as one that delays and can cut the link); the sentinels and clients reach it directly."""
        assert not self.tls and not self.sentinel_processes
        self.replica_link = via

    def _start_sentinel(self, index: int, port: int, primary_port: int) -> subprocess.Popen[bytes]:
        folder = self.folder / f"sentinel{index}"
        folder.mkdir(parents=True, exist_ok=True)
        lines = [f"port {port}", "bind 127.0.0.1", f"dir {folder}", f"logfile {folder / 'sentinel.log'}",
                 f"sentinel monitor {MASTER_NAME} 127.0.0.1 {self.announced_port(primary_port)} "
                 f"{len(self.sentinel_ports) // 2 + 1}",
                 f"sentinel down-after-milliseconds {MASTER_NAME} {self.down_after_ms}",
                 f"sentinel failover-timeout {MASTER_NAME} {max(10000, 10 * self.down_after_ms)}"]
        if self.password:
            lines.append(f"sentinel auth-pass {MASTER_NAME} {self.password}")
        if self.sentinel_password:
            lines.append(f"requirepass {self.sentinel_password}")
        if self.tls:
            lines += [f"tls-port {self.sentinel_tls_ports[index]}", f"tls-cert-file {self.tls['cert']}",
                      f"tls-key-file {self.tls['key']}", f"tls-ca-cert-file {self.tls['ca']}",
                      "tls-auth-clients no", "tls-replication yes"]
        conf = folder / "sentinel.conf"  # rewritten by the sentinel as it learns the set
        conf.write_text("\n".join(lines) + "\n")
        return subprocess.Popen([find_redis_server(), str(conf), "--sentinel"], stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)

    def _sentinels_know_the_set(self, primary_port: int) -> bool:
        """Every sentinel knows every replica and every other sentinel. A sentinel that exited (its
        port, free when picked, was bound by another process before it started) starts again on fresh
        ports; the others learn them from its hello messages."""
        for index, process in enumerate(self.sentinel_processes):
            if process.poll() is not None:
                self.sentinel_ports[index] = free_port()
                if self.tls:
                    self.sentinel_tls_ports[index] = free_port()
                self.sentinel_processes[index] = self._start_sentinel(index, self.sentinel_ports[index], primary_port)
        return all(self._sentinel_sees_all(index) for index in range(len(self.sentinel_ports)))

    def _sentinel_sees_all(self, index: int) -> bool:
        try:  # one short try: the port may be another process's that never answers (it is then started again)
            sentinel = redis.Redis(port=self.sentinel_ports[index], password=self.sentinel_password, socket_timeout=1,
                                   socket_connect_timeout=1, retry=Retry(NoBackoff(), 0), decode_responses=True)
            replicas = sentinel.execute_command("SENTINEL", "REPLICAS", MASTER_NAME)
            others = sentinel.execute_command("SENTINEL", "SENTINELS", MASTER_NAME)  # they vote in a failover
            return len(replicas) == len(self.servers) - 1 and len(others) == len(self.sentinel_ports) - 1
        except redis.exceptions.RedisError:
            return False

    def primary_port(self, index: int = 0) -> int:
        """The primary's port (its plain port) as sentinel ``index`` names it now."""
        _, port = self.sentinel_client(index).execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER_NAME)
        port = int(port)
        return next((plain for plain, announced in self.addresses.items() if announced == port), port)

    def server(self, port: int) -> RedisServer:
        return next(server for server in self.servers if server.port == port)

    def kill_primary(self) -> RedisServer:
        """SIGKILL the current primary (a crash); returns it."""
        primary = self.server(self.primary_port())
        primary.kill()
        return primary

    def wait_failover(self, old_port: int, timeout: float = 120.0) -> RedisServer:
        """Wait until every sentinel names a primary other than ``old_port`` and that server says it
        is one; returns it."""
        def promoted() -> bool:
            try:
                ports = {self.primary_port(index) for index in range(len(self.sentinel_ports))}
                return (len(ports) == 1 and old_port not in ports
                        and self.client(ports.pop()).info("replication")["role"] == "master")
            except (redis.exceptions.RedisError, StopIteration):
                return False

        self._wait(promoted, timeout, "the sentinels to promote a replica")
        return self.server(self.primary_port())

    def _wait(self, condition: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise RedisServerError(f"timed out after {timeout:.0f}s waiting for {what}; logs in {self.folder}")
            time.sleep(0.1)

    def close(self) -> None:
        for process in self.sentinel_processes:
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        for server in self.servers:
            server.close()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> SentinelSet:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()
