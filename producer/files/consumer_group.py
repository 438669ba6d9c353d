"""One consumer of a run's consumer group, torch-free: what a streaming trainer reads, claims
and acknowledges (``layertap.producer.files.streaming`` builds its dataset on it; the module doc there
gives the whole protocol).

A :class:`GroupReader` reads, through group ``group``, the run's results stream and the group's
recovery stream (each created at its start if missing): first the entries the group still holds
for its own name, then new ones (``XREADGROUP >``), and every ``claim_idle_s / 2`` the entries
another consumer has held for ``claim_idle_s`` (``XAUTOCLAIM``: a live consumer's heartbeat,
``stream_group.Heartbeat``, resets their idle time). It queues what the group missed from the
run's ledger once per trim (``layertap.producer.client.recovery.fill``), says when the run is complete
or stalled, and finishes entries (``stream_group.GroupFinisher``). Its Redis reads and changes
are the run ledger's (``layertap.transport.ledger``), which waits Redis out for
``stream_group.REDIS_GIVE_UP_S``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from layertap.producer.client import recovery
from layertap.producer.client.results import entry_result
from layertap.producer.files.stream_group import REDIS_GIVE_UP_S, GroupFinisher, Heartbeat
from layertap.protocol import keys
from layertap.protocol.schema import Result, Status
from layertap.settings import Settings
from layertap.transport.ledger import Ledger
from layertap.transport.redis_conn import connect

log = logging.getLogger(__name__)

#: An entry as read: (stream, entry id, fields; None for an entry deleted since it was delivered).
Entry = tuple[str, str, dict[str, str] | None]


@dataclass
class StreamCounts:
    """What one consumer did with the entries it took."""

    yielded: int = 0
    errors: int = 0  # error results, skipped
    duplicates: int = 0  # results of a job already consumed (or in this consumer's buffer)
    missing: int = 0  # ok results whose file is gone
    damaged: int = 0  # ok results whose file does not load
    foreign: int = 0  # ok results naming a path that is not the job's own file in this run (forged)
    claimed: int = 0  # entries taken over from a dead consumer
    recovered: int = 0  # jobs this consumer queued from the ledger (trimmed before the group read them)
    unrecoverable: int = 0  # of those, ok jobs whose file is gone (also counted in ``missing`` when taken)


@dataclass
class RunState:
    """The run as ``group`` sees it (:meth:`GroupReader.run_state`); a stalled run needs the jobs the group missed
    queued from the ledger (:meth:`GroupReader.recover`)."""

    complete: bool  # sealed (unless not waited for) and every submitted job has a final result
    stalled: bool  # every submitted job is final and the group consumed fewer


@dataclass(frozen=True)
class GroupOptions:
    """How a consumer reads: ``read_count`` entries at a time, waiting ``block_ms`` for new ones;
    takes over entries idle ``claim_idle_s``; stops only on a sealed run unless not ``wait_for_seal``."""

    group: str
    wait_for_seal: bool = True
    claim_idle_s: float = 60.0
    read_count: int = 16
    block_ms: int = 200
    delete_after: bool = False


class GroupReader:
    """Consumer ``name`` (of a trainer whose consumers are ``peers``) of ``run``'s group (module doc)."""

    def __init__(self, settings: Settings, run: str, name: str, peers: set[str], options: GroupOptions,
                 counts: StreamCounts):
        self.run, self.name, self.peers, self.options, self.counts = run, name, peers, options, counts
        self.group = options.group
        self.streams = self.results_stream, self.recovery_stream = Ledger.group_streams(run, self.group)
        self.redis = connect(settings, decode_responses=True)
        self.ledger = Ledger(self.redis, REDIS_GIVE_UP_S)
        for stream in self.streams:
            self.ledger.create_group(stream, self.group)
        self.finisher = GroupFinisher(self.ledger, run, self.group, delete_after=options.delete_after,
                                      storage=settings.storage())
        self.heartbeat = Heartbeat(connect(settings, decode_responses=True), self.group, name, options.claim_idle_s / 4)
        self.heartbeat.start()
        self.history: dict[str, str] = dict.fromkeys(self.streams, "0")  # own pending entries first
        self.claim_cursors = dict.fromkeys(self.streams, "0-0")
        self.next_claim = time.monotonic() + options.claim_idle_s / 2
        self.recovered_through: str | None = None  # the trim marker of this consumer's last fill
        self.next_recovery = 0.0

    def close(self) -> None:
        self.heartbeat.close()
        self.redis.close()

    def recover(self) -> bool:
        """Queue what the group missed (``recovery.fill``) once per trim of the stream; True when
        there is something to look at again (jobs queued, or another consumer is queuing)."""
        marker = self.ledger.trim_marker(self.run)
        if marker is None or marker == self.recovered_through:
            return False
        self.next_recovery = time.monotonic() + self.options.claim_idle_s / 2
        found = recovery.fill(self.ledger, self.run, self.group)
        if found is None:
            return True
        self.recovered_through = marker
        self.counts.recovered += found.queued
        self.counts.unrecoverable += len(found.without_file)
        return found.queued > 0

    def recovery_due(self) -> bool:
        return time.monotonic() >= self.next_recovery

    def held_elsewhere(self) -> bool:
        """A consumer of the group outside this trainer holds an entry."""
        return self.ledger.held_outside(self.streams, self.group, self.peers)

    def run_state(self) -> RunState:
        sealed, submitted, final, consumed = self.ledger.group_state(self.run, self.group)
        all_final = submitted > 0 and final >= submitted
        return RunState(complete=all_final and (bool(sealed) or not self.options.wait_for_seal),
                        stalled=all_final and consumed < final)

    def next_entries(self, block: bool) -> list[Entry]:
        """Own pending entries, else entries claimed from a dead consumer (when due), else new ones."""
        options = self.options
        if self.history:
            got = self.ledger.read_group(self.group, self.name, self.history, options.read_count)
            entries = self._entries(got)
            for stream, stream_entries in got or []:
                if stream_entries:
                    self.history[stream] = stream_entries[-1][0]
                else:
                    self.history.pop(stream, None)
            if entries:
                return entries
        if time.monotonic() >= self.next_claim:
            claimed = self._claim()
            if claimed:
                return claimed
        got = self.ledger.read_group(self.group, self.name, dict.fromkeys(self.streams, ">"), options.read_count,
                                     options.block_ms if block else None)
        return self._entries(got)

    def _claim(self) -> list[Entry]:
        options = self.options
        self.next_claim = time.monotonic() + options.claim_idle_s / 2
        claimed = []
        for stream in self.streams:
            reply = self.ledger.claim_idle(stream, self.group, self.name, int(options.claim_idle_s * 1000),
                                           self.claim_cursors[stream], options.read_count)
            self.claim_cursors[stream] = reply[0]
            if reply[0] != "0-0":
                self.next_claim = time.monotonic()  # more to look at: carry on next time
            claimed += self._entries([(stream, reply[1])])
        if claimed:
            self.counts.claimed += len(claimed)
            log.warning("consumer %s took over %d entries idle for %.0fs", self.name, len(claimed),
                        options.claim_idle_s)
        return claimed

    def _entries(self, got: list[Any] | None) -> list[Entry]:
        """The entries of an XREADGROUP/XAUTOCLAIM reply as (stream, entry id, fields), now held."""
        entries = [(keys.as_text(stream), entry_id, fields) for stream, stream_entries in got or []
                   for entry_id, fields in stream_entries]
        for stream, entry_id, _ in entries:
            self.heartbeat.hold(stream, entry_id)
        return entries

    def result(self, stream: str, entry_id: str, fields: dict[str, str] | None) -> Result | None:
        """The entry's result (a recovery entry's from the ledger); None when there is none to take."""
        try:
            if stream == self.recovery_stream:
                return recovery.recovered_result(self.ledger, self.run, (fields or {})[keys.RECOVERY_JOB_FIELD])
            return entry_result(fields or {})
        except (KeyError, ValidationError) as exc:  # trimmed away, or not a result: nothing to train on
            log.warning("entry %s of %s is not a result (%s); skipped", entry_id, stream, exc)
            return None

    def consumed(self, job_id: str) -> str | None:
        """How the group consumed ``job_id`` so far (``ok``, ``error``), or None."""
        return self.ledger.consumed(self.run, self.group, job_id)

    def finish(self, stream: str, entry_id: str, job_id: str, status: Status) -> None:
        """Acknowledge an entry with nothing to train on, recording its job as consumed; no longer held."""
        self.finisher.finish(stream, entry_id, job_id, status)
        self.heartbeat.release(stream, entry_id)

    def ack(self, stream: str, entry_id: str) -> None:
        """Acknowledge an entry that is not a job to consume (or a duplicate); no longer held."""
        self.ledger.ack(stream, self.group, entry_id)
        self.heartbeat.release(stream, entry_id)
