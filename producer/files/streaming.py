"""Training from a live run: a PyTorch ``IterableDataset`` over the run's results stream.

:class:`StreamingHiddenStatesDataset` yields the items of ``HiddenStatesDataset`` (same keys,
same :func:`~producer.files.dataset.collate`) as the worker publishes them, so a trainer can run
beside the extraction and, with ``delete_after``, each file lives only until it is trained on.

Protocol, per consumer (one per DataLoader worker of each torch.distributed rank, named
``<consumer>.r<rank>.w<worker>``), over one Redis consumer group ``group`` on
``keys.results_stream(run)`` (created at the stream's start if missing):

1. it first re-reads the entries the group still holds for its own name (a trainer restarted
   with the same group and consumer names continues where it stopped), then takes new ones
   (``XREADGROUP >``, ``read_count`` at a time), and every ``claim_idle_s / 2`` takes over the
   entries another consumer has held for ``claim_idle_s`` (``XAUTOCLAIM``): that consumer is
   dead, as a live one resets the idle time of every entry it holds from a heartbeat thread
   (``XCLAIM ... JUSTID``) every ``claim_idle_s / 4``;
2. an ok result's file is loaded (shared lock; checksums with ``verify``) into a shuffle buffer
   of ``shuffle_buffer`` items (a random one is yielded when it is full, or when no new result
   came within ``block_ms``, so a buffer larger than the in-flight limit cannot stall);
3. when the next item is asked for, the yielded item is finished: its file and lock are
   removed (``delete_after``), then in one step (a Lua script) the entry is acknowledged
   (``XACK``) and the job is recorded in the group's ``keys.run_consumed_hash`` (what the
   enqueue's back-pressure with ``--inflight-until consumed --consumer-group G`` counts);
4. an error result is acknowledged, recorded as consumed (unless the job was sent again
   since: its status is no longer ``error``) and counted; a result of a job the group already
   consumed ok, or held in this consumer's buffer, is acknowledged and counted as a duplicate (with
   ``delete_after`` the file a re-run wrote again is removed); an ok result whose file is gone
   or damaged is acknowledged and counted (a damaged file is left for ``layertap inspect``);
5. it stops when the run is complete: sealed (the enqueue that feeds it has sent its last row,
   ``keys.run_sealed_key``; ``wait_for_seal=False`` skips this for runs submitted whole),
   every submitted job has a final result, nothing new is in the stream and no entry of the
   group is held by anyone; or after ``max_items`` items or ``time_limit_s`` seconds (what it
   held then stays with the group for a resume or for the others).

Semantics: **at least once**. Every ok job is yielded by some consumer; a job is yielded twice
only when a consumer died (or the loop was left) after yielding an item and before finishing
it, or when two result entries of one job (a redelivered job) are taken at the same time by
two consumers. A DataLoader worker finishes an item once it has passed it to the main process
and asks for the next, so a crashed trainer loses at most its prefetched batches. One pass
only: ``epochs`` must be 1 (a stream is not replayed; iterating again continues the group).
With ``delete_after`` the files are gone once trained on (only a job's own file under
``settings.storage_root`` is removed: a result naming any other path leaves it, with a warning);
a consumer killed after removing a file and before acknowledging it leaves an entry whose file
is missing (counted, skipped).
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import redis
import torch
from pydantic import ValidationError
from safetensors import SafetensorError

from producer.client.results import entry_result
from producer.files.dataset import collate, load_item
from producer.files.reader import cleanup_hidden_states
from producer.protocol import keys
from producer.protocol.fileformat import FileFormatError
from producer.protocol.naming import check_name, file_under_root
from producer.protocol.schema import Status
from producer.settings import Settings
from producer.transport.redis_conn import connect, retrying

log = logging.getLogger(__name__)

#: Seconds a consumer waits out an unreachable Redis (a restart) before it raises.
REDIS_GIVE_UP_S = 300.0

#: KEYS: stream, consumed hash, status hash. ARGV: group, entry id, job id, "error"|"ok".
#: Acknowledge the entry and record the job as consumed with its status; an error only while
#: it is still the job's status (an enqueue that sent the job again cleared it).
_FINISH = """
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
if ARGV[4] == 'ok' or redis.call('HGET', KEYS[3], ARGV[3]) == 'error' then
  redis.call('HSET', KEYS[2], ARGV[3], ARGV[4])
