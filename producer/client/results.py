"""Reading a run's results stream (the run ledger's ``read_results``): the one parser of its
entries and the one paged reader, shared by the Client, ``layertap watch``/``status`` and the
streaming dataset. An entry holds one result as flat JSON under ``keys.RESULT_FIELD``; reads
start after a stream id (``"0"``: from the start), so following a run costs O(new entries)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from layertap.protocol.schema import Result
from layertap.transport.ledger import Ledger
from layertap.transport.ledger import entry_result as entry_result  # the one parser of an entry

if TYPE_CHECKING:
    import redis

#: Entries per read.
PAGE = 1000
START = "0"


def read_after(client: redis.Redis, run: str, after: str = START, *, count: int = PAGE,
               block_ms: int | None = None) -> list[tuple[str, Result]]:
    """Up to ``count`` ``(entry id, result)`` after stream id ``after``; with ``block_ms``, wait
    that long for one to come when there are none. ``client`` decodes responses."""
    return Ledger(client, give_up_s=0).read_results(run, after, count=count, block_ms=block_ms)


def stream_results(client: redis.Redis, run: str, after: str = START) -> Iterator[tuple[str, Result]]:
    """Every ``(entry id, result)`` of the run's stream after ``after``, in order, a page at a time."""
    while True:
        page = read_after(client, run, after)
        yield from page
        if len(page) < PAGE:
            return
        after = page[-1][0]
