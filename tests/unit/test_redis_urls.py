"""Redis URLs (issue 45, items 4 and 5): every form redis-py and kombu take is printed without its
passwords, and a ``sentinel://`` URL reaches redis-py, kombu and Celery's result backend as each
spells Sentinel. Nothing here connects: clients and apps are built, not used."""

from __future__ import annotations

import pytest
import redis
from redis.sentinel import SentinelConnectionPool, SentinelManagedSSLConnection

from layertap.settings import Settings, TlsSettings
from layertap.transport.broker_transport import SENTINEL_TRANSPORT_PATH, transport_for
from layertap.transport.celery_app import celery_urls, make_celery, replicas_to_wait, transport_options
from layertap.transport.redis_conn import connect, refuses_writes
from layertap.transport.redis_url import (
    SentinelUrl,
    check_redis_url,
    parse_sentinel_url,
    redacted_url,
)

SECRET = "pa55"


@pytest.mark.parametrize("url", [
    f"redis://:{SECRET}@host:6379/0",
    f"redis://user:{SECRET}@host/0?db=1",
    f"redis://host:6379/0?password={SECRET}",
    f"redis://host:6379/0?socket_timeout=5&password={SECRET}&db=2",
    f"rediss://user:{SECRET}@host:6380/0?ssl_cert_reqs=required&ssl_password={SECRET}",
    f"unix://:{SECRET}@/run/redis.sock?db=0",
    f"unix:///run/redis.sock?db=0&password={SECRET}",
    f"redis://:{SECRET}@[::1]:6379/0",
    f"redis://:p@{SECRET}@host:6379/0",  # an unencoded "@" in the password (urllib splits at the last)
    f"redis://:{SECRET}%40x@host:6379/0",
    f"redis://:ab?{SECRET}@host/0",  # an unencoded "?" in it: a URL no client reads, still not printed
    f"redis://:x;{SECRET}@host:6379/0",  # an unencoded ";" in it: one address, not two
    f"redis://:{SECRET}@h1:6379;redis://:{SECRET}@h2:6379",  # kombu's alternates
    f"sentinel://:{SECRET}@h1:26379;sentinel://:{SECRET}@h2:26380/0?master_name=m&sentinel_password={SECRET}",
    f"sentinel://:{SECRET}@h1:26379;h2",  # issue 45: a sentinel-style netloc used to raise
    f"sentinel://:{SECRET}@h1:26379;h2:26380;:{SECRET}@h3",
    f"sentinel://h1:26379;:{SECRET}@h2:26380",
])
def test_no_password_survives_redaction(url):
    redacted = redacted_url(url)
    assert SECRET not in redacted and "***" in redacted


@pytest.mark.parametrize("url", ["", "localhost", "redis://", "::::", "@@@", "redis://host/0?client_name=a@b",
                                 "redis://user@host:6379/0", "sentinel://h1:26379;;sentinel://h2"])
def test_redaction_keeps_what_holds_no_password_and_never_raises(url):
    assert redacted_url(url) == url


def test_a_sentinel_url_is_read_as_celery_spells_it():
    url = (f"sentinel://app:{SECRET}%3Bx@10.0.0.1:26379;sentinel://10.0.0.2;sentinel://[::1]:26381/3"
           f"?master_name=mymaster&sentinel_password=s%26p&ssl=true")
    assert parse_sentinel_url(url) == SentinelUrl(
        sentinels=(("10.0.0.1", 26379), ("10.0.0.2", 26379), ("::1", 26381)), master_name="mymaster",
        username="app", password=f"{SECRET};x", db=3, sentinel_password="s&p", ssl=True)
    settings = Settings(redis_url=url)
    broker, backend = celery_urls(settings)
    assert broker == f"sentinel://app:{SECRET}%3Bx@10.0.0.1:26379/3"  # one address: no kombu alternates
    assert backend.split(";")[1:] == [f"sentinel://app:{SECRET}%3Bx@10.0.0.2:26379/3",
                                      f"sentinel://app:{SECRET}%3Bx@[::1]:26381/3"]


@pytest.mark.parametrize("url,message", [
    ("sentinel://h1:26379", "no master_name"),
    ("sentinel://h1:26379/0?master_name=", "no master_name"),
    ("sentinel://h1:26379;h2:26379/0?master_name=m", "its own sentinel://"),
    (f"sentinel://:{SECRET}@h1;sentinel://:other@h2/0?master_name=m", "different values of password"),
    ("sentinel://h1/1;sentinel://h2/2?master_name=m", "different values of db"),
    ("sentinel://h1/x?master_name=m", "must be a number"),
    ("sentinel://h1?master_name=m&socket_timeout=1", "unknown parameter"),
    ("sentinel://h1?master_name=m&ssl=maybe", "ssl must be true or false"),
    ("sentinel://h1:port?master_name=m", "Port could not be cast"),
    ("sentinel://:26379?master_name=m", "without a host"),
])
def test_a_sentinel_url_it_cannot_read_is_refused_without_its_password(url, message):
    with pytest.raises(ValueError, match=message) as refused:
        parse_sentinel_url(url)
    assert SECRET not in str(refused.value)