end
"""


@dataclass
class StreamCounts:
    """What one consumer did with the entries it took."""

    yielded: int = 0
    errors: int = 0  # error results, skipped
    duplicates: int = 0  # results of a job already consumed (or in this consumer's buffer)
    missing: int = 0  # ok results whose file is gone
    damaged: int = 0  # ok results whose file does not load
    claimed: int = 0  # entries taken over from a dead consumer


def current_rank() -> int:
    """This process's torch.distributed rank (0 when not distributed)."""
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    return torch.distributed.get_rank() if distributed else 0


class StreamingHiddenStatesDataset(torch.utils.data.IterableDataset):
    """The ok files of ``run`` as training items, in one pass as they are written (module doc)."""

    collate = staticmethod(collate)

    def __init__(self, run: str, *, group: str = keys.DEFAULT_CONSUMER_GROUP, consumer: str = "trainer",
                 redis_url: str | None = None, settings: Settings | None = None,
                 layers: Sequence[int] | None = None, dtype: Any = None,
                 max_length: int | None = None, verify: bool = True, delete_after: bool = False,
                 shuffle_buffer: int = 0, seed: int = 0, epochs: int = 1, max_items: int | None = None,
                 time_limit_s: float | None = None, wait_for_seal: bool = True, claim_idle_s: float = 60.0,
                 read_count: int = 16, block_ms: int = 200):
        if epochs != 1:
            raise ValueError("a stream is one pass: epochs must be 1 (run the stream again into a new group, "
                             "or train offline from a manifest, for more)")
        settings = settings or Settings()
        self.settings = settings if redis_url is None else settings.model_copy(update={"redis_url": redis_url})
        self.run, self.group = check_name(run, "run"), check_name(group, "consumer group")
        self.consumer = check_name(consumer, "consumer")
        self.layers = list(layers) if layers is not None else None
        self.dtype, self.max_length, self.verify, self.delete_after = dtype, max_length, verify, delete_after
        self.shuffle_buffer, self.seed = shuffle_buffer, seed
        self.max_items = max_items if max_items is not None else math.inf
        self.time_limit_s = time_limit_s if time_limit_s is not None else math.inf
        self.wait_for_seal, self.claim_idle_s = wait_for_seal, claim_idle_s
        self.read_count, self.block_ms = read_count, block_ms
        self.counts = StreamCounts()

    def consumer_name(self) -> str:
        """This process's consumer name in the group: ``<consumer>.r<rank>.w<DataLoader worker>``."""
        info = torch.utils.data.get_worker_info()
        return f"{self.consumer}.r{current_rank()}.w{info.id if info is not None else 0}"

    def __iter__(self) -> Iterator[dict[str, Any]]:
        stream = _Consumer(self, self.consumer_name())
        try:
            yield from stream.items()
        finally:
            stream.close()
            log.info("consumer %s of run %s: %s", stream.name, self.run, self.counts)


class _Heartbeat(threading.Thread):
    """Resets the idle time of the entries a live consumer holds, so that only a dead one's are claimed."""

    def __init__(self, client: redis.Redis, stream: str, group: str, name: str, every_s: float):
        super().__init__(daemon=True, name=f"layertap-heartbeat-{name}")
        self.redis, self.stream, self.group, self.consumer, self.every_s = client, stream, group, name, every_s
        self.held: set[str] = set()
        self.lock = threading.Lock()
        self.stopped = threading.Event()

    def hold(self, entry_id: str) -> None:
        with self.lock:
            self.held.add(entry_id)

    def release(self, entry_id: str) -> None:
        with self.lock:
            self.held.discard(entry_id)

    def run(self) -> None:
        while not self.stopped.wait(self.every_s):
            with self.lock:
                ids = sorted(self.held)
            if ids:
                try:
                    self.redis.xclaim(self.stream, self.group, self.consumer, min_idle_time=0, message_ids=ids,
                                      justid=True)
                except redis.exceptions.RedisError as exc:  # Redis restarting: the next beat retries
                    log.warning("heartbeat of %s failed: %s", self.consumer, exc)


