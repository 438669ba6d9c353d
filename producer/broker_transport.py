"""kombu's Redis transport, with one reused client per channel instead of one per command.

kombu's Redis ``Channel.conn_or_acquire`` builds a new ``redis.Redis`` object for every
command it sends outside the consuming connection: each message's ``unacked`` append,
each ack, each event batch, each publish. Building one costs redis-py's response-callback
table (~200 entries); profiled on a worker draining small jobs, that was a quarter of the
Celery consumer thread's time, the thread that bounds jobs/s. A ``redis.Redis`` object is
thread-safe (commands borrow connections from its pool, pipelines are per call), so this
channel keeps one, bound to the channel's current pool, and rebuilds it when kombu
replaces the pool (after a fork or a reconnect). Nothing else of the transport changes:
same keys, same commands, same acknowledgement semantics.

Used for ``redis://`` and ``rediss://`` brokers (:func:`transport_for`); other URLs keep
kombu's own transport.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import redis
from kombu.transport import redis as kombu_redis

REUSED_CLIENT_SCHEMES = ("redis", "rediss")
TRANSPORT_PATH = f"{__name__}:Transport"


class Channel(kombu_redis.Channel):
    """A kombu Redis channel whose commands share one client per connection pool."""

    _shared_client: redis.Redis | None = None

    @contextmanager
    def conn_or_acquire(self, client: redis.Redis | None = None) -> Iterator[redis.Redis]:
        if client is not None:
            yield client
            return
        shared = self._shared_client
        if shared is None or shared.connection_pool is not self.pool:
            shared = self._shared_client = self._create_client()
        yield shared


class Transport(kombu_redis.Transport):
    """kombu's Redis transport with :class:`Channel`."""

    Channel = Channel


def transport_for(broker_url: str) -> str | None:
    """The kombu transport to use for ``broker_url``: ours for plain and TLS Redis, else None."""
    scheme = broker_url.split("://", 1)[0].lower()
    return TRANSPORT_PATH if scheme in REUSED_CLIENT_SCHEMES else None
