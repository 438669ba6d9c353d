"""Training from a live run: a PyTorch ``IterableDataset`` over the run's results stream.

:class:`StreamingHiddenStatesDataset` yields the items of ``HiddenStatesDataset`` (same keys,
same :func:`~layertap.producer.files.dataset.collate`) as the worker publishes them, so a trainer can run
beside the extraction and, with ``delete_after``, each file lives only until it is trained on.
With DataLoader workers, iterate :meth:`StreamingHiddenStatesDataset.loader` (a DataLoader whose
main process finishes each batch once it is trained on).

The group's reading, claiming and acknowledging is torch-free, in
``layertap.producer.files.consumer_group.GroupReader``; this module adds loading files, the shuffle
buffer and the DataLoader. Protocol, per consumer (one per DataLoader worker of each torch.distributed rank, named
``<consumer>.r<rank>.w<worker>``), over one Redis consumer group ``group`` on two streams: the
run's results stream ``keys.results_stream(run)`` and the group's recovery stream
``keys.run_recovery_stream(run, group)`` (each created at its start if missing):

1. it first re-reads the entries the group still holds for its own name (a trainer restarted
   with the same group and consumer names continues where it stopped), then takes new ones
   (``XREADGROUP >``, ``read_count`` at a time), and every ``claim_idle_s / 2`` takes over the
   entries another consumer has held for ``claim_idle_s`` (``XAUTOCLAIM``): that consumer is
   dead, as a live one resets the idle time of every entry it holds from a heartbeat thread
   (``XCLAIM ... JUSTID``) every ``claim_idle_s / 4``;
2. the retention protects only groups that exist: when the results stream was trimmed
   (``keys.run_trimmed_key``) it queues the jobs its group missed on the recovery stream from
   the run's ledger (``layertap.producer.client.recovery.fill``: at its start, when the run is complete,
   and when every submitted job is final and the group has consumed fewer; an enqueue waiting
   with ``--inflight-until consumed`` for jobs whose entries were trimmed is stalled so), and
   logs at once, as an error, the count of ok jobs whose file is gone;
3. an ok result's file is loaded (shared lock; checksums with ``verify``) into a shuffle buffer
   of ``shuffle_buffer`` items (a random one is yielded when it is full, or when no new result
   came within ``block_ms``, so a buffer larger than the in-flight limit cannot stall);
4. a yielded item is finished once trained on: its file and lock are removed
   (``delete_after``), then in one step the entry is acknowledged and the job recorded in the
   group's ``keys.run_consumed_hash`` (the run ledger's ``finish``; what the enqueue's back-pressure
   with ``--inflight-until consumed --consumer-group G`` counts). "Trained on" means: asked for
   the next item, in the process that trains; under :meth:`~StreamingHiddenStatesDataset.loader`
   the main process finishes a batch when the next batch is asked for (the DataLoader worker
   keeps the entries alive until then); a plain DataLoader's worker finishes an item when it
   fetches the next one for a batch, which is before the main process trains it;
5. an error result is acknowledged, recorded as consumed (unless the job was sent again
   since: its status is no longer ``error``) and counted; a result of a job the group already
   consumed ok, or held in this consumer's buffer, is acknowledged and counted as a duplicate (with
   ``delete_after`` the file a re-run wrote again is removed); an ok result whose file is gone
   or damaged (any header problem: ``FileFormatError``) is acknowledged and counted (a damaged
   file is left for ``layertap inspect``); an ok result whose path is not the job's own file in
   this run under the trainer's own storage roots (``storage.registry.own_file``: a forged entry
   naming another run's file, a file under another root or a ``..`` path) is acknowledged (its
   job not recorded as consumed), counted ``foreign`` and logged;
6. it stops when the run is complete: sealed (the enqueue that feeds it has sent its last row,
   ``keys.run_sealed_key``; ``wait_for_seal=False`` skips this for runs submitted whole),
   every submitted job has a final result, nothing new is in either stream and no consumer of
   the group outside this trainer (its peers: :func:`~layertap.producer.files.stream_group.peer_names`)
   holds an entry (a peer finishes its own); or after ``max_items`` items or ``time_limit_s``
   seconds (what it held then stays with the group for a resume or for the others).

Semantics: **at least once** (under ``loader()``, or without DataLoader workers). Every ok job
whose file exists is yielded by some consumer; a job is yielded twice only when a trainer died
(or its loop was left) after an item was yielded and before it was finished, or when two result
entries of one job (a redelivered job) are taken at the same time by two consumers. One pass
only: ``epochs`` must be 1 (a stream is not replayed; iterating again continues the group).
With ``delete_after`` the files are gone once trained on (only a job's own file under
``settings.storage_root`` is removed: a result naming any other path leaves it, with a warning);
a trainer killed after removing a
file and before acknowledging it leaves an entry whose file is missing (counted, skipped).

Counts (``dataset.counts``, :class:`StreamCounts`): each consumer counts what it did. Under
``loader()`` with DataLoader workers, every item carries its consumer's counts to the main process,
which sums the latest of each consumer into ``dataset.counts`` as batches arrive (a consumer
that yields nothing is not counted there; its log line says what it did). A plain DataLoader's
workers keep their counts to themselves.
"""

