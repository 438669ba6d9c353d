"""The Celery application both sides share: JSON only, late acks, long-task timeouts.

Invariants:
* only JSON is accepted (task, result and event payloads): kombu will refuse a pickled
  message before anything in it is deserialised;
* a job is acknowledged only after its task returned, which happens after its file is
  durable and its result published (``task_acks_late``); a worker that dies requeues
  what it held (``task_reject_on_worker_lost``);
* task return values are not stored (``task_ignore_result``, no backend) unless the
  ``result_backend`` setting asks: a result's home is the run's stream and status hash;
* the broker's ``visibility_timeout`` is ``orphan_timeout``: a live worker renews the
  lease of every message it holds (``layertap.worker.queue.lease``), so only a dead worker's messages
  ever reach it and are restored to the queue; kombu checks every few seconds;
* a ``sentinel://`` URL reaches Celery as Celery spells Sentinel: the broker as its first
  sentinel with the others, ``master_name`` and ``sentinel_kwargs`` in the transport options
  (``layertap.transport.broker_transport``), the result backend as every sentinel
  ``;``-joined with the same options; TLS as ``broker_use_ssl``/``redis_backend_use_ssl``.
"""

from __future__ import annotations

from typing import Any

from celery import Celery
from celery.result import AsyncResult

from layertap.protocol import keys
from layertap.settings import Settings
from layertap.transport.broker_transport import transport_for
from layertap.transport.redis_conn import sentinel_kwargs, ssl_options
from layertap.transport.redis_url import check_redis_url, is_sentinel_url, parse_sentinel_url

RESTORE_INTERVAL_MAX = 5.0


def transport_options(settings: Settings) -> dict[str, object]:
    """kombu Redis transport options derived from the settings.

    ``unacked_mutex_expire`` is short: a worker killed while restoring must not block
    every other worker's restores for kombu's default five minutes.
    """
    return {
        "visibility_timeout": settings.orphan_timeout,
        "unacked_restore_interval": max(1.0, min(RESTORE_INTERVAL_MAX, settings.orphan_timeout / 4)),
        "unacked_restore_throttle": 1,
        "unacked_mutex_expire": max(5, int(settings.orphan_timeout)),
        "health_check_interval": 10,
        "priority_steps": [0],  # one list per queue (layertap sets no priorities): fetched by one BLMOVE
        "socket_keepalive": True,
        "replicas_to_wait": replicas_to_wait(settings),
        **sentinel_options(settings),
    }


def replicas_to_wait(settings: Settings) -> int:
    """How many replicas must hold a message before its send returns: ``redis_wait_replicas``,
    else 1 for a ``sentinel://`` URL and 0 for another."""
    if settings.redis_wait_replicas is not None:
        return settings.redis_wait_replicas
    return int(is_sentinel_url(settings.broker_url))


def sentinel_options(settings: Settings) -> dict[str, object]:
    """Celery's transport options for a ``sentinel://`` URL (its broker and result backend read the
    same ones; ``sentinels`` only layertap's broker transport), none for another URL."""
    if not is_sentinel_url(settings.broker_url):
        return {}
    target = parse_sentinel_url(settings.broker_url)
    return {"master_name": target.master_name, "sentinel_kwargs": sentinel_kwargs(target, settings),
            "sentinels": [list(address) for address in target.sentinels]}


def celery_urls(settings: Settings) -> tuple[str, str]:
    """The broker URL and the result backend URL Celery is given for ``settings.broker_url``.
    Raises ``ValueError`` for a URL layertap cannot use (``redis_url.check_redis_url``)."""
    check_redis_url(settings.broker_url)
    if not is_sentinel_url(settings.broker_url):
        return settings.broker_url, settings.broker_url
    target = parse_sentinel_url(settings.broker_url)
    return target.address_url(0), target.celery_url()


def make_celery(settings: Settings) -> Celery:
    """A Celery app on ``settings.broker_url``. Task return values are not stored (results travel
    on the run's stream) unless ``settings.result_backend``: then Celery's Redis backend keeps
    each for ``settings.result_ttl`` seconds, for ``AsyncResult(task_id).get()``."""
    broker, backend = celery_urls(settings)
    app = Celery("layertap", broker=broker, backend=backend if settings.result_backend else None,
                 set_as_current=False)
    app.conf.update(
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        result_accept_content=["json"],
        event_serializer="json",
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        task_acks_on_failure_or_timeout=True,
        worker_prefetch_multiplier=1,
        broker_transport=transport_for(settings.broker_url),
        broker_transport_options=transport_options(settings),
        result_backend_transport_options={"retry_policy": {"timeout": 5.0}, **sentinel_options(settings)},
        result_expires=settings.result_ttl,
        broker_connection_retry_on_startup=True,
        broker_connection_max_retries=None,
        broker_channel_error_retry=True,  # an error reply (OOM at maxmemory, READONLY) reconnects, not dies
        worker_cancel_long_running_tasks_on_connection_loss=False,
        worker_send_task_events=True,
        task_send_sent_event=False,  # one Redis write less per submitted job; workers still send events
        worker_hijack_root_logger=False,
        task_ignore_result=not settings.result_backend,
        timezone="UTC",
    )
    tls = ssl_options(settings)
    if tls:
        app.conf.update(broker_use_ssl=tls, redis_backend_use_ssl=tls)
    return app


def send_extract(app: Celery, args: list[Any], kwargs: dict[str, Any], queue: str, task_id: str,
                 task: str = keys.EXTRACT_TASK, pending: str | None = None) -> AsyncResult:
    """Send one ``layertap.extract`` message (``args == [job payload]``), or with ``task``
    ``layertap.extract_bundle`` one bundle (``args == [[job payload, ...]]``). ``pending``: the
    message's pending record (``ledger.pending.pending_record``), written with its push.

    Monitors (Flower, task events) show the job by model, run and id (a bundle by model,
    run and its number of jobs) rather than by its input: Celery's default repr of the
    arguments would put up to 1 KiB of prompt or token ids into every event.
    """
    jobs = args[0] if task == keys.EXTRACT_BUNDLE_TASK else [args[0]]
    summary: dict[str, Any] = {name: jobs[0][name] for name in ("model", "run")}
    if task == keys.EXTRACT_BUNDLE_TASK:
        summary["jobs"] = len(jobs)
    else:
        summary["job_id"] = jobs[0]["job_id"]
    headers = {keys.PENDING_HEADER: pending} if pending is not None else None
    return app.send_task(task, args=args, kwargs=kwargs, queue=queue, task_id=task_id, argsrepr=repr([summary]),
                         headers=headers)
