"""A run's certificate and the capture index, as the ledger keeps them: each sampled row of a run
with what its worker is (``layertap.worker.job.sampling``, read by ``layertap certify``), and the
files that hold the computed states of a capture (``layertap.worker.job.reuse``)."""

from __future__ import annotations

from collections.abc import Sequence

import redis

from layertap.protocol import keys


def note_sample_waiting(client: redis.Redis, run: str, job_id: str, worker: str) -> None:
    """Note a sampled row of ``run`` as waiting to be measured by ``worker`` (before its result is published)."""
    client.hset(keys.run_samples_waiting_hash(run), job_id, worker)


def record_sample(client: redis.Redis, run: str, job_id: str, row: str, worker: str, facts: str) -> None:
    """Record a sampled row of ``run`` (JSON ``certificate.SampleRow``) and what its ``worker`` is
    (JSON ``facts``), no longer waiting, in one transaction."""
    pipe = client.pipeline(transaction=True)
    pipe.hset(keys.run_samples_hash(run), job_id, row)
    pipe.hset(keys.run_workers_hash(run), worker, facts)
    pipe.hdel(keys.run_samples_waiting_hash(run), job_id)
    pipe.execute()


def drop_sample_waiting(client: redis.Redis, run: str, job_id: str) -> None:
    """A sampled row of ``run`` that could not be measured: no longer waiting, and not sampled."""
    client.hdel(keys.run_samples_waiting_hash(run), job_id)


def run_samples_waiting(client: redis.Redis, run: str) -> dict[str, str]:
    """job id -> node, of the sampled rows of ``run`` still waiting to be measured."""
    return {keys.as_text(job_id): keys.as_text(node) for job_id, node in
            client.hscan_iter(keys.run_samples_waiting_hash(run), count=1000)}


def run_samples(client: redis.Redis, run: str) -> dict[str, str]:
    """job id -> JSON sampled row, of every sampled row of ``run``."""
    return {keys.as_text(job_id): keys.as_text(row) for job_id, row in
            client.hscan_iter(keys.run_samples_hash(run), count=1000)}


def run_workers(client: redis.Redis, run: str) -> dict[str, str]:
    """node -> JSON facts, of every worker that sampled rows of ``run``."""
    return {keys.as_text(node): keys.as_text(facts)
            for node, facts in client.hgetall(keys.run_workers_hash(run)).items()}


def record_captures(client: redis.Redis, notes: Sequence[tuple[str, str]]) -> None:
    """Note each ``(capture key, address)``: the file at the address holds the computed states of
    the capture key (one round trip)."""
    pipe = client.pipeline(transaction=False)
    for capture_key, address in notes:
        pipe.hset(keys.capture_hash(capture_key), address, "")
    pipe.execute()


def captures(client: redis.Redis, capture_keys: Sequence[str]) -> list[list[str]]:
    """The addresses noted for each of ``capture_keys``, sorted (one round trip)."""
    pipe = client.pipeline(transaction=False)
    for capture_key in capture_keys:
        pipe.hkeys(keys.capture_hash(capture_key))
    return [sorted(keys.as_text(address) for address in noted) for noted in pipe.execute()]


def forget_capture(client: redis.Redis, capture_key: str, address: str) -> None:
    """Drop a noted address whose file is gone or is not of the capture."""
    client.hdel(keys.capture_hash(capture_key), address)
