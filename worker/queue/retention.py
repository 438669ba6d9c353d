"""The retention sweep: a background thread in every worker; at most one sweeps at a time
(``SET NX`` lock). Each sweep trims every run's results stream to the last
``retention.results_s`` seconds (the run ledger's ``trim``: entries a consumer group has
not acknowledged stay, and so does the run's compact ledger that manifest, resume, ``runs``
and ``Client.wait`` read once an entry is gone). ``results_s = 0`` keeps streams whole. The
sweep, its lock included, works while Redis is at ``maxmemory``: it is what frees memory there.
"""

from __future__ import annotations

import logging
import time

import redis

from layertap.protocol import keys
from layertap.transport.ledger import Ledger
from layertap.worker.queue.periodic import Periodic, take_turn

log = logging.getLogger(__name__)


class RetentionSweep:
    """Trims every run's results stream to the last ``retention_s`` seconds every ``interval``, one worker of the
    fleet at a time; :meth:`start` starts nothing when ``retention_s`` is 0."""

    def __init__(self, client: redis.Redis, node: str, retention_s: float, interval: float):
        self.redis = client
        self.ledger = Ledger(client, give_up_s=0)  # one attempt: the next sweep tries again
        self.node = node
        self.retention_s = retention_s
        self.interval = interval
        self._ticker = Periodic("retention sweep", interval, self.sweep)

    def start(self) -> RetentionSweep:
        if self.retention_s > 0:
            self._ticker.start()
        return self

    def stop(self) -> None:
        self._ticker.stop()

    def sweep(self) -> int:
        """One pass over every run; returns how many stream entries were dropped."""
        if not take_turn(self.redis, keys.RETENTION_LOCK, self.node, self.interval, at_maxmemory=True):
            return 0
        before = time.time() - self.retention_s
        dropped = sum(self.ledger.trim(run, before=before) for run in self.ledger.run_names())
        if dropped:
            log.info("retention: dropped %d result stream entries older than %.0fs", dropped, self.retention_s)
        return dropped
