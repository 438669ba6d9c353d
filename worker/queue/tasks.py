"""The Celery task: a thin shell around :class:`~layertap.worker.queue.handler.WorkerService`.

Scheduling fields on a message end in a result too, never in a message held or dropped
in silence: an ``eta``/``countdown`` up to :data:`MAX_ETA_S` ahead is honoured (the
service's own retries use one); a farther one is refused at once with ``invalid_job``; a
message past its ``expires`` is refused with ``invalid_job`` instead of being revoked by
Celery without a result; one not yet expired runs.

A message is handled (its attempts counted, its jobs prepared) only once it holds a place just
ahead of the engine (``Engine.preparing``, around the whole task): the worker's prefetch is bounded
by what the engine is about to run, not by ``concurrency``. At a warm shutdown
(``Engine.close_admission``) a message still waiting for its place is rejected with
``requeue=True`` (Celery's rule for a late-acked task): back in its queue, unstarted and uncounted,
while the messages holding places finish.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from datetime import datetime, timezone
from typing import Any

from celery import Celery, Task
from celery.exceptions import Reject
from celery.worker.request import Request

from layertap.protocol import keys
from layertap.worker.engine.errors import AdmissionClosed
from layertap.worker.queue.handler import RETRY_MAX_S, RetryLater, WorkerService

#: Farthest ``eta`` honoured, in seconds from receipt: the longest retry backoff, with room.
MAX_ETA_S = 2 * RETRY_MAX_S
#: Where the request leaves its refusal for the task (a key of Celery's request dict).
REFUSAL_KEY = "layertap_refusal"


def scheduling_refusal(eta: datetime | None, expires: datetime | None, received: datetime) -> str | None:
    """Why a message's ``eta``/``expires`` refuse it when received at ``received``, or None."""
    if eta is not None and (ahead := (eta - received).total_seconds()) > MAX_ETA_S:
        return (f"the message asks to run {ahead:.0f}s from now (eta/countdown); layertap runs jobs when "
                f"they arrive and honours at most {MAX_ETA_S:.0f}s")
    if expires is not None and expires <= received:
        return f"the message expired at {expires.isoformat()} before a worker took it"
    return None


class JobRequest(Request):
    """Celery's request with the scheduling above, decided once on receipt: a refused
    message has its ``eta`` and ``expires`` dropped, so Celery runs the task now (rather
    than hold it, or revoke it without a result), and the task publishes the refusal."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        refusal = scheduling_refusal(self._eta, self._expires, datetime.now(timezone.utc))
        if refusal is not None:
            self._request_dict[REFUSAL_KEY] = refusal
            self._eta = None
        self._expires = None


@contextmanager
def admitted(service: WorkerService) -> Iterator[None]:
    """Hold a place ahead of the engine for the task's body; raises Celery's ``Reject(requeue=True)``
    when admission closed first (a warm shutdown): the message goes back to its queue unstarted."""
    with ExitStack() as stack:
        try:
            stack.enter_context(service.processor.engine.preparing())
        except AdmissionClosed as exc:
            raise Reject(f"{exc}: the message goes back to its queue unstarted", requeue=True) from None
        yield


def register_extract_task(app: Celery, service: WorkerService) -> Task:
    """Register ``layertap.extract`` on ``app``. Arguments are whatever the message holds:
    the service validates them, so a malformed message gets an error result, not a crash."""

    @app.task(name=keys.EXTRACT_TASK, bind=True, acks_late=True, reject_on_worker_lost=True, max_retries=None,
              Request=JobRequest)
    def extract(self: Task, *args: Any, **kwargs: Any) -> dict[str, Any]:
        with admitted(service):
            try:
                return service.handle(args, kwargs, self.request.id, refusal=self.request.get(REFUSAL_KEY))
            except RetryLater as later:
                raise self.retry(args=later.args_, kwargs=later.kwargs_, countdown=later.countdown) from None

    return extract


def register_bundle_task(app: Celery, service: WorkerService) -> Task:
    """Register ``layertap.extract_bundle`` on ``app`` (several jobs in one message; see
    ``layertap.worker.queue.handler``); the service sends a split bundle's halves through ``app``."""
    service.app = app

    @app.task(name=keys.EXTRACT_BUNDLE_TASK, bind=True, acks_late=True, reject_on_worker_lost=True, max_retries=None,
              Request=JobRequest)
    def extract_bundle(self: Task, *args: Any, **kwargs: Any) -> dict[str, int]:
        queue = (self.request.delivery_info or {}).get("routing_key")
        with admitted(service):
            try:
                return service.handle_bundle(args, kwargs, self.request.id, queue,
                                             refusal=self.request.get(REFUSAL_KEY))
            except RetryLater as later:
                raise self.retry(args=later.args_, kwargs=later.kwargs_, countdown=later.countdown) from None

    return extract_bundle
