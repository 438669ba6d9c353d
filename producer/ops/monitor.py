"""What the fleet and a run are doing, read from Redis alone (no worker is asked anything).

* the fleet: queue depth per model (``SCAN`` for ``layertap.q.*``, ``LLEN``; kombu's
  priority sub-queues are added to their queue), every worker in ``layertap:workers``
  (alive while its heartbeat key exists), the dead-letter count (``XLEN``) and Redis's
  memory against its ``maxmemory`` (``INFO memory``): at the limit under ``noeviction``
  Redis refuses writes, so workers can neither beat nor finish jobs until memory is freed;
* a run: its total is ``HLEN`` of the submitted hash, finished jobs ``HLEN`` of the status
  hash (one entry per job, so duplicates never count twice); failed jobs are read once
  with ``HSCAN`` (those in the run's cancelled set counted as cancelled, apart) and then
  kept up to date from the results stream, which also gives tokens. Each poll costs O(new results), not O(run size).

All functions take a ``redis.Redis`` made with ``decode_responses=True``.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import Any

import redis

from layertap.producer.client.fleet import worker_records
from layertap.producer.client.results import START, stream_results
from layertap.protocol import keys
from layertap.protocol.schema import ErrorType, Status
from layertap.rates import RateWindow
from layertap.transport.ledger import Ledger


@dataclass
class WorkerState:
    """One worker as its last heartbeat described it."""

    node: str
    alive: bool
    model: str
    device: str
    gpus: str
    tokens_per_s: float
    jobs: int
    tokens: int
    pending: int
    beat_age_s: float | None
    batching: str = ""  # the worker's batching layout (its name), chosen and self-checked at its start
    weights: str = ""  # the fingerprint of the checkpoint it loaded (header ``weights_fingerprint``)
    last_exit: str = ""  # how this node last ended, as its supervisor saw it (keys.WORKER_EXITS_HASH)
    last_exit_age_s: float | None = None
    load: dict[str, Any] | None = None  # loading: seconds, peak host memory and weights (GiB)
    quant_compute: str = ""  # quantized checkpoints: "dequant" | "fp8"
    experts: str = ""  # mixture of experts: transformers' experts implementation
    compiled: bool = False  # its decoder layers run torch.compile's code (--compile, and the self-check passed it)


@dataclass
class RedisMemory:
    """Redis's memory use; ``refusing_writes`` at ``maxmemory`` under ``noeviction`` (OOM replies)."""

    used_bytes: int
    max_bytes: int  # 0: no limit
    policy: str
    refusing_writes: bool


@dataclass
class FleetStatus:
    """What ``layertap status`` shows (:func:`fleet_status`; ``--json`` prints :meth:`as_json`)."""

    queues: dict[str, int]  # model -> messages waiting in its queue
    workers: list[WorkerState]
    dead_letters: int
    redis: RedisMemory

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def queue_depths(client: redis.Redis) -> dict[str, int]:
    """Messages waiting per model, for every non-empty model queue."""
    found = sorted(client.scan_iter(match=keys.QUEUE_PATTERN, count=1000))
    pipe = client.pipeline(transaction=False)
    for key in found:
        pipe.llen(key)
    depths: dict[str, int] = {}
    for key, depth in zip(found, pipe.execute(), strict=True):
        model = keys.queue_model(key)
        if model is not None:
            depths[model] = depths.get(model, 0) + int(depth)
    return depths


def worker_states(client: redis.Redis, now: float | None = None) -> list[WorkerState]:
    """Every registered worker, alive or not (a killed worker is shown dead for ``fleet.DEAD_WORKER_SHOWN_S``),
    with how each node last ended where its supervisor recorded it; a node that ended before it
    ever registered (killed while loading) is listed too, not alive."""
    now = time.time() if now is None else now
    exits = {node: json.loads(value) for node, value in client.hgetall(keys.WORKER_EXITS_HASH).items()}
    states = []
    for node, info, alive in worker_records(client):
        engine = info.get("engine") or {}
        beat = info.get("beat")
        states.append(WorkerState(
            node=node, alive=alive, model=str(info.get("model", "")), device=str(info.get("device", "")),
            gpus=str(info.get("gpus", "")), tokens_per_s=float(info.get("tokens_per_s") or 0.0),
            jobs=int(engine.get("jobs", 0)), tokens=int(engine.get("tokens", 0)), pending=int(engine.get("pending", 0)),
            beat_age_s=None if beat is None else max(0.0, now - float(beat)), batching=str(info.get("batching", "")),
            weights=str(info.get("weights_fingerprint", "")),
            load=info.get("load"), quant_compute=str(info.get("quant_compute") or ""),
            experts=str(info.get("experts") or ""), compiled=bool(info.get("compiled"))))
    listed = {state.node for state in states}
    states += [WorkerState(node=node, alive=False, model="", device="", gpus="", tokens_per_s=0.0, jobs=0, tokens=0,
                           pending=0, beat_age_s=None) for node in sorted(set(exits) - listed)]
    for state in states:
        if state.node in exits:
            state.last_exit = str(exits[state.node].get("reason", ""))
            state.last_exit_age_s = max(0.0, now - float(exits[state.node].get("at", now)))
    return states


