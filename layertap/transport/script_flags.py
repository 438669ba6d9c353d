"""The project's Lua scripts: each in a ``.lua`` file beside the module that runs it (:func:`lua`),
run by :func:`run_script`, with its flags (``allow-oom``: it must write while Redis is full) as
every Redis the project supports (6.2 and newer) takes them.

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

import functools
import weakref
from collections.abc import Sequence
from importlib.resources import files
from typing import Any

import redis
from redis.client import Pipeline

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


@functools.cache
def lua(package: str, name: str) -> str:
    """The text of the script ``<name>.lua`` in ``package`` (read once)."""
    return files(package).joinpath(f"{name}.lua").read_text()


def run_script(client: redis.Redis | Pipeline, text: str, keys: Sequence[str], args: Sequence[Any] = ()) -> Any:
    """Run the script ``text`` as the server takes it (:func:`for_server`): ``EVALSHA`` (loaded on
    ``NOSCRIPT``), or queued on a pipeline as ``EVAL`` with the text (redis-py would first ask
    ``SCRIPT EXISTS``, a round trip per pipeline)."""
    text = for_server(client, text)
    if isinstance(client, Pipeline):
        return client.eval(text, len(keys), *keys, *args)
    return client.register_script(text)(keys=keys, args=args)
