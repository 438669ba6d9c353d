"""A daemon thread that calls one action every ``interval`` seconds until stopped, and the
turn-taking lock of the sweeps one worker of the fleet runs at a time.

Redis errors in the action are logged and the next tick tries again (Redis may be
restarting); anything else is a bug and ends the thread with a traceback in the log.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import redis

from layertap.transport.script_flags import lua, run_script

log = logging.getLogger(__name__)


class Periodic:
    """Calls ``action`` every ``interval`` seconds on a daemon thread (the first call one interval after
    :meth:`start`) until :meth:`stop`."""

    def __init__(self, name: str, interval: float, action: Callable[[], object]):
        self.name = name
        self.interval = interval
        self.action = action
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"layertap-{name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop ticking and wait for a tick in progress (a no-op if never started)."""
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.action()
            except redis.exceptions.RedisError as exc:
                log.warning("%s failed (%s); trying again in %.1fs", self.name, exc, self.interval)


#: ``take_turn.lua``: ``SET NX EX``, also at ``maxmemory`` (Redis 7+, ``layertap.transport.script_flags``).
TAKE_TURN_AT_MAXMEMORY = lua(__package__, "take_turn")


def take_turn(client: redis.Redis, lock_key: str, node: str, interval: float, *, at_maxmemory: bool = False) -> bool:
    """Whether this worker runs the fleet-wide sweep under ``lock_key`` this time: at most one
    worker per ``interval`` (``SET NX EX``; the lock expires, so a dead holder does not block).
    ``at_maxmemory``: also while Redis refuses writes for want of memory (a few bytes past it)."""
    ttl = max(1, int(interval))
    if at_maxmemory:
        return bool(run_script(client, TAKE_TURN_AT_MAXMEMORY, [lock_key], [node, ttl]))
    return bool(client.set(lock_key, node, nx=True, ex=ttl))
