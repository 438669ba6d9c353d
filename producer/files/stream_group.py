"""The torch-free parts of a streaming trainer's consumer group (``layertap.producer.files.streaming``):
finishing entries and keeping a live consumer's entries from being taken over.

An entry is named by ``(stream, entry id)``: a consumer reads the run's results stream and its
group's recovery stream (``layertap.producer.client.recovery``) through the same group. Finishing a
trained entry removes its file first (``delete_after``; only the job's own file under the storage
root, since a result entry is data anyone who can write to Redis could forge), then acknowledges the entry and records
the job in the group's consumed hash in one step (the run ledger's ``finish``); any process may finish an entry
(``XACK`` does not care which consumer holds it), so a trainer's main process finishes the
entries its DataLoader workers read.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import NamedTuple

import redis

from layertap.protocol import keys
from layertap.protocol.schema import Status
from layertap.storage.base import Storage
from layertap.transport.ledger import Ledger

log = logging.getLogger(__name__)

#: Seconds a consumer waits out an unreachable Redis (a restart) before it raises.
REDIS_GIVE_UP_S = 300.0

class Taken(NamedTuple):
    """A yielded item's entry: what finishing it needs."""

    stream: str
    entry_id: str
    job_id: str
    path: str


def peer_names(consumer: str, world_size: int, num_workers: int) -> set[str]:
    """The consumer names of one trainer: every DataLoader worker of every rank. They live and die
    together, and each finishes what it holds, so none waits for what another holds."""
    return {f"{consumer}.r{rank}.w{worker}" for rank in range(world_size) for worker in range(max(1, num_workers))}


class GroupFinisher:
    """Finishes entries of ``run``'s consumer group ``group`` (module doc), through ``book`` (a
    ledger that waits Redis out)."""

    def __init__(self, book: Ledger, run: str, group: str, *, delete_after: bool, storage: Storage):
        self.ledger, self.run, self.group, self.delete_after = book, run, group, delete_after
        self.storage = storage

    def finish(self, stream: str, entry_id: str, job_id: str, status: Status) -> None:
        """Acknowledge an entry that yields nothing to train on, recording its job as consumed."""
        self.ledger.finish(stream, self.run, self.group, entry_id, job_id, status)

    def finish_trained(self, taken: Sequence[Taken]) -> None:
        """Finish yielded items once trained on: files first (``delete_after``), then one round trip."""
        if not taken:
            return
        if self.delete_after:
            for item in taken:
                self.delete(item.job_id, item.path)
        self.ledger.finish_many(self.run, self.group, [(item.stream, item.entry_id, item.job_id) for item in taken],
                                Status.ok)

    def delete(self, job_id: str, path: str) -> None:
        """Remove the job's file, only if ``path`` is that file under the storage root."""
        own = self.storage.owned(path, self.run, job_id)
        if own is None:
            log.warning("job %s: %s is not its file under the storage root %s; not deleted",
                        job_id, path, self.storage.root)
        else:
            self.storage.remove(own)


class Heartbeat(threading.Thread):
    """Resets the idle time of the entries a live consumer holds, so that only a dead one's are
    taken over; forgets an entry once it is no longer pending (another process finished it)."""

    def __init__(self, client: redis.Redis, group: str, name: str, every_s: float):
        super().__init__(daemon=True, name=f"layertap-heartbeat-{name}")
        self.redis, self.group, self.consumer, self.every_s = client, group, name, every_s
        self.ledger = Ledger(client, give_up_s=0)  # one attempt: the next beat tries again
        self.held: dict[str, set[str]] = {}  # stream -> entry ids
        self.lock = threading.Lock()
        self.stopped = threading.Event()

    def hold(self, stream: str, entry_id: str) -> None:
        with self.lock:
            self.held.setdefault(stream, set()).add(entry_id)

    def release(self, stream: str, entry_id: str) -> None:
        with self.lock:
            self.held.get(stream, set()).discard(entry_id)

    def run(self) -> None:
        while not self.stopped.wait(self.every_s):
            with self.lock:
                held = {stream: sorted(ids) for stream, ids in self.held.items() if ids}
            for stream, ids in held.items():
                try:
                    kept = self.ledger.keep_held(stream, self.group, self.consumer, ids)
                except redis.exceptions.RedisError as exc:  # Redis restarting: the next beat retries
                    log.warning("heartbeat of %s failed: %s", self.consumer, exc)
                    continue
                with self.lock:
                    self.held[stream] -= set(ids) - {keys.as_text(entry_id) for entry_id in kept}

    def close(self) -> None:
        self.stopped.set()
        self.join()
        self.redis.close()