from __future__ import annotations

import copy
import logging
import math
import random
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from safetensors import SafetensorError

from layertap.producer.files.consumer_group import GroupOptions, GroupReader
from layertap.producer.files.consumer_group import StreamCounts as StreamCounts  # the public name, kept here
from layertap.producer.files.dataset import collate, load_item
from layertap.producer.files.stream_group import REDIS_GIVE_UP_S, GroupFinisher, Taken, peer_names
from layertap.protocol import keys
from layertap.protocol.fileformat import FileFormatError
from layertap.protocol.naming import check_name
from layertap.protocol.schema import Result, Status
from layertap.settings import Settings
from layertap.storage.registry import foreign_path, own_file, storage_at
from layertap.transport.ledger import Ledger
from layertap.transport.redis_conn import connect

log = logging.getLogger(__name__)

#: The item key that carries a yielded item's entry to the main process under ``loader()``.
TAKEN_KEY = "_layertap_taken"
#: The item key that carries its consumer's name and counts to the main process under ``loader()``.
COUNTS_KEY = "_layertap_counts"


def current_rank() -> int:
    """This process's torch.distributed rank (0 when not distributed)."""
    return torch.distributed.get_rank() if _distributed() else 0


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


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
        self.finished_by_loader = False  # set on the copy a StreamingLoader iterates

    def consumer_name(self) -> str:
        """This process's consumer name in the group: ``<consumer>.r<rank>.w<DataLoader worker>``."""
        info = torch.utils.data.get_worker_info()
        return f"{self.consumer}.r{current_rank()}.w{info.id if info is not None else 0}"

    def peers(self) -> set[str]:
        """The consumer names of this trainer (every DataLoader worker of every rank)."""
        info = torch.utils.data.get_worker_info()
        world = torch.distributed.get_world_size() if _distributed() else 1
        return peer_names(self.consumer, world, info.num_workers if info is not None else 1)

    def loader(self, **dataloader_options: Any) -> StreamingLoader:
        """A DataLoader over this dataset (``dataloader_options`` as DataLoader's; ``collate_fn``
        defaults to :func:`collate`) whose main process finishes each batch's entries when the
        next batch is asked for: at least once with any number of DataLoader workers."""
        return StreamingLoader(self, **dataloader_options)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if torch.utils.data.get_worker_info() is not None and not self.finished_by_loader:
            log.warning("run %s: a plain DataLoader's workers finish (acknowledge%s) each item before the main "
                        "process trains it, so a killed trainer loses its prefetched batches; iterate "
                        "dataset.loader(...) instead for at-least-once", self.run,
                        ", and delete," if self.delete_after else "")
        stream = _Consumer(self, self.consumer_name(), self.peers())
        try:
            yield from stream.items()
        finally:
            stream.close()
            log.info("consumer %s of run %s: %s", stream.name, self.run, self.counts)


