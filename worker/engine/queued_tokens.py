"""How many tokens the engine's queue holds to compute: what its prepare-ahead limit and its
batch-full test count.

With prefix sharing a row that another queued row begins with is sliced from it, not computed
(``prefix_share``), so each request counts only the tokens it adds to the longest queued row of
its family (queued rows whose tokens begin with one another's): a conversation's per-turn rows,
in whatever order they come, count as its longest row. Families are found by their first
:data:`KEY_TOKENS` tokens. A request counts what it counted when it was queued until it leaves the
queue, so a family that batches split may count fewer tokens than they compute: this is a
scheduling figure, never a memory bound (batches are still priced by ``BatchPolicy``).
"""

from __future__ import annotations

from layertap.worker.engine.prefix_share import may_share
from layertap.worker.engine.records import EngineRequest

#: Rows are looked up among those that share their first this many tokens.
KEY_TOKENS = 16


def _family_key(request: EngineRequest) -> bytes:
    return request.token_bytes[:KEY_TOKENS * request.token_ids.element_size()]


class QueuedTokens:
    """The tokens queued requests will compute (``total``); used under the engine's lock."""

    def __init__(self) -> None:
        self.total = 0
        self._counted: dict[int, int] = {}  # id(request) -> tokens it counts
        self._families: dict[bytes, list[EngineRequest]] = {}

    def add(self, request: EngineRequest, sharing: bool) -> None:
        """Count a request as it is queued (``sharing``: the engine shares prefixes now)."""
        tokens = request.num_tokens
        if sharing and may_share(request):
            own = request.token_bytes
            family = self._families.setdefault(_family_key(request), [])
            related = [other.num_tokens for other in family
                       if other.token_bytes.startswith(own) or own.startswith(other.token_bytes)]
            if related:
                tokens = max(0, tokens - max(related))
            family.append(request)
        self._counted[id(request)] = tokens
        self.total += tokens

    def remove(self, request: EngineRequest) -> None:
        """Take back what a request counted, as it leaves the queue."""
        self.total -= self._counted.pop(id(request))
        key = _family_key(request)
        family = self._families.get(key)
        if family is not None:
            rest = [other for other in family if other is not request]
            if rest:
                self._families[key] = rest
            else:
                del self._families[key]

    def clear(self) -> None:
        self.total = 0
        self._counted.clear()
        self._families.clear()
