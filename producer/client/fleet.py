"""Which workers are alive: every worker registers in ``keys.WORKERS_HASH`` and is alive while
its heartbeat key (``keys.worker_heartbeat_key``, with a TTL) exists. The one liveness check,
for the Client (``served_models``) and ``layertap status``; and the "did you mean" of a
model no live worker serves."""

from __future__ import annotations

import difflib
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


def did_you_mean(model: str, served: set[str]) -> str | None:
    """The served model ``model`` was most likely meant as: one that differs only in case, else the
    closest by ``difflib`` (its basename compared too, for a path); None when none is close."""
    folded = {name.casefold(): name for name in sorted(served)}
    for candidate in (model, model.rstrip("/").rsplit("/", 1)[-1]):
        if candidate.casefold() in folded:
            return folded[candidate.casefold()]
        close = difflib.get_close_matches(candidate, sorted(served), n=1, cutoff=0.75)
        if close:
            return close[0]
    return None


def running_jobs(client: redis.Redis) -> dict[str, int]:
    """Jobs running now, per model: those of the messages workers hold (delivered, not yet
    acknowledged: kombu's unacked hash, whose delivery tags begin with the task id), a bundle
    counted by its jobs (its pending record lists them)."""
    task_ids = sorted({keys.as_text(tag).partition(keys.DELIVERY_TAG_SEPARATOR)[0]
                       for tag in client.hkeys(keys.UNACKED_HASH)})
    counts: dict[str, int] = {}
    for record in client.hmget(keys.PENDING_HASH, task_ids) if task_ids else []:
        if record is None:
            continue
        data = json.loads(record)
        model = keys.queue_model(data.get("queue", ""))
        if model is not None:
            counts[model] = counts.get(model, 0) + (len(data["jobs"]) if isinstance(data.get("jobs"), list) else 1)
    return dict(sorted(counts.items()))