class _Consumer:
    """One consumer's pass over the group (the module doc's protocol)."""

    def __init__(self, dataset: StreamingHiddenStatesDataset, name: str):
        self.ds, self.name, self.counts = dataset, name, dataset.counts
        self.stream = keys.results_stream(dataset.run)
        self.consumed_hash = keys.run_consumed_hash(dataset.run, dataset.group)
        self.redis = connect(dataset.settings, decode_responses=True)
        retrying(self._create_group, REDIS_GIVE_UP_S)
        self.finish_script = self.redis.register_script(_FINISH)
        self.heartbeat = _Heartbeat(connect(dataset.settings, decode_responses=True), self.stream, dataset.group,
                                    name, dataset.claim_idle_s / 4)
        self.heartbeat.start()
        self.rng = random.Random(f"{dataset.seed}:{name}")
        self.buffer: list[tuple[str, str, str, dict[str, Any]]] = []  # entry id, job id, path, item
        self.buffered_jobs: set[str] = set()
        self.history_cursor: str | None = "0"  # own pending entries first; None once read
        self.claim_cursor, self.next_claim = "0-0", time.monotonic() + dataset.claim_idle_s / 2

    def _create_group(self) -> None:
        try:
            self.redis.xgroup_create(self.stream, self.ds.group, id="0", mkstream=True)
        except redis.exceptions.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def close(self) -> None:
        self.heartbeat.stopped.set()
        self.heartbeat.join()
        self.heartbeat.redis.close()
        self.redis.close()

    def items(self) -> Iterator[dict[str, Any]]:
        ds, deadline = self.ds, time.monotonic() + self.ds.time_limit_s
        while self.counts.yielded < ds.max_items and time.monotonic() < deadline:
            complete = retrying(self._run_complete, REDIS_GIVE_UP_S)
            entries = retrying(lambda: self._next_entries(block=not complete), REDIS_GIVE_UP_S)
            for entry_id, fields in entries:
                if self._take(entry_id, fields) and len(self.buffer) >= max(1, ds.shuffle_buffer):
                    yield from self._emit()
                    if self.counts.yielded >= ds.max_items or time.monotonic() >= deadline:
                        return
            if entries:
                continue
            if self.buffer:
                yield from self._emit()
            elif complete and retrying(self._nothing_held, REDIS_GIVE_UP_S):
                return
            elif complete:  # others still hold entries: wait for them, or claim them once idle
                time.sleep(ds.block_ms / 1000)

    def _nothing_held(self) -> bool:
        """No consumer of the group holds an entry."""
        return self.redis.xpending(self.stream, self.ds.group)["pending"] == 0

    def _run_complete(self) -> bool:
        """Sealed (unless not waited for) and every submitted job has a final result."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.exists(keys.run_sealed_key(self.ds.run))
        pipe.hlen(keys.run_submitted_hash(self.ds.run))
        pipe.hlen(keys.run_status_hash(self.ds.run))
        sealed, submitted, final = pipe.execute()
        if not self.ds.wait_for_seal:
            return submitted > 0 and final >= submitted
        return bool(sealed) and final >= submitted

    def _next_entries(self, block: bool) -> list[tuple[str, dict[str, str] | None]]:
        """Own pending entries, else entries claimed from a dead consumer (when due), else new ones."""
        ds = self.ds
        if self.history_cursor is not None:
            got = self.redis.xreadgroup(ds.group, self.name, {self.stream: self.history_cursor}, count=ds.read_count)
            entries = got[0][1] if got else []
            if entries:
                self.history_cursor = entries[-1][0]
                return self._held(entries)
            self.history_cursor = None
        if time.monotonic() >= self.next_claim:
            self.next_claim = time.monotonic() + ds.claim_idle_s / 2
            reply = self.redis.xautoclaim(self.stream, ds.group, self.name, min_idle_time=int(ds.claim_idle_s * 1000),
                                          start_id=self.claim_cursor, count=ds.read_count)
            self.claim_cursor, claimed = reply[0], reply[1]
            if self.claim_cursor != "0-0":
                self.next_claim = time.monotonic()  # more to look at: carry on next time
            if claimed:
                self.counts.claimed += len(claimed)
                log.warning("consumer %s took over %d entries idle for %.0fs", self.name, len(claimed),
                            ds.claim_idle_s)
                return self._held(claimed)
        got = self.redis.xreadgroup(ds.group, self.name, {self.stream: ">"}, count=ds.read_count,
                                    block=ds.block_ms if block else None)
        return self._held(got[0][1] if got else [])

    def _held(self, entries: list[Any]) -> list[tuple[str, dict[str, str] | None]]:
        for entry_id, _ in entries:
            self.heartbeat.hold(entry_id)
        return entries

    def _take(self, entry_id: str, fields: dict[str, str] | None) -> bool:
        """Load an entry's item into the buffer (True), or finish the entry without one (False)."""
        try:
            result = entry_result(fields or {})
        except (KeyError, ValidationError) as exc:  # trimmed away, or not a result: nothing to train on
            log.warning("entry %s of %s is not a result (%s); skipped", entry_id, self.stream, exc)
            self._ack(entry_id)
            return False
        if result.status is Status.error:
            self.counts.errors += 1
            self._finish(entry_id, result.job_id, Status.error)
            return False
        if result.job_id in self.buffered_jobs or retrying(lambda: self.redis.hget(self.consumed_hash, result.job_id),
                                                           REDIS_GIVE_UP_S) == "ok":
            self.counts.duplicates += 1
            if self.ds.delete_after and result.job_id not in self.buffered_jobs and result.path:
                self._delete(result.job_id, result.path)  # a re-run of a consumed job wrote its file again
            self._ack(entry_id)
            return False
        missing = [layer for layer in self.ds.layers or [] if layer not in (result.layers or [])]
        if missing:
            raise ValueError(f"job {result.job_id} has layers {result.layers}, not {missing}")
        try:
            item = load_item(result.job_id, result.path or "", result.layers or [], layers=self.ds.layers,
                             dtype=self.ds.dtype, max_length=self.ds.max_length, verify=self.ds.verify)
        except FileNotFoundError:
            self.counts.missing += 1
            log.warning("job %s: its file %s is gone; skipped", result.job_id, result.path)
            self._finish(entry_id, result.job_id, Status.ok)
            return False
        except (FileFormatError, SafetensorError, OSError) as exc:
            self.counts.damaged += 1
            log.warning("job %s: its file does not load (%s); skipped", result.job_id, exc)
            self._finish(entry_id, result.job_id, Status.ok)
            return False
        self.buffer.append((entry_id, result.job_id, result.path or "", item))
        self.buffered_jobs.add(result.job_id)
        return True

    def _emit(self) -> Iterator[dict[str, Any]]:
        """Yield one buffered item (a random one with a shuffle buffer), then finish it."""
        if self.ds.shuffle_buffer > 1:
            index = self.rng.randrange(len(self.buffer))
            self.buffer[index], self.buffer[-1] = self.buffer[-1], self.buffer[index]
        entry_id, job_id, path, item = self.buffer.pop() if self.ds.shuffle_buffer > 1 else self.buffer.pop(0)
        yield item
        self.counts.yielded += 1
        if self.ds.delete_after:
            self._delete(job_id, path)
        self._finish(entry_id, job_id, Status.ok)
        self.buffered_jobs.discard(job_id)

    def _delete(self, job_id: str, path: str) -> None:
        """Remove the job's file, only if ``path`` is that file under the storage root (a result
        entry is data anyone who can write to Redis could forge)."""
        own = file_under_root(path, self.ds.settings.storage_root, self.ds.run, job_id)
        if own is None:
            log.warning("job %s: %s is not its file under the storage root %s; not deleted",
                        job_id, path, self.ds.settings.storage_root)
        else:
            cleanup_hidden_states(own)

    def _finish(self, entry_id: str, job_id: str, status: Status) -> None:
        """Acknowledge the entry and record the job as consumed (see ``_FINISH``)."""
        retrying(lambda: self.finish_script(keys=[self.stream, self.consumed_hash, keys.run_status_hash(self.ds.run)],
                                            args=[self.ds.group, entry_id, job_id, status.value]), REDIS_GIVE_UP_S)
        self.heartbeat.release(entry_id)

    def _ack(self, entry_id: str) -> None:
        retrying(lambda: self.redis.xack(self.stream, self.ds.group, entry_id), REDIS_GIVE_UP_S)
        self.heartbeat.release(entry_id)
