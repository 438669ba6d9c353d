"""The ledger's server-side steps: one ``.lua`` file each beside this module, run by name."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis
from redis.client import Pipeline

from layertap.transport.script_flags import lua, run_script


def run_lua(client: redis.Redis | Pipeline, name: str, keys: Sequence[str], args: Sequence[Any] = ()) -> Any:
    """Run ``<name>.lua`` of the ledger (``script_flags.run_script``: queued on a pipeline)."""
    return run_script(client, lua(__package__, name), keys, args)
