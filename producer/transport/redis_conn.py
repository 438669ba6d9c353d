"""Connecting to Redis the same way everywhere: URL (``redis://`` or ``rediss://``, with
``user:password@`` for AUTH/ACL), TLS options from ``settings.tls``, keepalive and health
checks so a restarted server is reconnected to transparently.
"""

from __future__ import annotations

import ssl
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis
from kombu.exceptions import OperationalError

from producer.settings import Settings

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
#: Errors of a server that is away for a while: waited out, like the refusals.
UNREACHABLE = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, redis.exceptions.BusyLoadingError)


def refuses_writes(exc: BaseException) -> bool:
    """True for an error reply in :data:`WRITE_REFUSALS` (MISCONF has no class of its own)."""
    return isinstance(exc, WRITE_REFUSALS) or (isinstance(exc, redis.exceptions.ResponseError)
                                               and str(exc).startswith("MISCONF"))


def connect(settings: Settings, *, decode_responses: bool = False) -> redis.Redis:
    """A client for ``settings.broker_url``."""
    return redis.Redis.from_url(settings.broker_url, decode_responses=decode_responses, health_check_interval=10,
                                socket_keepalive=True, **(ssl_options(settings) or {}))


def redacted_url(url: str) -> str:
    """``url`` with its password replaced by ``***`` (for printing which Redis is read)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def retrying(action: Callable[[], Any], give_up_s: float = 60.0) -> Any:
    """Run ``action``, retrying while Redis is unreachable (restarting) for up to ``give_up_s``."""
    deadline, delay = time.monotonic() + give_up_s, 0.1
    while True:
        try:
            return action()
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OperationalError, OSError):
            if time.monotonic() > deadline:
                raise
            time.sleep(delay)
            delay = min(delay * 2, 2.0)
