"""Worker logging: text lines or JSON objects (``--log-format json``), one per line.

Every line logged while a job is being handled carries that job's ``job_id`` and
``run``, with no plumbing through the service: inside a task, the job comes from
Celery's current task id (``keys.task_id(run, job_id)``; a bundle's lines carry its run, a
null ``job_id`` and, in text, the bundle's task id); Celery's own per-task lines
(received, succeeded, retry) carry the task id in their ``data`` record field. Lines
about no single job (startup, the engine's batches) have ``job_id`` and ``run`` null. A message
handed back to its queue at a warm shutdown (Celery's ``Reject(requeue=True)``) is one line, without
the traceback Celery adds to it: handing back is not an error.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import current_task, signals
from celery.exceptions import Reject
from pythonjsonlogger.core import RESERVED_ATTRS
from pythonjsonlogger.json import JsonFormatter

from layertap.protocol import keys
from layertap.settings import LogFormat

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s%(job)s: %(message)s"
JSON_FIELDS = "{levelname}{name}{message}{job_id}{run}"


def current_task_id(record: logging.LogRecord) -> str | None:
    """The Celery task id a record is about: its ``data['id']``, else the running task's id."""
    data = getattr(record, "data", None)
    if isinstance(data, dict) and isinstance(data.get("id"), str):
        return data["id"]
    request = getattr(current_task, "request", None)
    task_id = getattr(request, "id", None)
    return task_id if isinstance(task_id, str) else None


class JobContextFilter(logging.Filter):
    """Sets ``job_id``, ``run`` (None outside a job) and ``job`` (text suffix) on every record."""

    def filter(self, record: logging.LogRecord) -> bool:
        task_id = current_task_id(record)
        if task_id and keys.is_bundle_task_id(task_id):  # several jobs: the run, and the bundle by its task id
            record.run, record.job_id, record.job = task_id.partition(":")[0], None, f" [{task_id}]"
            return True
        parsed = keys.parse_task_id(task_id) if task_id else None
        record.run, record.job_id = parsed if parsed else (None, task_id)
        record.job = f" [{record.run or '?'}/{record.job_id}]" if record.job_id else ""
        return True


class HandBackFilter(logging.Filter):
    """Drops the traceback of a record about a message handed back (``Reject(requeue=True)``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, Reject) and exc.requeue:
            record.exc_info, record.exc_text = None, None
        return True


def make_formatter(log_format: LogFormat) -> logging.Formatter:
    """A formatter for ``log_format``: :data:`TEXT_FORMAT` lines, or JSON objects of :data:`JSON_FIELDS` with ``time``,
    ``level`` and ``logger`` (Celery's ``data`` left out)."""
    if log_format is LogFormat.json:
        # Celery's ``data`` (the task's args and return value) is left out: the message says it.
        return JsonFormatter(JSON_FIELDS, style="{", reserved_attrs=[*RESERVED_ATTRS, "job", "data"],
                             timestamp="time", rename_fields={"levelname": "level", "name": "logger"})
    return logging.Formatter(TEXT_FORMAT)


def _leave_logging_alone(**_: Any) -> None:
    """A ``setup_logging`` receiver: its presence tells Celery not to configure logging."""


def configure_logging(level: str, log_format: LogFormat) -> None:
    """Send every log record to stderr in ``log_format``, with job context; Celery keeps it so."""
    handler = logging.StreamHandler()
    handler.setFormatter(make_formatter(log_format))
    handler.addFilter(JobContextFilter())
    handler.addFilter(HandBackFilter())
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(level.upper())
    logging.captureWarnings(True)  # warnings become records too (one JSON line each)
    # transformers logs through a handler of its own, and with CI set also propagates to ours:
    # each of its warnings came out twice, once not in our format. Ours alone now, at its level.
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_default_handler()
    transformers_logging.enable_propagation()
    signals.setup_logging.connect(_leave_logging_alone, weak=False)
