"""A send with ``redis_wait_replicas`` (the default with Sentinel) is sent once a replica holds it,
never before: a primary left without a replica keeps the sender waiting, past the 10 s after which
sends used to go on unconfirmed (a later failover could then demote that primary and drop the
message with its ledger record, as a flapping Sentinel set did); a replica coming back confirms it.
A primary turned replica during the wait fails the send as a lost connection does, so the sender
sends it again. Real Redis servers."""

from __future__ import annotations

import threading
import time

import pytest
import redis

from layertap.producer.client.client import Client
from layertap.producer.dev.redis_server import RedisServer
from layertap.protocol import keys
from layertap.settings import Settings
from layertap.transport.broker_transport import DEMOTED_REPLIES

#: Longer than the old give-up (10 s): a send still waiting then was never taken as sent unconfirmed.
PAST_THE_OLD_GIVE_UP_S = 13.0


def test_a_send_waits_for_a_replica_and_is_sent_once_one_holds_it(tmp_path):
    with RedisServer(data_dir=tmp_path / "primary") as primary:
        settings = Settings(redis_url=primary.url, redis_wait_replicas=1)
        outcome: dict[str, object] = {}

        def send() -> None:
            with Client(settings) as client:
                outcome["job"] = client.submit({"prompt": "held until a replica has it"}, model="tiny-qwen3",
                                               run="confirmed", check=False)

        sending = threading.Thread(target=send, daemon=True)
        sending.start()
        time.sleep(PAST_THE_OLD_GIVE_UP_S)
        assert sending.is_alive(), "the send returned with no replica holding it"
        with RedisServer(data_dir=tmp_path / "replica", extra_args=["--replicaof", "127.0.0.1", str(primary.port)]):
            sending.join(timeout=300)
            assert not sending.is_alive()
            assert "job" in outcome
            stored = redis.Redis.from_url(primary.url)
            assert sum(stored.llen(key) for key in stored.scan_iter(keys.QUEUE_PATTERN)) == 1


@pytest.mark.parametrize("when", ["during the wait", "before the next wait"])
def test_a_primary_turned_replica_fails_the_wait_as_a_lost_connection(tmp_path, when):
    """The replies Redis gives a ``WAIT`` on a primary that turns replica are the ones the transport
    maps to a lost connection (``DEMOTED_REPLIES``)."""
    with RedisServer(data_dir=tmp_path / "redis", appendonly=False) as server:
        client = redis.Redis.from_url(server.url)
        replies: list[str] = []

        def wait() -> None:
            try:
                redis.Redis.from_url(server.url).wait(1, 30_000)
            except redis.exceptions.ResponseError as exc:
                replies.append(str(exc))

        waiting = threading.Thread(target=wait)
        if when == "during the wait":
            waiting.start()
            while not any(line.startswith("id=") and "cmd=wait" in line
                          for line in client.execute_command("CLIENT", "LIST").decode().splitlines()):
                time.sleep(0.05)
        client.execute_command("REPLICAOF", "127.0.0.1", "1")  # a primary that is not there
        if when != "during the wait":
            waiting.start()
        waiting.join(timeout=60)
        assert len(replies) == 1 and replies[0].startswith(DEMOTED_REPLIES), replies
