"""Connecting to Redis the same way everywhere: URL (``redis://`` or ``rediss://``, with
``user:password@`` for AUTH/ACL, or ``sentinel://``: the forms are ``redis_url``'s), TLS options
from ``settings.tls``, keepalive and health checks so a restarted server is reconnected to
transparently.

Through Sentinel, a client is redis-py's ``Sentinel(...).master_for(name)``: every new
connection asks the sentinels (in the URL's order) where the primary is, and a connection that
meets ``READONLY`` (a demoted primary) is dropped and asks again, so a failover reads as a short
outage, which callers already wait out (:func:`retrying`, the worker's publisher).
"""

from __future__ import annotations

import ssl
from collections.abc import Callable
from typing import Any, TypeVar

import redis
from kombu.exceptions import OperationalError

from layertap.settings import Settings
from layertap.transport.redis_url import (
    SentinelUrl,
    check_redis_url,
    is_sentinel_url,
    parse_sentinel_url,
    uses_tls,
)
from layertap.transport.refusals import REDIS_AWAY, wait_out
from layertap.transport.refusals import refuses_writes as redis_refuses_writes

T = TypeVar("T")

_CERT_REQS = {"required": ssl.CERT_REQUIRED, "optional": ssl.CERT_OPTIONAL, "none": ssl.CERT_NONE}
#: Seconds a question to one sentinel may take before the next is asked (a host that went away
#: answers nothing; without a bound the question would wait forever).
SENTINEL_TIMEOUT_S = 5.0


def ssl_options(settings: Settings) -> dict[str, Any] | None:
    """redis-py/kombu SSL keywords for a TLS URL (``rediss://``, ``sentinel://...?ssl=true``), else None."""
    if not uses_tls(settings.broker_url):
        return None
    tls = settings.tls
    options: dict[str, Any] = {"ssl_cert_reqs": _CERT_REQS[tls.cert_reqs]}
    for key, value in (("ssl_ca_certs", tls.ca_certs), ("ssl_certfile", tls.certfile), ("ssl_keyfile", tls.keyfile)):
        if value:
            options[key] = value
    return options


#: Errors of a server that is away for a while, as redis-py and kombu raise them (a refused send:
#: kombu's ``OperationalError``): waited out, like the refusals (``refusals``).
UNREACHABLE = (*REDIS_AWAY, OperationalError)


def refuses_writes(exc: BaseException) -> bool:
    """``refusals.refuses_writes``, also as the cause of kombu's ``OperationalError`` (a refused send)."""
    if isinstance(exc, OperationalError) and exc.__cause__ is not None:
        exc = exc.__cause__
    return redis_refuses_writes(exc)


def sentinel_kwargs(target: SentinelUrl, settings: Settings) -> dict[str, Any]:
    """redis-py keywords for the connections to the sentinels themselves (not to the primary):
    their password (``sentinel_password``), TLS as to the primary, and a bound on each question."""
    options: dict[str, Any] = {"socket_timeout": SENTINEL_TIMEOUT_S, "socket_connect_timeout": SENTINEL_TIMEOUT_S}
    if target.sentinel_password is not None:
        options["password"] = target.sentinel_password
    if target.ssl:
        options.update(ssl=True, **(ssl_options(settings) or {}))
    return options


def connect(settings: Settings, *, decode_responses: bool = False) -> redis.Redis:
    """A client for ``settings.broker_url``; for a ``sentinel://`` URL, one that follows the primary.
    Raises ``ValueError`` for a URL layertap cannot use (``redis_url.check_redis_url``)."""
    check_redis_url(settings.broker_url)
    options: dict[str, Any] = {"decode_responses": decode_responses, "health_check_interval": 10,
                               "socket_keepalive": True, **(ssl_options(settings) or {})}
    if not is_sentinel_url(settings.broker_url):
        return redis.Redis.from_url(settings.broker_url, **options)
    target = parse_sentinel_url(settings.broker_url)
    sentinel = redis.Sentinel(list(target.sentinels), sentinel_kwargs=sentinel_kwargs(target, settings),
                              username=target.username, password=target.password, db=target.db,
                              **({"ssl": True} if target.ssl else {}), **options)
    return sentinel.master_for(target.master_name)


def waits_out(exc: BaseException) -> bool:
    """Whether a client waits ``exc`` out: Redis unreachable (restarting) or refusing writes."""
    return isinstance(exc, UNREACHABLE) or refuses_writes(exc)


def retrying(action: Callable[[], T], give_up_s: float = 60.0) -> T:
    """Run ``action``, retrying with backoff while Redis is unreachable (restarting) or refuses
    writes (``maxmemory``, ``READONLY``: :func:`refuses_writes`), for up to ``give_up_s``; each
    wait is logged (on stderr in the CLI), saying how long it has waited (``refusals.wait_out``)."""
    return wait_out(action, give_up_s, waits=waits_out, refusal=refuses_writes)
