"""Which workers are alive: every worker registers in ``keys.WORKERS_HASH`` and is alive while
its heartbeat key (``keys.worker_heartbeat_key``, with a TTL) exists. The one liveness check,
for the Client (``served_models``) and ``layertap status``; and the "did you mean" of a
model no live worker serves.

A worker that crashed (SIGKILL, a lost host) cannot deregister: its entry is shown as dead for
:data:`DEAD_WORKER_SHOWN_S` after its last heartbeat, then pruned by the next read, only while
its heartbeat key is still gone and its entry unchanged (a worker that came back keeps it)."""

from __future__ import annotations

import difflib
import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from layertap.protocol import keys
from layertap.protocol.dtypes import AUTO, RECORDED_NAMES, STORED_AS
from layertap.protocol.fileformat import state_item_size
from layertap.protocol.layers import LayerIdError, resolve_layer_ids
from layertap.transport.ledger import Ledger
from layertap.transport.script_flags import lua, run_script

if TYPE_CHECKING:
    import redis

#: Seconds a dead worker stays listed (as dead) after its last heartbeat.
DEAD_WORKER_SHOWN_S = 600.0


def worker_records(client: redis.Redis,
                   keep_dead_s: float = DEAD_WORKER_SHOWN_S) -> list[tuple[str, dict[str, Any], bool]]:
    """``(node, description, alive)`` of every registered worker, by node name (one pipeline);
    a dead one whose last heartbeat is older than ``keep_dead_s`` is pruned instead."""
    described = client.hgetall(keys.WORKERS_HASH)
    nodes = sorted(described)
    pipe = client.pipeline(transaction=False)
    for node in nodes:
        pipe.exists(keys.worker_heartbeat_key(keys.as_text(node)))
    records, expired = [], []
    now = time.time()
    for node, alive in zip(nodes, pipe.execute(), strict=True):
        info = json.loads(described[node])
        if not alive and now - float(info.get("beat") or 0) > keep_dead_s:
            expired.append(node)
        else:
            records.append((keys.as_text(node), info, bool(alive)))
    if expired:
        run_script(client, lua(__package__, "prune_workers"),
                   [keys.WORKERS_HASH, *(keys.worker_heartbeat_key(keys.as_text(node)) for node in expired)],
                   [*expired, *(described[node] for node in expired)])
    return records


def live_workers(client: redis.Redis) -> dict[str, dict[str, Any]]:
    """Live workers: node name -> description."""
    return {node: info for node, info, alive in worker_records(client) if alive}


def served_depths(workers: dict[str, dict[str, Any]]) -> dict[str, int]:
    """Served model name -> the fewest decoder layers (``num_layers``) among the live ``workers``
    serving it: the layer ids every one of them can capture (``protocol.layers``)."""
    depths: dict[str, int] = {}
    for info in workers.values():
        if isinstance(info.get("num_layers"), int):
            depths[info["model"]] = min(info["num_layers"], depths.get(info["model"], info["num_layers"]))
    return depths


@dataclass(frozen=True)
class ServedShape:
    """What the live workers serving one model report of the files they write: the largest hidden
    size and residual copies, the fewest decoder layers, the longest default layer list, the
    compute dtype of the widest items (what ``auto`` stores), and their storage roots (sorted).
    ``hidden_size`` is None when a worker does not report it (an older worker)."""

    hidden_size: int | None
    num_layers: int
    default_layers: list[int]
    dtype: str
    copies: int
    storage_roots: list[str]

    def layers_of(self, layers: list[int] | None) -> list[int] | None:
        """A job's ``layers`` as these workers resolve them (their default for None); None for ids
        they lack."""
        try:
            return resolve_layer_ids(self.default_layers if layers is None else layers, self.num_layers)
        except LayerIdError:
            return None

    def stored_dtype(self, dtype: str) -> str | None:
        """The recorded name of the dtype a job's ``dtype`` is stored as here (``auto``: the
        workers' compute dtype); None for one this release does not know."""
        return RECORDED_NAMES.get(self.dtype if dtype == AUTO else dtype)


def served_shape(workers: dict[str, dict[str, Any]], model: str) -> ServedShape | None:
    """The :class:`ServedShape` of ``model`` among the live ``workers``; None when none serves it."""
    infos = [info for info in workers.values()
             if info.get("model") == model and isinstance(info.get("num_layers"), int)]
    if not infos:
        return None
    sizes = [info.get("hidden_size") for info in infos]
    return ServedShape(
        hidden_size=max(sizes) if all(isinstance(size, int) for size in sizes) else None,  # type: ignore[type-var]
        num_layers=min(info["num_layers"] for info in infos),
        default_layers=max((list(info.get("layers") or []) for info in infos), key=len),
        dtype=max((str(info.get("dtype")) for info in infos), key=_item_bytes),
        copies=max(int(info.get("residual_copies") or 1) for info in infos),
        storage_roots=sorted({str(info["storage_root"]) for info in infos if info.get("storage_root")}))


def _item_bytes(dtype: str) -> int:
    """Bytes per stored value of a compute dtype name (0 for a name this release does not know)."""
    return state_item_size(dtype) if dtype in STORED_AS else 0


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
    for data in Ledger(client, give_up_s=0).records_of(task_ids):
        if data is None:
            continue
        model = keys.queue_model(data.get("queue", ""))
        if model is not None:
            counts[model] = counts.get(model, 0) + (len(data["jobs"]) if isinstance(data.get("jobs"), list) else 1)
    return dict(sorted(counts.items()))
