"""The run ledger: every Redis state of a job and a run, changed and read here and nowhere else,
through one object, :class:`Ledger`.

Its modules, by the step of a job's life: ``pending`` (what was sent: each job's latest send
time, each message's pending record, and the reconciler's view of them), ``attempts`` (starts,
dead letters, a run's cancel), ``results`` (the final publish, and reading a run's results),
``runs`` (a run's counts, statuses and trimmed files; its trim and delete), ``groups`` (a
streaming trainer's consumer group and recovery stream), ``certificate`` (a run's sampled rows,
the capture index). Each
operation there is a function of a Redis client and one attempt; those of several commands are
one transaction or one script, each script a ``.lua`` file beside them (``script``).

:class:`Ledger` binds one client and owns the retries: each operation is waited out while Redis
is away or refuses writes (``refusals.wait_out``), so no caller writes a retry of its own.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import redis

from layertap.protocol.schema import Result
from layertap.transport.ledger import attempts, certificate, groups, pending, results, runs
from layertap.transport.ledger.pending import SentMessage, message_jobs, pending_record, record_pending
from layertap.transport.ledger.results import cancelled_error, cancelled_result, entry_result, lost_result
from layertap.transport.refusals import wait_out

__all__ = ["Ledger", "SentMessage", "cancelled_error", "cancelled_result", "entry_result", "lost_result",
           "message_jobs", "pending_record", "record_pending"]

T = TypeVar("T")


def _waited(operation: Callable[..., T]) -> Callable[..., T]:
    """``operation(client, ...)`` as a :class:`Ledger` method: on its client, waited out."""
    @functools.wraps(operation)
    def method(self: Ledger, *args: Any, **kwargs: Any) -> T:
        if self.give_up_s <= 0:
            return operation(self.redis, *args, **kwargs)
        return wait_out(lambda: operation(self.redis, *args, **kwargs), self.give_up_s,
                        what=f"the run ledger's {operation.__name__}")
    return method




class Ledger:
    """The run ledger on one Redis client. Each operation (one function of the ledger's modules,
    named the same) is tried again while Redis is away or refuses writes, for up to ``give_up_s``
    seconds, and then raises; ``give_up_s`` 0: one attempt (a sweep that runs again at its next
    tick, a check with a fallback, a command that reports the error). Iterators are read a page at
    a time, each page waited out. Thread-safe as its client is."""

    def __init__(self, client: redis.Redis, give_up_s: float = 60.0) -> None:
        self.redis = client
        self.give_up_s = give_up_s

    def waiting(self, give_up_s: float) -> Ledger:
        """This ledger's client with another wait."""
        return Ledger(self.redis, give_up_s)

    # what was sent (``pending``)
    record_sent = _waited(pending.record_sent)
    seal = _waited(pending.seal)
    push_recorded = _waited(pending.push_recorded)
    is_pending = _waited(pending.is_pending)
    record_of = _waited(pending.record_of)
    records_of = _waited(pending.records_of)
    run_records = _waited(pending.run_records)
    suspects = _waited(pending.suspects)
    note_suspects = _waited(pending.note_suspects)
    pending_queues = _waited(pending.pending_queues)
    adopt_records = _waited(pending.adopt_records)
    sent_before = _waited(pending.sent_before)
    ended_of = _waited(pending.ended_of)
    forget_sent = _waited(pending.forget_sent)
    sent_at = _waited(pending.sent_at)
    head_delivery_tag = _waited(pending.head_delivery_tag)
    restore_inflight = _waited(pending.restore_inflight)

    # starts, dead letters, cancel (``attempts``)
    count_starts = _waited(attempts.count_starts)
    split_message = _waited(attempts.split_message)
    clear_attempts = _waited(attempts.clear_attempts)
    dead_letter = _waited(attempts.dead_letter)
    dead_letters = _waited(attempts.dead_letters)
    dead_letter_count = _waited(attempts.dead_letter_count)
    remove_dead_letters = _waited(attempts.remove_dead_letters)
    cancel = _waited(attempts.cancel)
    cancelled_runs = _waited(attempts.cancelled_runs)

    # final results (``results``)
    publish = _waited(results.publish)
    end_lost_message = _waited(results.end_lost_message)
    read_results = _waited(results.read_results)
    last_entry_id = _waited(results.last_entry_id)
    latest_entry_ids = _waited(results.latest_entry_ids)
    results_at = _waited(results.results_at)
    published_snapshot = _waited(results.published_snapshot)

    def follow_published(self, run: str) -> Iterator[Result]:
        """``run``'s results as they are published (pub/sub: at-most-once), until closed."""
        return results.follow_published(self.redis, run)

    # a run (``runs``)
    run_names = _waited(runs.run_names)
    exists = _waited(runs.exists)
    counts = _waited(runs.counts)
    is_cancelled = _waited(runs.is_cancelled)
    in_flight = _waited(runs.in_flight)
    job_records = _waited(runs.job_records)
    status_of = _waited(runs.status_of)
    job_state = _waited(runs.job_state)
    status_page = _waited(runs.status_page)
    cancelled_jobs = _waited(runs.cancelled_jobs)
    was_trimmed = _waited(runs.was_trimmed)
    trim_marker = _waited(runs.trim_marker)
    storage_roots = _waited(runs.storage_roots)
    trimmed_statuses = _waited(runs.trimmed_statuses)
    trim = _waited(runs.trim)
    run_keys = _waited(runs.run_keys)
    memory_bytes = _waited(runs.memory_bytes)
    remove_queued = _waited(runs.remove_queued)
    forget_run = _waited(runs.forget_run)

    # consumer groups and their recovery streams (``groups``)
    group_streams = staticmethod(groups.group_streams)
    group_names = _waited(groups.group_names)
    create_group = _waited(groups.create_group)
    read_group = _waited(groups.read_group)
    claim_idle = _waited(groups.claim_idle)
    keep_held = _waited(groups.keep_held)
    held_outside = _waited(groups.held_outside)
    finish = _waited(groups.finish)
    finish_many = _waited(groups.finish_many)
    ack = _waited(groups.ack)
    mark_consumed = _waited(groups.mark_consumed)
    consumed = _waited(groups.consumed)
    group_state = _waited(groups.group_state)
    recovered_marker = _waited(groups.recovered_marker)
    recovery_page = _waited(groups.recovery_page)
    missed_of = _waited(groups.missed_of)
    queue_recovered = _waited(groups.queue_recovered)
    mark_recovered = _waited(groups.mark_recovered)
    take_recovery_lock = _waited(groups.take_recovery_lock)
    release_recovery_lock = _waited(groups.release_recovery_lock)

    def statuses(self, run: str) -> Iterator[tuple[str, str]]:
        """``(job id, status)`` of every job of ``run`` with a final status (:meth:`status_page`s)."""
        cursor = 0
        while True:
            cursor, page = self.status_page(run, cursor)
            yield from page
            if not cursor:
                return

    def recovery_jobs(self, run: str, group: str) -> Iterator[str]:
        """The job ids queued on ``group``'s recovery stream so far (:meth:`recovery_page`s)."""
        after: str | None = "-"
        while after is not None:
            jobs, after = self.recovery_page(run, group, after)
            yield from jobs

    # a run's certificate and the capture index (``certificate``)
    note_sample_waiting = _waited(certificate.note_sample_waiting)
    record_sample = _waited(certificate.record_sample)
    drop_sample_waiting = _waited(certificate.drop_sample_waiting)
    run_samples_waiting = _waited(certificate.run_samples_waiting)
    run_samples = _waited(certificate.run_samples)
    run_workers = _waited(certificate.run_workers)
    record_captures = _waited(certificate.record_captures)
    captures = _waited(certificate.captures)
    forget_capture = _waited(certificate.forget_capture)
