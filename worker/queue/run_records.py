"""What a worker keeps in the ledger for certificates (``layertap.transport.ledger``).

* :func:`sample_recorder`: each sampled row (``layertap.worker.job.sampling``) with what the worker
  is, waited out while Redis is away as a publish is: a row that cannot be recorded fails its job
  (transiently), so no measured row is lost quietly.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import redis

from layertap.protocol.certificate import SampleRow
from layertap.transport import ledger
from layertap.worker.job.sampling import Record
from layertap.worker.queue.publisher import wait_out_redis

log = logging.getLogger(__name__)


def sample_recorder(client: redis.Redis, give_up_s: float) -> Record:
    """A sampler's ``record``: the row and the worker's facts into the run's ledger."""
    def record(run: str, row: SampleRow, facts: dict[str, Any]) -> None:
        wait_out_redis(lambda: ledger.record_sample(client, run, row.job_id, row.model_dump_json(), row.worker,
                                                    json.dumps(facts, sort_keys=True)),
                       f"recording sampled row {row.job_id} of run {run}", give_up_s)
    return record
