"""Connecting to Redis the same way everywhere: URL (``redis://`` or ``rediss://``, with
``user:password@`` for AUTH/ACL), TLS options from ``settings.tls``, keepalive and health
checks so a restarted server is reconnected to transparently.
"""

from __future__ import annotations

import logging
import ssl
import time
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis
from kombu.exceptions import OperationalError

from layertap.producer.settings import Settings
from layertap.producer.transport.backoff import Backoff, retry_while

T = TypeVar("T")
log = logging.getLogger("layertap.client")

_CERT_REQS = {"required": ssl.CERT_REQUIRED, "optional": ssl.CERT_OPTIONAL, "none": ssl.CERT_NONE}


def ssl_options(settings: Settings) -> dict[str, Any] | None:
    """redis-py/kombu SSL keywords for a ``rediss://`` URL, else None."""
    if not settings.broker_url.startswith("rediss://"):
        return None
    tls = settings.tls
    options: dict[str, Any] = {"ssl_cert_reqs": _CERT_REQS[tls.cert_reqs]}
    for key, value in (("ssl_ca_certs", tls.ca_certs), ("ssl_certfile", tls.certfile), ("ssl_keyfile", tls.keyfile)):
        if value:
            options[key] = value
    return options


#: Error replies that end when an operator or a failover fixes the server: writes refused at
#: ``maxmemory`` (OOM), by a replica (READONLY), after a failed snapshot (MISCONF), by an ACL (NOPERM).
WRITE_REFUSALS = (redis.exceptions.OutOfMemoryError, redis.exceptions.ReadOnlyError,
                  redis.exceptions.NoPermissionError)
#: Errors of a server that is away for a while (restarting, loading its data), as redis-py and
#: kombu raise them: waited out, like the refusals. BusyLoadingError is a ConnectionError.
UNREACHABLE = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OperationalError, OSError)


def refuses_writes(exc: BaseException) -> bool:
    """True for an error reply in :data:`WRITE_REFUSALS` (MISCONF has no class of its own), also
    as the cause of kombu's ``OperationalError`` (a refused send)."""
    if isinstance(exc, OperationalError) and exc.__cause__ is not None:
        exc = exc.__cause__
    return isinstance(exc, WRITE_REFUSALS) or (isinstance(exc, redis.exceptions.ResponseError)
                                               and str(exc).startswith("MISCONF"))


def connect(settings: Settings, *, decode_responses: bool = False) -> redis.Redis:
    """A client for ``settings.broker_url``."""
    return redis.Redis.from_url(settings.broker_url, decode_responses=decode_responses, health_check_interval=10,
                                socket_keepalive=True, **(ssl_options(settings) or {}))


def redacted_url(url: str) -> str:
    """``url`` with every password in it replaced by ``***``: the ``user:password@`` part and a
    ``password=`` query parameter (redis-py takes both). Use it wherever a URL is printed or logged."""
    parts = urlsplit(url)
    if parts.password is not None:
        user = parts.username or ""
        host = parts.hostname or ""
        parts = parts._replace(netloc=f"{user}:***@{host}" + (f":{parts.port}" if parts.port else ""))
    query = parse_qsl(parts.query, keep_blank_values=True)
    if any(name == "password" for name, _ in query):
        parts = parts._replace(query=urlencode([(name, "***" if name == "password" else value)
                                                for name, value in query], safe="*"))
    return urlunsplit(parts)


CLIENT_BACKOFF = Backoff(first_s=0.1, max_s=5.0)


def waits_out(exc: BaseException) -> bool:
    """Whether a client waits ``exc`` out: Redis unreachable (restarting) or refusing writes."""
    return isinstance(exc, UNREACHABLE) or refuses_writes(exc)


def retrying(action: Callable[[], T], give_up_s: float = 60.0) -> T:
    """Run ``action``, retrying with backoff while Redis is unreachable (restarting) or refuses
    writes (``maxmemory``, ``READONLY``: :func:`refuses_writes`), for up to ``give_up_s``; each
    wait is logged (a warning on stderr in the CLI), saying how long it has waited."""
    started = time.monotonic()

    def report(exc: BaseException, delay: float) -> None:
        why = "refuses writes" if refuses_writes(exc) else "is unreachable"
        log.warning("Redis %s (%s); waited %.0fs of %.0fs, trying again in %.1fs", why, exc,
                    time.monotonic() - started, give_up_s, delay)

    return retry_while(action, waits_out, give_up_s=give_up_s, backoff=CLIENT_BACKOFF, on_retry=report)
