"""Celery task events (what Flower shows), published in batches on a timer.

Celery's worker buffers task events and asks its event loop to publish the buffer on the
next turn, which with many small jobs means one Redis publish (and one kombu message
built) per event: a sixth of the worker's Python time when draining small jobs. This
consumer step keeps the events and their order, and publishes the buffer every
:data:`FLUSH_INTERVAL_S` (or as soon as :data:`BUFFER_LIMIT` events wait), as one
``task.multi`` message. Monitors see events at most that much later.
"""

from __future__ import annotations

from typing import Any

from celery import Celery, bootsteps

FLUSH_INTERVAL_S = 0.1
BUFFER_LIMIT = 500


class BatchedTaskEvents(bootsteps.StartStopStep):
    """Runs after Celery's ``Events`` step, on every (re)start of the consumer."""

    requires = ("celery.worker.consumer.events:Events",)

    def __init__(self, parent: Any, **kwargs: Any):
        super().__init__(parent, **kwargs)
        self._timer: Any = None

    def start(self, c: Any) -> None:
        dispatcher = c.event_dispatcher
        if c.hub is None or dispatcher is None or not dispatcher.enabled:
            return  # no event loop: Celery sends each event at once
        dispatcher.on_send_buffered = None
        dispatcher.buffer_limit = BUFFER_LIMIT
        self._timer = c.timer.call_repeatedly(FLUSH_INTERVAL_S, self._flush, (c,))

    def stop(self, c: Any) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._flush(c)

    shutdown = stop

    @staticmethod
    def _flush(c: Any) -> None:
        if c.event_dispatcher is not None:
            c.event_dispatcher.flush()


def batch_task_events(app: Celery) -> None:
    """Install :class:`BatchedTaskEvents` on ``app``'s worker consumer."""
    app.steps["consumer"].add(BatchedTaskEvents)
