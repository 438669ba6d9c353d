"""Every Redis the project supports (``SUPPORTED_REDIS``: 7 or newer, and the embedded 6.2).
Scripts that declare flags (``#!lua flags=allow-oom``) are taken as each server takes them
(``layertap.transport.script_flags``): Redis 6.2 refuses the flags line as a syntax
error, and had refused every lease renewal, cancel, ledger trim and at-maxmemory sweep turn."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from layertap.producer.dev.redis_server import RedisServer, embedded_redis_server, free_port
from layertap.transport.ledger import Ledger
from layertap.transport.script_flags import for_server, takes_script_flags
from layertap.worker.queue.lease import RENEW_LEASES
from layertap.worker.queue.periodic import take_turn
from tests.support.jobs import REDIS_SERVERS, SUPPORTED_REDIS

ROOT = Path(__file__).resolve().parents[2]


def flagged_scripts() -> dict[str, str]:
    """Every script of the project (its ``.lua`` files) that declares flags, by file name."""
    scripts = {path.name: path.read_text() for package in ("layertap", "producer", "worker")
               for path in (ROOT / package).rglob("*.lua")}
    return {name: text for name, text in scripts.items() if text.startswith("#!")}


@SUPPORTED_REDIS
def test_every_flagged_script_compiles_and_runs_on_the_server(private_redis):
    client = redis.Redis.from_url(private_redis.url, decode_responses=True)
    major = int(client.info("server")["redis_version"].split(".")[0])  # (the test's user may run INFO)
    assert major == 6 if private_redis.binary == embedded_redis_server() else major >= 7
    assert takes_script_flags(client) == (major >= 7)
    scripts = flagged_scripts()
    assert {"renew_leases.lua", "take_turn.lua", "cancel.lua", "trim_page.lua"} <= set(scripts)
    for name, text in scripts.items():
        taken = for_server(client, text)
        assert taken.startswith("#!") == (major >= 7), name
        assert client.script_load(taken), name  # compiles on this server
        if major < 7:
            assert taken == text.split("\n", 1)[1]  # the same body, without its flags line

    assert take_turn(client, "sweep-lock", "node-a", 30, at_maxmemory=True)
    assert not take_turn(client, "sweep-lock", "node-b", 30, at_maxmemory=True)  # a turn is one worker's
    Ledger(client, give_up_s=0).cancel("run-a")
    assert Ledger(client, give_up_s=0).cancelled_runs(["run-a", "run-b"]) == {"run-a"}
    pipe = client.pipeline(transaction=False)
    client.zadd("leases", {"tag-1": 1.0})
    pipe.eval(for_server(client, RENEW_LEASES), 1, "leases", 5.0, "tag-1", 6.0, "tag-gone")
    pipe.execute()
    assert client.zrange("leases", 0, -1, withscores=True) == [("tag-1", 5.0)]  # renewed; none added


@pytest.mark.parametrize("binary", list(REDIS_SERVERS.values()), ids=list(REDIS_SERVERS))
def test_a_user_without_dangerous_commands_runs_the_flagged_scripts(binary, tmp_path):
    """An ACL user of ``+@all -@dangerous`` (no ``INFO``, as managed Redis services often give
    applications): which scripts the server takes is found all the same."""
    port = free_port()
    acl = ["--user", "default", "off", "--user", "app", "on", ">app-pass", "~*", "&*", "+@all", "-@dangerous"]
    with RedisServer(port, tmp_path / "redis", extra_args=acl, url=f"redis://app:app-pass@127.0.0.1:{port}/0",
                     binary=binary) as server:
        client = redis.Redis.from_url(server.url, decode_responses=True)
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.info("server")
        assert takes_script_flags(client) == (binary != embedded_redis_server())
        assert take_turn(client, "sweep-lock", "node-a", 30, at_maxmemory=True)
        Ledger(client, give_up_s=0).cancel("run-a")
        assert Ledger(client, give_up_s=0).cancelled_runs(["run-a"]) == {"run-a"}