class _KeepTaken:
    """A collate_fn that takes the entries and the consumers' counts out of a batch's items:
    ``(taken, {consumer: counts}, collate_fn(items))``."""

    def __init__(self, collate_fn: Callable[[list[dict[str, Any]]], Any]):
        self.collate_fn = collate_fn

    def __call__(self, items: list[dict[str, Any]]) -> tuple[list[Taken], dict[str, dict[str, int]], Any]:
        taken = [Taken(*item.pop(TAKEN_KEY)) for item in items]
        counts = dict(item.pop(COUNTS_KEY) for item in items)  # each consumer's latest
        return taken, counts, self.collate_fn(items)


class StreamingLoader:
    """Batches of a :class:`StreamingHiddenStatesDataset` from a DataLoader; a batch's entries are
    finished (files removed with ``delete_after``, acknowledged, recorded as consumed) in this
    process when the next batch is asked for, i.e. after the loop trained on it. A loop left
    early, or a trainer killed, leaves its last batch (and the prefetched ones) with the group."""

    def __init__(self, dataset: StreamingHiddenStatesDataset, **dataloader_options: Any):
        self.dataset = copy.copy(dataset)
        self.dataset.finished_by_loader = True
        collate_fn = dataloader_options.pop("collate_fn", None) or dataset.collate
        self.dataloader = torch.utils.data.DataLoader(self.dataset, collate_fn=_KeepTaken(collate_fn),
                                                      **dataloader_options)
        self.finished = 0  # items finished by this process
        self._counts: dict[str, dict[str, int]] = {}  # consumer -> its latest counts

    def __iter__(self) -> Iterator[Any]:
        ds = self.dataset
        client = connect(ds.settings, decode_responses=True)
        finisher = GroupFinisher(Ledger(client, REDIS_GIVE_UP_S), ds.run, ds.group, delete_after=ds.delete_after,
                                 storage=ds.settings.storage())
        try:
            for taken, counts, batch in self.dataloader:
                self._counts.update(counts)
                for name in vars(ds.counts):  # the dataset's counts (shared with the one it was made from)
                    setattr(ds.counts, name, sum(consumer[name] for consumer in self._counts.values()))
                yield batch
                finisher.finish_trained(taken)
                self.finished += len(taken)
        finally:
            client.close()


