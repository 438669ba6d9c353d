"""Leases on held messages, and the worker's heartbeat.

kombu's Redis transport records each delivered-but-unacknowledged message in the
``unacked`` hash and its delivery time in the ``unacked_index`` sorted set; any worker
restores to the queue the messages whose time is older than ``visibility_timeout``
(set to ``orphan_timeout``). This thread re-stamps, every ``orphan_timeout / 4``
seconds, the entries of every message this worker holds (reserved or running) with
``ZADD XX`` (never re-adding an acknowledged one), also while Redis is at ``maxmemory``. So:

* a live worker's messages are never restored, however long its jobs run;
* a dead worker's messages stop being re-stamped and are back in the queue within
  ``orphan_timeout`` plus kombu's restore interval.

The same beat refreshes ``layertap:heartbeat:<node>`` (TTL ``orphan_timeout``) and the
worker's entry in ``layertap:workers``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

import redis
from celery.worker import state as worker_state

from layertap.protocol import keys
from layertap.transport.script_flags import lua, run_script
from layertap.worker.queue.periodic import Periodic

log = logging.getLogger(__name__)

#: ``renew_leases.lua``: ``ZADD XX`` of (score, member) pairs, also at ``maxmemory`` (Redis 7+,
#: ``layertap.transport.script_flags``).
RENEW_LEASES = lua(__package__, "renew_leases")


def held_delivery_tags() -> set[str]:
    """Delivery tags of every message this worker process holds (reserved, active, scheduled)."""
    for _ in range(5):
        try:
            requests = [*worker_state.requests.values(), *worker_state.reserved_requests,
                        *worker_state.active_requests]
            break
        except RuntimeError:  # a set changed size while we copied it; copy again
            continue
    else:
        return set()
    return {request.message.delivery_tag for request in requests if getattr(request, "message", None)}


class LeaseKeeper:
    """Background thread: heartbeat + lease renewal for one worker node."""

    def __init__(self, client: redis.Redis, node: str, info: Callable[[], dict[str, Any]], orphan_timeout: float,
                 unacked_index_key: str = keys.UNACKED_INDEX):
        self.redis = client
        self.node = node
        self.info = info
        self.ttl = max(1, int(orphan_timeout))
        self.interval = max(0.25, orphan_timeout / 4)
        self.unacked_index_key = unacked_index_key
        self._ticker = Periodic("lease renewal", self.interval, self.beat)

    def start(self) -> LeaseKeeper:
        try:
            self.beat()
        except redis.exceptions.RedisError as exc:  # Redis away or refusing writes: the ticker tries again
            log.warning("first heartbeat failed (%s); trying again in %.1fs", exc, self.interval)
        self._ticker.start()
        return self

    def beat(self) -> int:
        """Renew leases and heartbeat once; returns how many leases were renewed."""
        tags = held_delivery_tags()
        now = time.time()
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(keys.worker_heartbeat_key(self.node), now, ex=self.ttl)
        pipe.hset(keys.WORKERS_HASH, self.node, json.dumps({**self.info(), "beat": now}))
        if tags:
            run_script(pipe, RENEW_LEASES, [self.unacked_index_key], [value for tag in tags for value in (now, tag)])
        pipe.execute()
        return len(tags)

    def stop(self) -> None:
        """Stop renewing and deregister (the worker is going away cleanly)."""
        self._ticker.stop()
        try:
            self.redis.delete(keys.worker_heartbeat_key(self.node))
            self.redis.hdel(keys.WORKERS_HASH, self.node)
        except redis.exceptions.RedisError:
            pass
