"""Which workers are alive: every worker registers in ``keys.WORKERS_HASH`` and is alive while
its heartbeat key (``keys.worker_heartbeat_key``, with a TTL) exists. The one liveness check,
for the Client (``served_models``) and ``layertap status``."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from producer.protocol import keys

if TYPE_CHECKING:
    import redis


def worker_records(client: redis.Redis) -> list[tuple[str, dict[str, Any], bool]]:
    """``(node, description, alive)`` of every registered worker, by node name (one pipeline)."""
    described = client.hgetall(keys.WORKERS_HASH)
    nodes = sorted(described)
    pipe = client.pipeline(transaction=False)
    for node in nodes:
        pipe.exists(keys.worker_heartbeat_key(node))
    return [(node, json.loads(described[node]), bool(alive)) for node, alive in zip(nodes, pipe.execute(), strict=True)]


def live_workers(client: redis.Redis) -> dict[str, dict[str, Any]]:
    """Live workers: node name -> description."""
    return {node: info for node, info, alive in worker_records(client) if alive}
