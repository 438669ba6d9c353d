"""The worker registry: a crashed worker (SIGKILL: it cannot deregister) is shown dead, then
pruned once its last heartbeat is older than the window; a live worker is never pruned."""

from __future__ import annotations

import time

from layertap.producer.client.fleet import worker_records
from layertap.protocol import keys
from layertap.settings import Settings
from layertap.transport.redis_conn import connect


def test_a_sigkilled_worker_is_shown_dead_then_pruned(make_worker, private_redis):
    doomed, alive = make_worker("doomed@localhost"), make_worker("alive@localhost")
    client = connect(Settings(redis_url=private_redis.url), decode_responses=True)
    doomed.kill()
    deadline = time.monotonic() + 60
    while dict((node, up) for node, _, up in worker_records(client)).get("doomed@localhost") is not False:
        assert time.monotonic() < deadline, "the killed worker never showed as dead"
        time.sleep(0.2)
    assert client.hexists(keys.WORKERS_HASH, "doomed@localhost")  # within the window: listed, dead
    assert [(node, up) for node, _, up in worker_records(client, keep_dead_s=0)] == [("alive@localhost", True)]
    assert client.hkeys(keys.WORKERS_HASH) == ["alive@localhost"]
    alive.kill()
