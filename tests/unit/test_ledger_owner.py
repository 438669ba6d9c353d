"""The run ledger has one owner: no module but ``layertap.transport.ledger`` writes or reads a
job's or a run's Redis state. Checked on the source: a Redis write or read command (or a script)
whose keys come from a job or run key of ``layertap.protocol.keys`` (directly, or through a name
or attribute assigned from one in the same module) is a finding anywhere else."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OWNER = ROOT / "layertap" / "transport" / "ledger"

#: redis-py methods that change state.
WRITES = {"hset", "hdel", "hincrby", "hsetnx", "hmset", "xadd", "xack", "xdel", "xtrim", "xgroup_create",
          "xgroup_destroy", "xreadgroup", "xclaim", "xautoclaim", "incr", "incrby", "decr", "expire", "pexpire",
          "sadd", "srem",
          "zadd", "zrem", "lpush", "rpush", "lrem", "ltrim", "lmove", "set", "setnx", "getdel", "delete", "unlink",
          "rename", "publish", "eval", "evalsha", "register_script"}
#: redis-py methods that read state (a pub/sub subscription too).
READS = {"get", "mget", "hget", "hmget", "hgetall", "hkeys", "hvals", "hlen", "hexists", "hscan", "hscan_iter",
         "smembers", "sismember", "smismember", "scard", "sscan", "sscan_iter", "zscore", "zrange", "zrangebyscore",
         "zrevrange", "zcard", "zcount", "zscan", "zscan_iter", "xrange", "xrevrange", "xread", "xlen", "xinfo_groups",
         "xinfo_stream", "xpending", "xpending_range", "exists", "lrange", "lindex", "llen", "scan", "scan_iter",
         "memory_usage", "ttl", "type", "subscribe", "psubscribe"}

#: The keys of a job's and a run's state (``keys.run_*`` are too).
LEDGER_KEYS = {"results_stream", "attempts_key", "attempts_pattern", "PENDING_HASH", "SUSPECT_HASH",
               "PENDING_QUEUES_SET", "pending_sent_zset", "DEAD_LETTER_STREAM", "RECOVERED_COUNTER",
               "start_token_key", "capture_hash"}


def _is_ledger_key(name: str) -> bool:
    return name in LEDGER_KEYS or name.startswith("run_")


def _mentions(node: ast.AST, tainted: set[str]) -> bool:
    for part in ast.walk(node):
        if isinstance(part, ast.Attribute):
            if isinstance(part.value, ast.Name) and part.value.id == "keys" and _is_ledger_key(part.attr):
                return True
            if part.attr in tainted:
                return True
        if isinstance(part, ast.Name) and part.id in tainted:
            return True
    return False


def ledger_calls(source: str, name: str, commands: set[str] = WRITES) -> list[str]:
    """``name:line command`` of every call of one of ``commands`` (writes by default) on job or
    run state in the module ``source``."""
    tree = ast.parse(source, filename=name)
    tainted: set[str] = set()
    changed = True
    while changed:  # names and attributes assigned from a ledger key, to a fixed point
        changed = False
        for node in ast.walk(tree):
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None \
                    and _mentions(node.value, tainted):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    for part in ast.walk(target):
                        assigned = part.id if isinstance(part, ast.Name) else part.attr if isinstance(
                            part, ast.Attribute) else None
                        if assigned and assigned not in tainted and assigned != "self":
                            tainted.add(assigned)
                            changed = True
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in commands \
                and any(_mentions(arg, tainted) for arg in [*node.args, *(kw.value for kw in node.keywords)]):
            found.append(f"{name}:{node.lineno} {node.func.attr}")
    return found


def other_modules() -> list[Path]:
    """Every module of the project outside the ledger."""
    modules = [path for package in ("producer", "worker", "layertap") for path in sorted((ROOT / package).rglob("*.py"))
               if OWNER not in path.parents and "shims" not in path.parts]
    assert len(modules) > 100
    return modules


def test_only_the_ledger_writes_job_and_run_state():
    found = [finding for path in other_modules() for finding in ledger_calls(path.read_text(),
                                                                              str(path.relative_to(ROOT)))]
    assert found == [], "job or run state written outside layertap/transport/ledger:\n" + "\n".join(found)


def test_only_the_ledger_reads_job_and_run_state():
    """A module that needs a job's or a run's state asks the ledger (``Ledger``'s reads)."""
    found = [finding for path in other_modules()
             for finding in ledger_calls(path.read_text(), str(path.relative_to(ROOT)), READS)]
    assert found == [], "job or run state read outside layertap/transport/ledger:\n" + "\n".join(found)


def test_the_check_sees_a_write_and_a_read_through_a_name():
    source = ("def f(client, run):\n    stream = keys.results_stream(run)\n    client.xadd(stream, {})\n"
              "    client.hget(keys.run_status_hash(run), 'j')\n    client.get('other')\n")
    assert ledger_calls(source, "probe.py") == ["probe.py:3 xadd"]
    assert ledger_calls(source, "probe.py", READS) == ["probe.py:4 hget"]


def test_every_lua_script_is_a_lua_file():
    """No Lua inside Python source: a script is a ``.lua`` file beside the module that runs it."""
    inline = [str(path.relative_to(ROOT)) for package in ("producer", "worker", "layertap")
              for path in sorted((ROOT / package).rglob("*.py")) if "redis.call(" in path.read_text()]
    assert inline == []