def test_clients_and_apps_refuse_a_bad_url_without_repeating_it():
    for url in (f"sentinel://:{SECRET}@h1:26379;h2", f"redis://:{SECRET}@h1:6379;redis://h2:6379"):
        for build in (connect, make_celery):
            with pytest.raises(ValueError) as refused:
                build(Settings(redis_url=url))
            assert SECRET not in str(refused.value) and "sentinel://" in str(refused.value)
    check_redis_url(f"redis://:{SECRET}@h1:6379/0?password={SECRET}")  # one address: redis-py reads it


def test_sends_wait_for_a_replica_by_default_only_through_sentinel():
    sentinel = "sentinel://h1:26379/0?master_name=m"
    assert replicas_to_wait(Settings(redis_url=sentinel)) == 1
    assert replicas_to_wait(Settings(redis_url="redis://h1:6379/0")) == 0
    assert replicas_to_wait(Settings(redis_url=sentinel, redis_wait_replicas=0)) == 0
    assert replicas_to_wait(Settings(redis_url="redis://h1:6379/0", redis_wait_replicas=2)) == 2


def test_celery_broker_and_result_backend_get_the_sentinels_master_name_and_passwords():
    url = f"sentinel://:{SECRET}@127.0.0.1:26379;sentinel://127.0.0.1:26380/2?master_name=m&sentinel_password=sp"
    settings = Settings(redis_url=url, result_backend=True)
    assert transport_for(url) == SENTINEL_TRANSPORT_PATH
    options = transport_options(settings)
    assert options["master_name"] == "m" and options["sentinels"] == [["127.0.0.1", 26379], ["127.0.0.1", 26380]]
    assert options["sentinel_kwargs"]["password"] == "sp" and options["replicas_to_wait"] == 1
    app = make_celery(settings)
    connection = app.connection_for_write()
    assert connection.transport_cls == SENTINEL_TRANSPORT_PATH and connection.alt == []
    assert (connection.hostname, connection.port, connection.password, connection.virtual_host) == (
        "127.0.0.1", 26379, SECRET, "2")
    assert connection.transport_options["master_name"] == "m"
    backend = app.backend
    assert type(backend).__name__ == "SentinelBackend"
    assert [(host["host"], host["port"]) for host in backend.connparams["hosts"]] == [("127.0.0.1", 26379),
                                                                                   ("127.0.0.1", 26380)]
    assert backend.connparams["password"] == SECRET and backend.connparams["db"] == 2
    assert backend._transport_options["master_name"] == "m"
    assert SECRET not in backend.as_uri()


def test_a_client_follows_the_primary_through_the_sentinels_in_order():
    url = f"sentinel://user:{SECRET}@127.0.0.1:26379;sentinel://127.0.0.1:26380/4?master_name=m&ssl=true"
    client = connect(Settings(redis_url=url, tls=TlsSettings(ca_certs="/ca.pem")))
    pool = client.connection_pool
    assert isinstance(pool, SentinelConnectionPool) and pool.service_name == "m"
    assert pool.connection_class is SentinelManagedSSLConnection
    assert (pool.connection_kwargs["username"], pool.connection_kwargs["password"], pool.connection_kwargs["db"]) == (
        "user", SECRET, 4)
    sentinels = pool.sentinel_manager.sentinels
    assert [sentinel.connection_pool.connection_kwargs["port"] for sentinel in sentinels] == [26379, 26380]
    asked = sentinels[0].connection_pool.connection_kwargs
    assert asked["ssl_ca_certs"] == "/ca.pem" and asked.get("password") is None  # TLS to the sentinels, no password
    assert sentinels[0].connection_pool.connection_class is redis.SSLConnection


def test_refusals_of_a_primary_short_of_replicas_are_waited_out_in_pipelines_too():
    assert refuses_writes(redis.exceptions.ResponseError("NOREPLICAS Not enough good replicas to write."))
    assert refuses_writes(redis.exceptions.ResponseError(
        "Command # 1 (HSET k f v) of pipeline caused error: NOREPLICAS Not enough good replicas to write."))
    assert refuses_writes(redis.exceptions.ResponseError(
        "Command # 2 (SET k v) of pipeline caused error: MISCONF Redis is configured to save RDB snapshots"))
    assert not refuses_writes(redis.exceptions.ResponseError("ERR unknown command"))
