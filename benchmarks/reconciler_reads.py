"""Bytes the reconciler reads from Redis per sweep, per held message.

    python benchmarks/reconciler_reads.py --held 64 --queued 64 --tokens 2000

Starts a private Redis, submits ``held + queued`` real jobs of ``tokens`` token ids with
:class:`layertap.producer.client.client.Client`, takes ``held`` of them off the queue through kombu's own
Redis channel without acknowledging them (so they sit in kombu's ``unacked`` records as a
worker's would), then runs :meth:`layertap.worker.queue.reconciler.Reconciler.sweep` and reports
``total_net_output_bytes`` of the server across the sweep (what the reconciler read),
the number of commands it sent, and both per held message. No worker is started.
"""

from __future__ import annotations

import argparse
import json
import warnings

import redis

from layertap.producer.client.client import Client, NoWorkerWarning
from layertap.producer.dev.redis_server import RedisServer
from layertap.protocol import keys
from layertap.settings import Settings
from layertap.worker.queue.reconciler import Reconciler

MODEL = "bench-reconciler"


def server_counters(client: redis.Redis) -> tuple[int, int]:
    """(bytes the server has sent, commands it has run), as of now."""
    stats = client.info("stats")
    return int(stats["total_net_output_bytes"]), int(stats["total_commands_processed"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--held", type=int, default=64, help="messages held (unacked) during the sweep")
    parser.add_argument("--queued", type=int, default=64, help="messages left in the queue")
    parser.add_argument("--tokens", type=int, default=2000, help="token ids per job")
    parser.add_argument("--sweeps", type=int, default=3)
    args = parser.parse_args()
    with RedisServer(appendonly=False) as server:
        settings = Settings(redis_url=server.url)
        with Client(settings) as client, warnings.catch_warnings():
            warnings.simplefilter("ignore", NoWorkerWarning)
            for index in range(args.held + args.queued):
                client.submit({"model": MODEL, "run": "bench", "job_id": f"j{index:06d}",
                               "token_ids": [(index * 7 + t) % 30000 for t in range(args.tokens)]})
            message_bytes = len(client.redis.lindex(keys.model_queue(MODEL), 0))
            with client.celery.connection_for_read() as connection:
                channel = connection.default_channel
                for _ in range(args.held):
                    assert channel.basic_get(keys.model_queue(MODEL), no_ack=False) is not None
                held = client.redis.hlen(keys.UNACKED_HASH)
                raw = redis.Redis.from_url(server.url)
                reconciler = Reconciler(raw, client.celery, "bench-node", interval=1.0, grace=0.0)
                results = []
                for _ in range(args.sweeps):
                    raw.delete(keys.RECONCILE_LOCK)
                    bytes_before, commands_before = server_counters(raw)
                    resent = reconciler.sweep()
                    bytes_after, commands_after = server_counters(raw)
                    info_reply = server_counters(raw)[0] - bytes_after  # the size of one INFO reply
                    # ``bytes_after`` counts the reply that gave ``bytes_before``; the commands, that INFO
                    results.append({"bytes": bytes_after - bytes_before - info_reply,
                                    "commands": commands_after - commands_before - 1, "resent": resent})
                raw.close()
    best = min(results, key=lambda r: r["bytes"])
    print(json.dumps({"held": held, "queued": args.queued, "tokens": args.tokens, "message_bytes": message_bytes,
                      "sweeps": results, "bytes_per_sweep": best["bytes"],
                      "bytes_per_held_message": round(best["bytes"] / max(held, 1), 1),
                      "commands_per_sweep": best["commands"]}, indent=1))


if __name__ == "__main__":
    main()
