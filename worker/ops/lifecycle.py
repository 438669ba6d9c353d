"""The worker's background services and their one lifecycle.

Every service (heartbeat and leases, reconciler, retention, engine watchdog, progress line)
has ``start()`` and ``stop()``. :class:`ServiceGroup` starts them in the order given, once
Celery consumes, and stops those it started in reverse order. Invariant: a service that
failed to stop never keeps a later one (earlier in the list) from stopping; its error is
logged.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

log = logging.getLogger(__name__)


class Service(Protocol):
    """A background service: ``start()`` returns at once (its work runs on its own thread)."""

    def start(self) -> object: ...

    def stop(self) -> None: ...


class ServiceGroup:
    """Services started in order and stopped in reverse (see the module docstring)."""

    def __init__(self, services: Sequence[Service]):
        self.services = list(services)
        self._started: list[Service] = []

    def start(self) -> None:
        for service in self.services:
            service.start()
            self._started.append(service)

    def stop(self) -> None:
        while self._started:
            service = self._started.pop()
            try:
                service.stop()
            except Exception:  # one broken stop must not leave the others running
                log.exception("stopping %s failed", type(service).__name__)
