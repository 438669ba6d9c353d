"""What a consumer group cannot read from a run's results stream, recovered from the run's ledger.

The retention (``runs.trim``) never drops an entry a consumer group has not acknowledged, but
it cannot protect a group that does not exist yet: a trainer that starts after the retention
window (or after ``layertap run trim``) finds the stream trimmed past what its group has seen.
The ledger still knows every final job (``keys.run_status_hash``) and where an ok job's file is
(``runs.ledger_path``), so :func:`fill` queues every job the group missed on the group's
recovery stream (``keys.run_recovery_stream``), which the group's consumers read beside the
results stream, with the same acknowledgements, heartbeats and take-overs.

A job is *missed* by group G when it has a final status, its latest results entry is gone (no
field in ``keys.run_result_ids_hash``: trimmed) and G has not consumed it
(``keys.run_consumed_hash``). A group that existed when an entry was trimmed had acknowledged
it, and acknowledging records the job as consumed, so only a late group misses jobs. One
consumer fills at a time (``keys.run_recovery_lock``), once per trim of the stream
(``keys.run_recovered_key``), and a job already on the recovery stream is not queued again (its
entries stay: the stream is the record of what was queued).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import redis

from layertap.producer.client import runs
from layertap.protocol import keys
from layertap.protocol.schema import Result, Status
from layertap.transport import ledger

log = logging.getLogger(__name__)

#: How long one fill may hold the lock (a crashed filler's lock expires; the next fill dedupes).
LOCK_MS = 300_000
#: Status-hash fields looked at per round trip.
PAGE = 1000
#: Job ids named in the log of jobs that cannot be trained.
LOGGED_IDS = 20

@dataclass
class Recovery:
    """What one :func:`fill` queued: ok jobs (``without_file``: those whose file is not here) and errors."""

    ok: int = 0
    errors: int = 0
    without_file: list[str] = field(default_factory=list)

    @property
    def queued(self) -> int:
        return self.ok + self.errors


def fill(client: redis.Redis, run: str, group: str) -> Recovery | None:
    """Queue every job ``group`` missed (module doc) on its recovery stream; None while another
    consumer fills (look again later). Logs, as an error, the ok jobs whose file is not on this
    machine: no consumer of the group can train them. ``client`` decodes responses."""
    marker = client.get(keys.run_trimmed_key(run))
    if marker is None or client.get(keys.run_recovered_key(run, group)) == marker:
        return Recovery()  # never trimmed, or filled since the last trim
    lock, token = keys.run_recovery_lock(run, group), uuid.uuid4().hex
    if not ledger.take_lock(client, lock, token, LOCK_MS):
        return None
    try:
        found = _fill(client, run, group)
        ledger.mark_recovered(client, run, group, marker)
    finally:
        ledger.release_lock(client, lock, token)
    if found.queued:
        log.warning("run %s, consumer group %s: %d ok and %d error result(s) were trimmed from the results stream "
                    "before the group read them; recovered from the run's ledger", run, group, found.ok, found.errors)
    if found.without_file:
        log.error("run %s, consumer group %s: %d recovered ok job(s) have no file here and cannot be trained "
                  "(removed by another group's delete_after, or by hand): %s%s", run, group, len(found.without_file),
                  ", ".join(found.without_file[:LOGGED_IDS]), " ..." if len(found.without_file) > LOGGED_IDS else "")
    return found


def _fill(client: redis.Redis, run: str, group: str) -> Recovery:
    recovery_stream = keys.run_recovery_stream(run, group)
    queued = set(_queued_jobs(client, recovery_stream))
    roots = runs.storage_roots(client, run)
    found = Recovery()
    page: list[tuple[str, str]] = []
    for job_id, status in client.hscan_iter(keys.run_status_hash(run), count=PAGE):
        page.append((job_id, status))
        if len(page) >= PAGE:
            _queue_missed(client, run, group, page, queued, roots, found)
            page = []
    _queue_missed(client, run, group, page, queued, roots, found)
    return found


def _queued_jobs(client: redis.Redis, recovery_stream: str) -> Iterator[str]:
    after = "-"
    while True:
        entries = client.xrange(recovery_stream, min=after, count=PAGE)
        for _, fields in entries:
            yield fields[keys.RECOVERY_JOB_FIELD]
        if len(entries) < PAGE:
            return
        after = f"({entries[-1][0]}"


def _queue_missed(client: redis.Redis, run: str, group: str, page: list[tuple[str, str]], queued: set[str],
                  roots: list[str], found: Recovery) -> None:
    """Queue the jobs of ``page`` (job id, status) that ``group`` missed and that are not queued yet."""
    if not page:
        return
    job_ids = [job_id for job_id, _ in page]
    pipe = client.pipeline(transaction=True)  # one moment: indexed and consumed agree
    pipe.hmget(keys.run_result_ids_hash(run), job_ids)
    pipe.hmget(keys.run_consumed_hash(run, group), job_ids)
    indexed, consumed = pipe.execute()
    missed: list[str] = []
    for (job_id, status), entry_id, taken in zip(page, indexed, consumed, strict=True):
        if entry_id is not None or taken is not None or job_id in queued:
            continue
        missed.append(job_id)
        queued.add(job_id)
        if status == Status.ok.value:
            found.ok += 1
            path = runs.ledger_path(roots, run, job_id)
            if path is None or not Path(path).exists():
                found.without_file.append(job_id)
        else:
            found.errors += 1
    ledger.queue_recovered(client, run, group, missed)


def recovered_result(client: redis.Redis, run: str, job_id: str) -> Result | None:
    """The final result of a job queued on a recovery stream, from the ledger; None when the job
    has no final status any more (sent again since: its new result comes on the results stream)."""
    status = client.hget(keys.run_status_hash(run), job_id)
    return None if status is None else runs.ledger_result(client, run, job_id, keys.as_text(status))
