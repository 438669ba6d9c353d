"""Lua scripts that declare flags (``allow-oom``: they must write while Redis is full), on every
Redis the project supports (6.2 and newer).

Script flags live in a shebang line (``#!lua flags=allow-oom``), which Redis 7.0 introduced.
Redis 6.2 compiles that line as Lua and refuses the whole script ("unexpected symbol near
'#'"), whatever the memory: every lease renewal, cancel, ledger trim and at-maxmemory sweep
turn failed there, so a batch running longer than the lease had its jobs delivered again
while it ran. :func:`for_server` gives a script as the server takes it: the shebang kept on 7.0
and newer, dropped before. Unflagged on 6.2, a script's writes are refused at maxmemory as any
write is: what runs at maxmemory needs Redis 7.

Invariant: a script's body (everything after its shebang) is the same on every server. The
version is asked once per connection pool (``INFO server``).
"""

from __future__ import annotations

import weakref
from typing import Any

import redis

#: The first Redis major version that reads a script's flags from its shebang.
FLAGS_SINCE_MAJOR = 7
_takes_flags: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def takes_script_flags(client: Any) -> bool:
    """Whether the server behind ``client`` (a ``redis.Redis`` or a pipeline of one) reads
    script flags: Redis 7.0 or newer."""
    pool = client.connection_pool
    known = _takes_flags.get(pool)
    if known is None:
        version = str(redis.Redis(connection_pool=pool).info("server")["redis_version"])
        known = _takes_flags[pool] = int(version.split(".")[0]) >= FLAGS_SINCE_MAJOR
    return known


def for_server(client: Any, script: str) -> str:
    """``script`` as the server behind ``client`` takes it: its ``#!`` flags line dropped
    where the server is older than 7.0 (see the module's docstring)."""
    if not script.startswith("#!") or takes_script_flags(client):
        return script
    return script.split("\n", 1)[1]