class _Consumer:
    """One consumer's pass over the group (the module doc's protocol): the group's reading is
    :class:`~layertap.producer.files.consumer_group.GroupReader`'s; this adds loading, the shuffle buffer
    and when to stop."""

    def __init__(self, dataset: StreamingHiddenStatesDataset, name: str, peers: set[str]):
        self.ds, self.name, self.counts = dataset, name, dataset.counts
        options = GroupOptions(dataset.group, wait_for_seal=dataset.wait_for_seal, claim_idle_s=dataset.claim_idle_s,
                               read_count=dataset.read_count, block_ms=dataset.block_ms,
                               delete_after=dataset.delete_after)
        self.reader = GroupReader(dataset.settings, dataset.run, name, peers, options, dataset.counts)
        self.finisher = self.reader.finisher
        self.roots = dataset.settings.reading_storages()  # where this trainer takes files from, whatever results name
        self.rng = random.Random(f"{dataset.seed}:{name}")
        self.buffer: list[tuple[Taken, dict[str, Any]]] = []
        self.buffered_jobs: set[str] = set()

    def close(self) -> None:
        self.reader.close()

    def items(self) -> Iterator[dict[str, Any]]:
        ds, reader, deadline = self.ds, self.reader, time.monotonic() + self.ds.time_limit_s
        reader.recover()  # the reader's ledger waits Redis out (stream_group.REDIS_GIVE_UP_S)
        while self.counts.yielded < ds.max_items and time.monotonic() < deadline:
            state = reader.run_state()
            entries = reader.next_entries(block=not state.complete)
            for stream, entry_id, fields in entries:
                if self._take(stream, entry_id, fields) and len(self.buffer) >= max(1, ds.shuffle_buffer):
                    yield from self._emit()
                    if self.counts.yielded >= ds.max_items or time.monotonic() >= deadline:
                        return
            if entries:
                continue
            if self.buffer:
                yield from self._emit()
            elif state.complete:
                if reader.recover():
                    time.sleep(ds.block_ms / 1000)  # queued jobs to read, or another consumer is queuing them
                elif not reader.held_elsewhere():
                    return
                else:  # a consumer outside this trainer holds entries: wait, or take them over once idle
                    time.sleep(ds.block_ms / 1000)
            elif state.stalled and reader.recovery_due():
                reader.recover()

    def _take(self, stream: str, entry_id: str, fields: dict[str, str] | None) -> bool:
        """Load an entry's item into the buffer (True), or finish the entry without one (False)."""
        result = self.reader.result(stream, entry_id, fields)
        if result is None:
            self.reader.ack(stream, entry_id)
            return False
        if result.status is Status.error:
            self.counts.errors += 1
            self.reader.finish(stream, entry_id, result.job_id, Status.error)
            return False
        options = self.ds.settings.storage_options
        path = own_file(result.path, self.ds.run, result.job_id, self.roots) if result.path else ""
        if path is None:  # not a result of this run: acknowledged, the job not recorded as consumed
            self.counts.foreign += 1
            log.warning("job %s: %s; skipped", result.job_id, foreign_path(result.path, self.ds.run, self.roots))
            self.reader.ack(stream, entry_id)
            return False
        consumed = self.reader.consumed(result.job_id)
        if result.job_id in self.buffered_jobs or consumed == Status.ok.value:
            self.counts.duplicates += 1
            if self.ds.delete_after and result.job_id not in self.buffered_jobs and path:
                self.finisher.delete(result.job_id, path)  # a re-run of a consumed job wrote its file again
            self.reader.ack(stream, entry_id)
            return False
        if result.layers is None:  # recovered from the ledger, and this process cannot read the file's header
            gone = not path or not storage_at(path, options).exists(path)
            return self._skip(stream, entry_id, result, FileNotFoundError(path) if gone
                              else FileFormatError(f"{path}: its header does not read"))
        missing = [layer for layer in self.ds.layers or [] if layer not in result.layers]
        if missing:
            raise ValueError(f"job {result.job_id} has layers {result.layers}, not {missing}")
        try:
            item = load_item(result.job_id, path, result.layers, layers=self.ds.layers, dtype=self.ds.dtype,
                             max_length=self.ds.max_length, verify=self.ds.verify, storage_options=options)
        except (FileFormatError, SafetensorError, OSError) as exc:
            return self._skip(stream, entry_id, result, exc)
        self.buffer.append((Taken(stream, entry_id, result.job_id, path), item))
        self.buffered_jobs.add(result.job_id)
        return True

    def _skip(self, stream: str, entry_id: str, result: Result, exc: Exception) -> bool:
        """Finish an ok entry whose file is gone (counted missing) or does not load (damaged)."""
        if isinstance(exc, FileNotFoundError):
            self.counts.missing += 1
            log.warning("job %s: its file %s is gone; skipped", result.job_id, result.path)
        else:
            self.counts.damaged += 1
            log.warning("job %s: its file does not load (%s); skipped", result.job_id, exc)
        self.reader.finish(stream, entry_id, result.job_id, Status.ok)
        return False

    def _emit(self) -> Iterator[dict[str, Any]]:
        """Yield one buffered item (a random one with a shuffle buffer), then finish it, or, under
        a StreamingLoader, hand its entry to the main process with it (held until finished there)."""
        if self.ds.shuffle_buffer > 1:
            index = self.rng.randrange(len(self.buffer))
            self.buffer[index], self.buffer[-1] = self.buffer[-1], self.buffer[index]
        taken, item = self.buffer.pop() if self.ds.shuffle_buffer > 1 else self.buffer.pop(0)
        self.buffered_jobs.discard(taken.job_id)
        if self.ds.finished_by_loader:
            self.counts.yielded += 1
            item[TAKEN_KEY], item[COUNTS_KEY] = tuple(taken), (self.name, vars(self.counts).copy())
            yield item
            return
        yield item
        self.counts.yielded += 1
        self.finisher.finish_trained([taken])
        self.reader.heartbeat.release(taken.stream, taken.entry_id)