def redis_memory(client: redis.Redis) -> RedisMemory:
    """Redis's ``INFO memory``: bytes used, ``maxmemory`` (0: none) and its policy, and whether writes are refused."""
    info = client.info("memory")
    used, limit, policy = int(info["used_memory"]), int(info.get("maxmemory", 0)), str(info.get("maxmemory_policy", ""))
    return RedisMemory(used, limit, policy, refusing_writes=policy == "noeviction" and 0 < limit <= used)


def fleet_status(client: redis.Redis) -> FleetStatus:
    """Queues (models that live workers serve are listed even when empty), workers, dead letters, Redis memory."""
    workers = worker_states(client)
    queues = queue_depths(client)
    for state in workers:
        if state.alive:
            queues.setdefault(state.model, 0)
    return FleetStatus(dict(sorted(queues.items())), workers, Ledger(client, give_up_s=0).dead_letter_count(),
                       redis_memory(client))


@dataclass
class RunProgress:
    """A run at one moment. ``total`` counts distinct submitted jobs."""

    run: str
    total: int
    done: int
    failed: int  # error results other than ``cancelled``
    tokens: int  # tokens of ok results seen since the tracker started
    tokens_per_s: float
    jobs_per_s: float
    cancelled: int = 0  # ``cancelled`` results (``layertap run cancel``), counted apart from failures

    @property
    def finished(self) -> int:
        return self.done + self.failed + self.cancelled

    @property
    def complete(self) -> bool:
        """Every submitted job has a final result (and there was at least one job)."""
        return self.total > 0 and self.finished >= self.total

    @property
    def eta_s(self) -> float | None:
        """Seconds until complete at the current job rate; None while no rate is known."""
        remaining = self.total - self.finished
        if remaining <= 0:
            return 0.0
        return remaining / self.jobs_per_s if self.jobs_per_s > 0 else None


class RunTracker:
    """Follows one run; :meth:`poll` returns its progress now."""

    def __init__(self, client: redis.Redis, run: str, window_s: float = 30.0):
        self.redis = client
        self.run = run
        self.ledger = Ledger(client, give_up_s=0)
        self._last_id = self.ledger.last_entry_id(run) or START  # taken before the scan: later results are replayed
        errors = {job for job, status in self.ledger.statuses(run) if status == Status.error.value}
        self._cancelled = self.ledger.cancelled_jobs(run)
        self._failed = errors - self._cancelled
        self._tokens = 0
        self._token_rate = RateWindow(window_s)
        self._job_rate = RateWindow(window_s)

    def poll(self) -> RunProgress:
        for entry_id, result in stream_results(self.redis, self.run, self._last_id):
            self._last_id = entry_id
            self._failed.discard(result.job_id)
            self._cancelled.discard(result.job_id)
            if result.ok:
                self._tokens += result.num_tokens or 0
            else:
                (self._cancelled if result.error_type is ErrorType.cancelled else self._failed).add(result.job_id)
        submitted, finished, _ = self.ledger.counts(self.run)
        cancelled = min(len(self._cancelled), finished)
        failed = min(len(self._failed), finished - cancelled)
        self._token_rate.add(self._tokens)
        self._job_rate.add(finished)
        return RunProgress(run=self.run, total=max(submitted, finished), done=finished - failed - cancelled,
                           failed=failed, cancelled=cancelled, tokens=self._tokens,
                           tokens_per_s=self._token_rate.rate(), jobs_per_s=self._job_rate.rate())


def throughput_history(client: redis.Redis, run: str) -> list[tuple[float, int]]:
    """``(finished_at, num_tokens)`` of every ok result of the run, in time order (reads the whole stream)."""
    points = [(result.finished_at, result.num_tokens or 0) for _, result in stream_results(client, run)
              if result.ok]
    return sorted(points)
