"""What a worker keeps in the ledger for certificates and reuse (``layertap.transport.ledger``).

* :class:`LedgerSamples`: the sampled rows (``layertap.worker.job.sampling``): each waiting row,
  then its measured row with what the worker is; waited out while Redis is away as a publish is
  (a row that cannot be noted as waiting fails its job, transiently, so none is lost quietly);
* :class:`LedgerCaptures`: the capture index (``layertap.worker.job.reuse``). It only saves work:
  a lookup Redis cannot answer finds nothing (the job is computed) and a file it cannot note is
  not reused, each logged.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import redis

from layertap.protocol.certificate import SampleRow
from layertap.transport.ledger import Ledger

log = logging.getLogger(__name__)
T = TypeVar("T")


class LedgerSamples:
    """A sampler's book (``sampling.SampleBook``) in the run's ledger. Thread-safe."""

    def __init__(self, client: redis.Redis, give_up_s: float):
        self.ledger = Ledger(client, give_up_s)

    def waiting(self, run: str, job_id: str, worker: str) -> None:
        self.ledger.note_sample_waiting(run, job_id, worker)

    def record(self, run: str, row: SampleRow, facts: dict[str, Any]) -> None:
        self.ledger.record_sample(run, row.job_id, row.model_dump_json(), row.worker, json.dumps(facts, sort_keys=True))

    def dropped(self, run: str, job_id: str) -> None:
        self.ledger.drop_sample_waiting(run, job_id)


class LedgerCaptures:
    """The capture index in Redis (``keys.capture_hash``). Thread-safe."""

    def __init__(self, client: redis.Redis):
        self.ledger = Ledger(client, give_up_s=0)  # it only saves work: one attempt, then the job is computed

    def find_many(self, capture_keys: Sequence[str]) -> list[list[str]]:
        found = _or_logged(lambda: self.ledger.captures(capture_keys),
                           f"could not look up {len(capture_keys)} capture(s); their jobs are computed")
        return found or [[] for _ in capture_keys]

    def add_many(self, notes: Sequence[tuple[str, str]]) -> None:
        _or_logged(lambda: self.ledger.record_captures(notes),
                   f"could not note {len(notes)} file(s) in the capture index; they answer no other job")

    def forget(self, capture_key: str, address: str) -> None:
        _or_logged(lambda: self.ledger.forget_capture(capture_key, address),
                   f"could not drop the gone file {address} from capture {capture_key}")


def _or_logged(action: Callable[[], T], what: str) -> T | None:
    """``action()``, or None with ``what`` logged when Redis fails it."""
    try:
        return action()
    except redis.exceptions.RedisError as exc:
        log.warning("%s (%s)", what, exc)
        return None
