"""The Celery task: a thin shell around :class:`~worker.service.WorkerService`."""

from __future__ import annotations

from typing import Any

from celery import Celery, Task

from producer import keys
from worker.service import RetryLater, WorkerService


def register_extract_task(app: Celery, service: WorkerService) -> Task:
    """Register ``layertap.extract`` on ``app``. Arguments are whatever the message holds:
    the service validates them, so a malformed message gets an error result, not a crash."""

    @app.task(name=keys.EXTRACT_TASK, bind=True, acks_late=True, reject_on_worker_lost=True, max_retries=None)
    def extract(self: Task, *args: Any, **kwargs: Any) -> dict[str, Any]:
        try:
            return service.handle(args, kwargs, self.request.id)
        except RetryLater as later:
            raise self.retry(countdown=later.countdown) from None

    return extract
