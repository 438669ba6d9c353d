"""The dead-letter stream: jobs that failed ``max_attempts`` times, with their last error.

Each entry (``XADD layertap:dead``) holds the job as JSON, its run and id, the attempt
count, the last error type and message, when and on which worker. Requeueing clears the
job's attempt counter and submits it again; the entry is removed once resubmitted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from layertap.producer.client.client import Client


@dataclass
class DeadLetter:
    """One entry of the dead-letter stream (:func:`list_dead`): the job's data, its attempts and last error, and when
    (``at``, epoch seconds) and on which ``worker`` it failed the last time."""

    entry_id: str
    job: dict[str, Any]
    run: str
    job_id: str
    attempts: int
    error_type: str
    error: str
    at: float
    worker: str

    @classmethod
    def from_entry(cls, entry_id: str, fields: dict[str, str]) -> DeadLetter:
        return cls(entry_id=entry_id, job=json.loads(fields["job"]), run=fields["run"], job_id=fields["job_id"],
                   attempts=int(fields["attempts"]), error_type=fields["error_type"], error=fields["error"],
                   at=float(fields["at"]), worker=fields.get("worker", ""))


def list_dead(client: Client, count: int | None = None) -> list[DeadLetter]:
    """Dead letters, oldest first."""
    entries = client.ledger.waiting(0).dead_letters(count)
    return [DeadLetter.from_entry(entry_id, fields) for entry_id, fields in entries]


def requeue(client: Client, entry_ids: list[str] | None = None) -> list[str]:
    """Submit dead jobs again (all, or the given entries); returns their job ids. Each job's dead
    letter result stops being final, and being consumed by its run's consumer groups, in the step
    that queues its message (``Client.send``'s ``reopen``): a streaming trainer or ``wait`` on the
    run waits for its new result."""
    wanted = set(entry_ids) if entry_ids else None
    requeued = []
    for letter in list_dead(client):
        if wanted is not None and letter.entry_id not in wanted:
            continue
        client.ledger.clear_attempts(letter.run, letter.job_id)
        job, payload = client.prepare(letter.job)
        client.send([[(job, payload)]], {(job.run, job.job_id or ""): client.ledger.group_names(job.run)})
        client.ledger.remove_dead_letters([letter.entry_id])
        requeued.append(letter.job_id)
    return requeued


def purge(client: Client, entry_ids: list[str] | None = None) -> int:
    """Delete dead letters (all, or the given entries); returns how many."""
    return client.ledger.waiting(0).remove_dead_letters(entry_ids)
