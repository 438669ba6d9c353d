"""What a consumer group cannot read from a run's results stream, recovered from the run's ledger.

The retention (``runs.trim``) never drops an entry a consumer group has not acknowledged, but
it cannot protect a group that does not exist yet: a trainer that starts after the retention
window (or after ``layertap run trim``) finds the stream trimmed past what its group has seen.
The ledger still knows every final job (its status) and where an ok job's file is
(``runs.ledger_path``), so :func:`fill` queues every job the group missed on the group's
recovery stream (``keys.run_recovery_stream``), which the group's consumers read beside the
results stream, with the same acknowledgements, heartbeats and take-overs.

A job is *missed* by group G when it has a final status, its latest results entry is gone
(trimmed) and G has not consumed it (the run ledger's ``missed_of``). A group that existed when
an entry was trimmed had acknowledged it, and acknowledging records the job as consumed, so only
a late group misses jobs. One consumer fills at a time (the ledger's recovery lock), once per
trim of the stream (its recovered marker), and a job already on the recovery stream is not
queued again (its entries stay: the stream is the record of what was queued). Every read and
change goes through the :class:`~layertap.transport.ledger.Ledger` given, which waits Redis out.
"""

from __future__ import annotations

import itertools
import logging
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from layertap.producer.client import runs
from layertap.protocol.schema import Result, Status
from layertap.transport.ledger import Ledger

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


def fill(book: Ledger, run: str, group: str) -> Recovery | None:
    """Queue every job ``group`` missed (module doc) on its recovery stream; None while another
    consumer fills (look again later). Logs, as an error, the ok jobs whose file is not on this
    machine: no consumer of the group can train them."""
    marker = book.trim_marker(run)
    if marker is None or book.recovered_marker(run, group) == marker:
        return Recovery()  # never trimmed, or filled since the last trim
    token = uuid.uuid4().hex
    if not book.take_recovery_lock(run, group, token, LOCK_MS):
        return None
    try:
        found = _fill(book, run, group)
        book.mark_recovered(run, group, marker)
    finally:
        book.release_recovery_lock(run, group, token)
    if found.queued:
        log.warning("run %s, consumer group %s: %d ok and %d error result(s) were trimmed from the results stream "
                    "before the group read them; recovered from the run's ledger", run, group, found.ok, found.errors)
    if found.without_file:
        log.error("run %s, consumer group %s: %d recovered ok job(s) have no file here and cannot be trained "
                  "(removed by another group's delete_after, or by hand): %s%s", run, group, len(found.without_file),
                  ", ".join(found.without_file[:LOGGED_IDS]), " ..." if len(found.without_file) > LOGGED_IDS else "")
    return found


def _fill(book: Ledger, run: str, group: str) -> Recovery:
    queued = set(book.recovery_jobs(run, group))
    roots = book.storage_roots(run)
    found = Recovery()
    statuses = book.statuses(run)
    while page := list(itertools.islice(statuses, PAGE)):
        _queue_missed(book, run, group, page, queued, roots, found)
    return found


def _queue_missed(book: Ledger, run: str, group: str, page: list[tuple[str, str]], queued: set[str],
                  roots: list[str], found: Recovery) -> None:
    """Queue the jobs of ``page`` (job id, status) that ``group`` missed and that are not queued yet."""
    missed: list[str] = []
    for (job_id, status), was_missed in zip(page, book.missed_of(run, group, [job_id for job_id, _ in page]),
                                            strict=True):
        if not was_missed or job_id in queued:
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
    book.queue_recovered(run, group, missed)


def recovered_result(book: Ledger, run: str, job_id: str) -> Result | None:
    """The final result of a job queued on a recovery stream, from the ledger; None when the job
    has no final status any more (sent again since: its new result comes on the results stream)."""
    status = book.status_of(run, job_id)
    return None if status is None else runs.ledger_result(book, run, job_id, status)
