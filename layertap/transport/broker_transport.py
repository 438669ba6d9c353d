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

Used for ``redis://``, ``rediss://`` and ``sentinel://`` brokers (:func:`transport_for`); other
URLs keep kombu's own transport. Through Sentinel (:class:`SentinelChannel`) the channel is
kombu's Sentinel channel with the same changes, and the sentinels come from the transport
option ``sentinels``, not from ``;``-joined alternates: kombu switches a connection that fails to
its next alternate with the alternate's own scheme, that is to kombu's stock transport, which
would drop everything below.

A lost connection (or an error reply such as ``OOM``, which Celery handles the same way):
Celery closes the connection, which closes the channel, and kombu's channel close restores
every message it delivered and has not seen acknowledged. It does so after the transport
has let go of its connection settings, and in kombu 5.7.0 that raises ``AttributeError`` on
``None.hostname`` (the worker dies); had it worked, it would have put back on the queue the
messages of tasks this worker is still running (and kombu drops a message it took out of
``unacked`` but could not push back, as under ``OOM``). Here:

* a channel restores only the messages no task of this process holds (:func:`set_held_messages`;
  all of them once its transport is gone): held ones stay in kombu's ``unacked`` records,
  their leases keep being renewed (``layertap.worker.queue.lease``) while their tasks run, and each task's
  ack removes its record; a worker that dies meanwhile leaves them to the visibility
  timeout, like any dead worker;
* a closed channel keeps serving commands (those acks) from its last client, whose pool
  reconnects once Redis is back.

A task message's delivery tag carries its task id (``keys.delivery_tag``): kombu's
``unacked`` hash is keyed by delivery tag, so the reconciler (``layertap.worker.queue.reconciler``) learns
which jobs workers hold from the hash's keys, without reading a message body.

**A full Redis** (``maxmemory``) or a read-only one refuses the fetch (``BLMOVE`` writes) and
kombu's sweep of timed-out messages (its lock is a ``SET``). Both were errors that made Celery
drop its connection and open a new one several times a second, each leaving two connections
open (1,180 after 120 s). Here a refused fetch waits a second and tries again on the same
connection, and a refused sweep is skipped until the next, so the consumer keeps its connection.

