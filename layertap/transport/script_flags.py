"""Lua scripts that declare flags (``allow-oom``: they must write while Redis is full), on every
Redis the project supports (6.2 and newer).

Script flags live in a shebang line (``#!lua flags=allow-oom``), which Redis 7.0 introduced.
Redis 6.2 compiles that line as Lua and refuses the whole script ("unexpected symbol near
'#'"), whatever the memory: every lease renewal, cancel, ledger trim and at-maxmemory sweep
turn failed there, so a batch running longer than the lease had its jobs delivered again
while it ran. :func:`for_server` gives a script as the server takes it: the shebang kept on 7.0
and newer, dropped before. Unflagged on 6.2, a script's writes are refused at maxmemory as any
write is: what runs at maxmemory needs Redis 7.

Invariant: a script's body (everything after its shebang) is the same on every server. Whether
the server reads flags is asked once per connection pool, by running a script with a shebang
(``EVAL``, which every layertap user may run; ``INFO`` is in ACL's ``@dangerous`` category,
which a restricted user often lacks): a server replaced by an older one under running
processes needs them restarted.
"""

from __future__ import annotations

import weakref
from typing import Any

import redis

#: A script with a flags line: Redis 7 and newer run it (read-only, so also at maxmemory and on
#: a replica), 6.2 fails to compile it.
PROBE = "#!lua flags=no-writes\nreturn 1"
_takes_flags: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def takes_script_flags(client: Any) -> bool:
    """Whether the server behind ``client`` (a ``redis.Redis`` or a pipeline of one) reads
    script flags (Redis 7.0 or newer). Raises what Redis raises when it cannot answer."""
    pool = client.connection_pool
    known = _takes_flags.get(pool)
    if known is None:
        try:
            redis.Redis(connection_pool=pool).eval(PROBE, 0)
            known = True
        except redis.exceptions.ResponseError as exc:
            if "compiling" not in str(exc):
                raise
            known = False
        _takes_flags[pool] = known
    return known


def for_server(client: Any, script: str) -> str:
    """``script`` as the server behind ``client`` takes it: its ``#!`` flags line dropped
    where the server is older than 7.0 (see the module's docstring)."""
    if not script.startswith("#!") or takes_script_flags(client):
        return script
    return script.split("\n", 1)[1]
