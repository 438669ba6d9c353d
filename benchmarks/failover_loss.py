"""What a Sentinel failover loses of what layertap's Client was told was sent.

    python benchmarks/failover_loss.py --trials 5 --senders 2 --json failover-loss.json

Per trial, a fresh Sentinel set on 127.0.0.1 (a primary, a replica, three sentinels:
``layertap.producer.dev.sentinel_set``) and ``--senders`` threads, each with its own ``Client``,
submitting one-job messages to a model no worker serves (they stay queued) as fast as they can.
After ``--warmup-s`` seconds the primary is taken away, one of three ways:

* ``kill``: SIGKILLed: the process crashes, its host lives on (what it wrote to its sockets is
  still delivered);
* ``crash``: the replica reaches the primary through a link of ``--link-delay-ms`` each way
  (:class:`Link`, a proxy in this process; a replica in another zone, the clients in the
  primary's), which is cut, dropping what is in flight on it, as the primary is SIGKILLed: its
  host dies, or its network;
* ``switch``: ``SENTINEL FAILOVER`` while the primary lives: the replica is promoted and the old
  primary made its replica, as when a network partition heals; what the old primary accepted
  after the replica stopped following it is dropped when it resyncs.

A killed primary is started again once a replica took its place (its supervisor restarting it;
the sentinels make it a replica). The senders go on (each send waits out the outage,
``redis_conn.retrying``) until ``--after-s`` seconds after the new primary answers. A send
counts as *acknowledged* once ``Client.submit`` returned; it is *lost* when its message is not in
the queue of the new primary, and *silent* when its ledger record (``keys.run_submitted_hash``)
is gone too (no ``lost`` result can say so). Each trial runs with ``redis_wait_replicas`` 0 (no
``WAIT``) and 1 (a send returns once the replica holds its message); ``--min-replicas-to-write``
sets that Redis option on every server. Prints one JSON line per trial and a summary.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import socket
import tempfile
import threading
import time
import warnings
from pathlib import Path

from layertap.producer.client.client import Client
from layertap.producer.dev.redis_server import free_port
from layertap.producer.dev.sentinel_set import MASTER_NAME, SentinelSet
from layertap.protocol import keys
from layertap.settings import Settings

MODEL = "bench-failover"


class Link:
    """A TCP proxy on 127.0.0.1 to ``target`` that delays every byte ``delay_s`` each way (a network
    link) and can be cut: its connections closed, what is in flight on them dropped."""

    def __init__(self, target: int, delay_s: float):
        self.target, self.delay_s = target, delay_s
        self.port = free_port()
        self.listener = socket.create_server(("127.0.0.1", self.port))
        self.sockets: list[socket.socket] = []
        self.generation = 0  # cut() moves it on: pumps of an older generation drop what they hold
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            client, _ = self.listener.accept()
            try:
                server = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                client.close()
                continue
            for end in (client, server):  # as Redis's own sockets: no Nagle delay on small writes
                end.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.sockets += [client, server]
            for source, sink in ((client, server), (server, client)):
                self._pump(source, sink, self.generation)

    def _pump(self, source: socket.socket, sink: socket.socket, generation: int) -> None:
        queue: collections.deque[tuple[float, bytes]] = collections.deque()
        ready = threading.Condition()

        def read() -> None:
            while (data := _recv(source)) and generation == self.generation:
                with ready:
                    queue.append((time.monotonic() + self.delay_s, data))
                    ready.notify()
            with ready:
                queue.append((0.0, b""))
                ready.notify()

        def write() -> None:
            while True:
                with ready:
                    ready.wait_for(lambda: queue)
                    due, data = queue.popleft()
                if not data or generation != self.generation:
                    break
                time.sleep(max(0.0, due - time.monotonic()))
                if generation != self.generation:
                    break
                try:
                    sink.sendall(data)
                except OSError:
                    break
            for end in (source, sink):
                end.close()

        threading.Thread(target=read, daemon=True).start()
        threading.Thread(target=write, daemon=True).start()

    def cut(self) -> None:
        """Drop every connection and what is in flight on it; new connections are taken again."""
        self.generation += 1
        for end in self.sockets:
            try:
                end.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.sockets = []


def _recv(source: socket.socket) -> bytes:
    try:
        return source.recv(65536)
    except OSError:
        return b""


def sender(settings: Settings, run: str, name: str, stop: threading.Event, acked: list[tuple[str, float]]) -> None:
    """Submit one-job messages until ``stop``; each acknowledged job id, with the time it was."""
    with Client(settings) as client, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no worker serves the model: the jobs stay queued
        number = 0
        while not stop.is_set():
            job = client.submit({"prompt": f"{name} job {number}"}, model=MODEL, run=run)
            acked.append((job.job_id or "", time.monotonic()))
            number += 1


def queued_task_ids(client, queue: str) -> set[str]:
    """The task ids of the messages in ``queue``."""
    return {json.loads(raw)["headers"]["id"] for raw in client.lrange(queue, 0, -1)}


def trial(how: str, wait_replicas: int, args: argparse.Namespace, folder: Path) -> dict:
    run = f"{how}-w{wait_replicas}"
    cluster = SentinelSet(folder, down_after_ms=1000)
    link = None
    if how == "crash":
        link = Link(cluster.servers[0].port, args.link_delay_ms / 1000)
        cluster.link_replicas(link.port)
    with cluster:
        for index in range(len(cluster.sentinel_ports)):  # no "+fix-slave-config" of the linked replica in a trial
            cluster.sentinel_client(index).execute_command("SENTINEL", "SET", MASTER_NAME, "failover-timeout", 120000)
        if args.min_replicas_to_write:
            for server in cluster.servers:
                cluster.client(server.port).config_set("min-replicas-to-write", args.min_replicas_to_write)
        settings = Settings(redis_url=cluster.url, redis_wait_replicas=wait_replicas, redis_wait_s=300)
        stop = threading.Event()
        acked: list[list[tuple[str, float]]] = [[] for _ in range(args.senders)]
        threads = [threading.Thread(target=sender, args=(settings, run, f"s{i}", stop, acked[i]))
                   for i in range(args.senders)]
        for thread in threads:
            thread.start()
        time.sleep(args.warmup_s)
        old_port = cluster.primary_port()
        taken_at = time.monotonic()
        if how == "switch":
            cluster.sentinel_client(0).execute_command("SENTINEL", "FAILOVER", MASTER_NAME)
        else:
            if link is not None:
                link.cut()
            killed = cluster.kill_primary()
        promoted = cluster.wait_failover(old_port)
        promoted_at = time.monotonic()
        if how != "switch":
            killed.start()  # its supervisor restarts it; the sentinels make it the new primary's replica
        time.sleep(args.after_s)
        stop.set()
        for thread in threads:
            thread.join(timeout=600)
        final = cluster.client(promoted.port)
        present = queued_task_ids(final, keys.model_queue(MODEL))
        recorded = set(final.hkeys(keys.run_submitted_hash(run)))
        every = [(job_id, at) for sent in acked for job_id, at in sent]
        lost = [(job_id, at) for job_id, at in every if keys.task_id(run, job_id) not in present]
        return {
            "how": how, "wait_replicas": wait_replicas, "senders": args.senders,
            "link_delay_ms": args.link_delay_ms if link else 0, "min_replicas_to_write": args.min_replicas_to_write,
            "acknowledged": len(every), "lost": len(lost),
            "silent": sum(1 for job_id, _ in lost if job_id not in recorded),
            # when each lost send was acknowledged, in seconds after the primary was taken away
            "lost_acknowledged_at_s": sorted(round(at - taken_at, 3) for _, at in lost)[:20],
            "failover_s": round(promoted_at - taken_at, 2),
            "sends_per_s_before": round(sum(1 for _, at in every if at < taken_at) / args.warmup_s, 1),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--senders", type=int, default=4)
    parser.add_argument("--warmup-s", type=float, default=3.0)
    parser.add_argument("--after-s", type=float, default=2.0)
    parser.add_argument("--ways", default="kill,crash,switch")
    parser.add_argument("--link-delay-ms", type=float, default=5.0, help="crash: the link's delay each way")
    parser.add_argument("--min-replicas-to-write", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="also write every trial here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)  # the senders' "waiting out" lines are expected here
    rows = []
    with tempfile.TemporaryDirectory(prefix="layertap-failover-") as tmp:
        for number in range(args.trials):
            for how in args.ways.split(","):
                for wait_replicas in (0, 1):
                    row = trial(how, wait_replicas, args, Path(tmp) / f"{how}-{wait_replicas}-{number}")
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    summary = {}
    for row in rows:
        key = f"{row['how']} wait_replicas={row['wait_replicas']}"
        total = summary.setdefault(key, {"trials": 0, "acknowledged": 0, "lost": 0, "silent": 0, "sends_per_s": []})
        total["trials"] += 1
        for name in ("acknowledged", "lost", "silent"):
            total[name] += row[name]
        total["sends_per_s"].append(row["sends_per_s_before"])
    report = {"summary": summary, "args": vars(args) | {"json": str(args.json)}, "cpus": os.cpu_count(),
              "load": os.getloadavg()}
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.write_text(json.dumps({"trials": rows, **report}, indent=1))


if __name__ == "__main__":
    main()