**Sending loses nothing.** A message that carries its pending record (the Client's and a
worker's split halves: ``keys.PENDING_HEADER``) is pushed in the same server-side step that
writes the record (the run ledger's ``push_recorded``). A Redis at ``maxmemory`` refuses both or neither, so the
reconciler never finds a record whose message is still on its way (it called such a message
lost, then the push went through and the job was dropped unrun as already handled).

**Fetching loses nothing.** kombu pops a message with ``BRPOP`` and only then records it in
``unacked``: a worker killed (or a connection lost) between the two lost the message. Here a
channel consuming one queue fetches with ``BLMOVE <queue> <in-flight list> RIGHT LEFT``
(``keys.inflight_list``), and the ``unacked`` record of the message and its ``LREM`` from the
in-flight list go in one ``MULTI`` (:meth:`QoS.append`). So a message is always in its queue,
in the in-flight list, or in ``unacked``; the reconciler puts a message left in the in-flight
list by a dead fetcher back at the head of its queue. A message kombu cannot decode is taken
out of the in-flight list (dropped, as kombu drops it). Several queues on one channel, or a
``global_keyprefix``, keep kombu's ``BRPOP``; so does ``basic_get`` (no worker uses it).

**A send that outlives its primary.** Redis replicates asynchronously: a primary lost right
after it answered a send can take the message with it, and the replica promoted in its place
never had it (``docs/operations.md``, "Redis Sentinel", has the measured cases). With the transport
option ``replicas_to_wait`` (``settings.redis_wait_replicas``) a send returns only once that
many replicas hold the message: ``WAIT`` on the connection that pushed it, so also everything
the sender wrote before it, as the ledger's record of the message. A send whose primary is lost
or demoted meanwhile raises (the connection fails, or Redis unblocks the ``WAIT`` as it turns
into a replica), and the sender sends it again. A send no replica confirms (none in reach: lost,
or a failover left none) waits, logged every ``CONFIRM_LOG_EVERY_S``, and is never taken as sent
unconfirmed: a primary without a replica can be demoted by a later failover (a flapping one, or a
partition that heals) and drop everything it took, the ledger's records included.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from queue import Empty
from typing import Any

import redis
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import dumps, loads

from layertap.protocol import keys
from layertap.transport.ledger import Ledger
from layertap.transport.redis_conn import refuses_writes
from layertap.transport.redis_url import is_sentinel_url

REUSED_CLIENT_SCHEMES = ("redis", "rediss")
TRANSPORT_PATH = f"{__name__}:Transport"
SENTINEL_TRANSPORT_PATH = f"{__name__}:SentinelTransport"
log = logging.getLogger(__name__)
REFUSED_FETCH_PAUSE_S = 1.0  # a fetch refused by a Redis that refuses writes waits this long, then tries again
WAIT_TIMEOUT_MS = 1000  # one WAIT for a send's replicas, repeated until they hold it
CONFIRM_LOG_EVERY_S = 10.0  # a send still unconfirmed is logged this often
#: Replies to a ``WAIT`` whose primary turned replica: unblocked as it turned, or refused on a replica.
DEMOTED_REPLIES = ("UNBLOCKED", "WAIT cannot be used with replica")


_held_messages: Callable[[], set[str]] = set


def set_held_messages(provider: Callable[[], set[str]]) -> None:
    """Tell channels which delivery tags this process's tasks hold (a worker sets it once)."""
    global _held_messages
    _held_messages = provider


class QoS(kombu_redis.QoS):
    """kombu's Redis ack emulation; a fetched message leaves the in-flight list as it is recorded
    in ``unacked``; closing restores only messages no task of this process holds."""

    def append(self, message: Any, delivery_tag: str) -> None:
        fetched = self.channel.take_fetched()
        if fetched is None:
            super().append(message, delivery_tag)
            return
        inflight, raw = fetched
        delivery = message.delivery_info
        with self.pipe_or_acquire() as pipe:  # MULTI: recorded and out of the in-flight list at once
            pipe.zadd(self.unacked_index_key, {delivery_tag: time.time()}) \
                .hset(self.unacked_key, delivery_tag, dumps([message._raw, delivery["exchange"],
                                                              delivery["routing_key"]])) \
                .lrem(inflight, 1, raw) \
                .execute()
        virtual.QoS.append(self, message, delivery_tag)

    def restore_visible(self, start: int = 0, num: int = 10, interval: int = 10) -> None:
        """kombu's sweep of ``unacked`` messages past their visibility timeout; skipped while Redis
        refuses writes (its lock is a ``SET``): the next sweep does it (module doc, "A full Redis")."""
        try:
            super().restore_visible(start, num, interval)
        except redis.exceptions.ResponseError as exc:
            if not refuses_writes(exc):
                raise
            log.warning("restoring timed-out messages skipped: Redis refuses writes (%s)", exc)

    def restore_unacked(self, client: redis.Redis | None = None) -> None:
        delivered = set(self._delivered)
        kept = delivered if self.channel.transport_gone() else delivered & _held_messages()
        if kept:
            log.warning("broker channel closed: %d held message(s) stay held (leases renewed until acked)",
                        len(kept))
        if delivered - kept:
            with self.channel.conn_or_acquire(client) as client:
                for tag in delivered - kept:
                    self.restore_by_tag(tag, client=client)
        self._delivered.clear()


class Channel(kombu_redis.Channel):
    """A kombu Redis channel whose commands share one client per connection pool."""

    QoS = QoS
    from_transport_options = kombu_redis.Channel.from_transport_options + ("replicas_to_wait",)
    replicas_to_wait = 0  # a send returns once this many replicas hold the message (module doc)
    _shared_client: redis.Redis | None = None
    _fetching: str | None = None  # the queue a BLMOVE was sent for
    _fetched: tuple[str, bytes] | None = None  # (in-flight list, raw message) delivered, not yet recorded
    _pinned: redis.Redis | None = None  # the one-connection client of a send being confirmed

    def take_fetched(self) -> tuple[str, bytes] | None:
        """The in-flight entry of the message being delivered, once (for its ``unacked`` record)."""
        fetched, self._fetched = self._fetched, None
        return fetched

    def _brpop_start(self, timeout: float | None = None) -> None:
        """kombu's blocking fetch, as ``BLMOVE`` into the queue's in-flight list when this channel
        consumes one queue (see the module doc)."""
        queues = list(self.active_queues)
        keys_ = [self._q_for_pri(queue, pri) for pri in self.priority_steps for queue in queues]
        if len(set(keys_)) != 1 or self.global_keyprefix:
            self._fetching = None
            super()._brpop_start(timeout)
            return
        queue = self._fetching = queues[0]
        self._in_poll = self.client.connection
        self._brpop_sent_at = time.monotonic()
        self.client.connection.send_command("BLMOVE", queue, keys.inflight_list(queue), "RIGHT", "LEFT",
                                            self.brpop_timeout if timeout is None else timeout)

    def _brpop_read(self, **options: Any) -> bool:
        queue = self._fetching
        if queue is None:
            return super()._brpop_read(**options)
        try:
            try:
                raw = self.client.parse_response(self.client.connection, "BLMOVE", **options)
            except self.connection_errors:
                self.client.connection.disconnect()
                raise
            except redis.exceptions.ResponseError as exc:
                if not refuses_writes(exc):
                    raise
                log.warning("fetching paused: Redis refuses writes (%s); trying again in %.0fs", exc,
                            REFUSED_FETCH_PAUSE_S)
                time.sleep(REFUSED_FETCH_PAUSE_S)
                raise Empty() from None
            if raw is None:
                raise Empty()
            self._queue_cycle.rotate(queue)
            inflight = keys.inflight_list(queue)
            try:
                message = loads(bytes_to_str(raw))
            except Exception:
                self._drop_fetched(inflight, raw)
                raise
            self._fetched = (inflight, raw)
            try:
                self.connection._deliver(message, queue)
            finally:
                if self._fetched is not None:  # delivered without a record here (no_ack, rejected)
                    self._drop_fetched(*self._fetched)
                    self._fetched = None
            return True
        finally:
            self._in_poll = None
            self._flush_brpop_reauth()

    def _put(self, queue: str, message: dict[str, Any], **kwargs: Any) -> None:
        """kombu's send; with ``replicas_to_wait``, confirmed by that many replicas (module doc)."""
        if not self.replicas_to_wait or "_publish_batch" in kwargs:
            self._push(queue, message, **kwargs)
            return
        with self.conn_or_acquire() as shared:
            pinned = redis.Redis(connection_pool=shared.connection_pool, single_connection_client=True)
            try:
                self._pinned = pinned  # the push and the WAITs go over one connection
                self._push(queue, message, **kwargs)
                self._confirm(pinned, queue)
            finally:
                self._pinned = None
                pinned.close()

    def _push(self, queue: str, message: dict[str, Any], **kwargs: Any) -> None:
        """kombu's push, through :meth:`conn_or_acquire`; a message that carries its pending record
        (``keys.PENDING_HEADER``) is queued with the record in one step (see the module doc,
        "Sending loses nothing")."""
        headers = message.get("headers") or {}
        record, task_id = headers.get(keys.PENDING_HEADER), headers.get("id")
        if not isinstance(record, str) or not isinstance(task_id, str):
            super()._put(queue, message, **kwargs)
            return
        if kwargs.get("_publish_batch") is not None:  # a non-transactional pipeline: the pair could split
            raise ValueError(f"message {task_id} carries its pending record and cannot go in a publish batch")
        key = self._q_for_pri(queue, self._get_message_priority(message, reverse=False))
        with self.conn_or_acquire() as client:
            Ledger(client, give_up_s=0).push_recorded(key, dumps(message), task_id, record)  # the sender retries

    def _confirm(self, client: redis.Redis, queue: str) -> None:
        """``WAIT`` until ``replicas_to_wait`` replicas hold what ``client`` wrote to ``queue``, logging
        every :data:`CONFIRM_LOG_EVERY_S`. Raises as the connection fails (a primary lost or demoted)."""
        started = log_at = time.monotonic()
        while (confirmed := self._wait_once(client)) < self.replicas_to_wait:
            if time.monotonic() - log_at >= CONFIRM_LOG_EVERY_S:
                log_at = time.monotonic()
                log.warning("a message to %s is confirmed by %d of %d replica(s) after %.0fs: waiting for a "
                            "replica (a send is sent once one holds it)", queue, confirmed, self.replicas_to_wait,
                            log_at - started)

    def _wait_once(self, client: redis.Redis) -> int:
        """One ``WAIT``; a primary turned replica meanwhile (Redis unblocks the ``WAIT``, or refuses it
        on a replica) raises ConnectionError, as a lost primary does: the sender sends again."""
        try:
            return client.wait(self.replicas_to_wait, WAIT_TIMEOUT_MS)
        except redis.exceptions.ResponseError as exc:
            if str(exc).startswith(DEMOTED_REPLIES):
                raise redis.exceptions.ConnectionError(f"the primary became a replica during a send: {exc}") from exc
            raise

    def _drop_fetched(self, inflight: str, raw: bytes) -> None:
        with self.conn_or_acquire() as client:
            client.lrem(inflight, 1, raw)

    def _inplace_augment_message(self, message: dict, exchange: str, routing_key: str) -> None:
        """kombu's encoding and delivery tag; a task message's tag then gets its task id in front."""
        super()._inplace_augment_message(message, exchange, routing_key)
        task_id = (message.get("headers") or {}).get("id")
        if isinstance(task_id, str):
            properties = message["properties"]
            properties["delivery_tag"] = keys.delivery_tag(task_id, properties["delivery_tag"])

    def transport_gone(self) -> bool:
        """True once the channel's connection or its transport's settings were released."""
        return self.connection is None or self.connection.client is None

    @contextmanager
    def conn_or_acquire(self, client: redis.Redis | None = None) -> Iterator[redis.Redis]:
        client = client or self._pinned
        if client is not None:
            yield client
            return
        shared = self._shared_client
        if self.transport_gone():  # closed after a lost connection: acks of running tasks still go through
            if shared is None:
                raise redis.exceptions.ConnectionError("this broker channel is closed and never had a client")
            yield shared
            return
        if shared is None or shared.connection_pool is not self.pool:
            shared = self._shared_client = self._create_client()
        yield shared


class SentinelChannel(Channel, kombu_redis.SentinelChannel):
    """:class:`Channel` on kombu's Sentinel channel; the sentinels are the transport option
    ``sentinels`` (``[(host, port), ...]``, asked in order), the primary's name ``master_name``."""

    from_transport_options = kombu_redis.SentinelChannel.from_transport_options + ("replicas_to_wait", "sentinels")
    sentinels: list[tuple[str, int]] = []

    def _sentinel_managed_pool(self, asynchronous: bool = False) -> redis.ConnectionPool:
        """kombu's pool of connections to the primary, from :attr:`sentinels` (kombu reads its
        alternates, which layertap does not give it: module doc)."""
        if not self.sentinels or not getattr(self, "master_name", None):
            raise ValueError("a Sentinel broker needs the transport options 'sentinels' and 'master_name'")
        params = self._connparams(asynchronous)
        params.pop("host", None)
        params.pop("port", None)
        manager = redis.Sentinel([tuple(address) for address in self.sentinels],
                                 sentinel_kwargs=getattr(self, "sentinel_kwargs", None), **params)
        if asynchronous:  # kept so that kombu closes its connections to the sentinels with the channel's
            self._async_sentinel_manager = manager
        else:
            self._sentinel_manager = manager
        return manager.master_for(self.master_name, redis.Redis).connection_pool


class Transport(kombu_redis.Transport):
    """kombu's Redis transport with :class:`Channel`."""

    Channel = Channel


class SentinelTransport(Transport, kombu_redis.SentinelTransport):
    """kombu's Sentinel transport with :class:`SentinelChannel`."""

    default_port = kombu_redis.SentinelTransport.default_port
    Channel = SentinelChannel


def transport_for(broker_url: str) -> str | None:
    """The kombu transport to use for ``broker_url``: ours for plain, TLS and Sentinel Redis, else None."""
    if is_sentinel_url(broker_url):
        return SENTINEL_TRANSPORT_PATH
    scheme = broker_url.split("://", 1)[0].lower()
    return TRANSPORT_PATH if scheme in REUSED_CLIENT_SCHEMES else None
