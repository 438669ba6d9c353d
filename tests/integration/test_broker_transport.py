"""The broker transport: kombu's Redis transport with one reused client per channel."""

from __future__ import annotations

from layertap.settings import Settings
from layertap.transport.broker_transport import Channel, transport_for
from layertap.transport.celery_app import make_celery


def test_redis_and_sentinel_urls_get_the_reused_client_transport():
    assert transport_for("redis://localhost:6379/0") == "layertap.transport.broker_transport:Transport"
    assert transport_for("rediss://user:pw@host:6380/1") == "layertap.transport.broker_transport:Transport"
    assert transport_for("sentinel://localhost:26379/0?master_name=m") == (
        "layertap.transport.broker_transport:SentinelTransport")
    assert transport_for("memory://") is None


def test_channel_reuses_one_client_until_its_pool_is_replaced(redis_server):
    app = make_celery(Settings(redis_url=redis_server.url))
    with app.connection_for_write() as connection:
        channel = connection.default_channel
        assert isinstance(channel, Channel)
        with channel.conn_or_acquire() as first, channel.conn_or_acquire() as second:
            assert first is second and first.ping()
        channel._disconnect_pools()  # what kombu does after a fork or a lost connection
        with channel.conn_or_acquire() as third:
            assert third is not first and third.connection_pool is channel.pool and third.ping()
        with channel.conn_or_acquire(first) as given:
            assert given is first  # a client passed in is used as is
        queue = "layertap-transport-test"
        channel.queue_declare(queue)
        channel.basic_publish(channel.prepare_message("hello"), exchange="", routing_key=queue)
        message = channel.basic_get(queue, no_ack=False)
        assert message.body == b"hello"
        with channel.conn_or_acquire() as client:
            assert client.hexists(channel.qos.unacked_key, message.delivery_tag)  # held until acked
            message.ack()
            assert not client.hexists(channel.qos.unacked_key, message.delivery_tag)
