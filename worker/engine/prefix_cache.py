"""Rows that begin with tokens an earlier batch computed: only their new tokens are computed.

A causal model's keys, values and states at a token depend only on the tokens up to it. So once a
batch has run, its rows' attention keys and values (every layer it ran) and captured states stay on
the device as a :class:`CachedBatch`, and a later row whose first ``p`` tokens equal a cached row's
first ``p`` computes only its tokens from ``p`` on: its queries attend to the cached keys and values
of those ``p`` tokens and its own (``layertap.worker.engine.prefix_keys``), and its file's first
``p`` positions are the cached states. Per-turn training rows that arrive in different batches (in
turn order, shuffled, in other bundles) are such rows; so is a job sent again.

Invariants:

* the cache belongs to one engine, so to one loaded model, compute dtype and revision; rows match
  on their token ids alone (a template changes the ids);
* a row uses a cached prefix only where the cached batch captured every layer of the using batch
  (and its final states where the using batch wants them) and ran at least as many decoder layers;
  it always computes at least its last token, and a row whose every token is cached keeps the
  cached states of that one too (the same tokens give the same file);
* the cache holds at most ``budget_bytes`` of device memory; a cached row that a later kept row
  holds whole (the turn before it) is found in the later one from then on; a batch none of whose
  rows is held only by it goes, and one whose such rows are half of its tokens or fewer keeps only
  those (a device copy: rows held whole elsewhere take no room; shuffled rows leave many such
  batches); and beyond the budget the least
  recently used batches go, except while rows lately missed a prefix the budget evicted (a scan:
  every conversation's next turn comes after a round of all the others', so the least recently used
  row is the next one needed): then the most recently kept batch that has served no row goes, until
  a budget's worth of batches has been kept since the last such miss (:meth:`PrefixCache._victim`);
  a batch larger than the budget is not kept, nor is one over half of it (:meth:`PrefixCache.keeps`:
  its forward holds every layer's keys and values until it ends), which then runs as it would
  without the cache; out of memory empties the cache and halves its budget;
* rows are found by chained hashes of their first :data:`CHUNK`-token blocks, then compared token
  by token, so a hash collision can only cost a match, never give a wrong one; a block is found
  while any cached batch holds it (rows of many conversations share a system prompt's blocks: the
  batch that goes takes only its own hold on them).

Bookkeeping, and the copy that compacts a batch: the forward's device work is in ``prefix_keys`` and
the runner.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from layertap.worker.engine.layout import layer_union
from layertap.worker.engine.records import EngineRequest

#: Tokens per block of the index: a row is found when it shares at least this many first tokens.
CHUNK = 16
#: How many index keys of rows the budget evicted are remembered (to tell that a later row missed one).
GHOST_KEYS = 1 << 16


@dataclass(eq=False)
class CachedBatch:
    """One finished batch's keys, values and captured states for its rows, on the device.

    ``keys[i]``/``values[i]``: ``[T, kv_heads, head_dim]`` of decoder layer ``i`` (every layer it
    ran), ``states``: ``[T, len(layer_ids), ...]`` in the compute dtype, ``final``: ``[T, H]`` or
    None, all over the batch's rows laid end to end (``rows``: each row's token ids and start)."""

    keys: dict[int, torch.Tensor]
    values: dict[int, torch.Tensor]
    states: torch.Tensor
    layer_ids: tuple[int, ...]
    final: torch.Tensor | None
    layers_run: int  # decoder layers the forward ran (0..layers_run-1)
    rows: list[tuple[np.ndarray, int]]  # (token ids int64, start)
    nbytes: int = field(init=False)
    live: set[int] = field(init=False)  # rows no later cached row holds whole
    served: bool = field(init=False, default=False)  # a later row took a prefix from it

    def __post_init__(self) -> None:
        self.live = set(range(len(self.rows)))
        tensors = [*self.keys.values(), *self.values.values(), self.states]
        if self.final is not None:
            tensors.append(self.final)
        self.nbytes = sum(tensor.numel() * tensor.element_size() for tensor in tensors)

    @property
    def tokens(self) -> int:
        return sum(len(tokens) for tokens, _ in self.rows)

    def live_tokens(self) -> int:
        return sum(len(self.rows[row][0]) for row in self.live)

    def compact(self) -> None:
        """Keep only the live rows' keys, values and states (copies on the device, in row order),
        numbered anew from 0."""
        kept = sorted(self.live)
        device = self.states.device
        positions = torch.cat([torch.arange(start, start + len(tokens), dtype=torch.long, device=device)
                               for tokens, start in (self.rows[row] for row in kept)])  # made there: no host sync
        keys = {layer: key.index_select(0, positions) for layer, key in self.keys.items()}
        values = {layer: value.index_select(0, positions) for layer, value in self.values.items()}
        states = self.states.index_select(0, positions)
        final = None if self.final is None else self.final.index_select(0, positions)
        self.keys, self.values, self.states, self.final = keys, values, states, final  # unchanged if a copy failed
        rows, start = [], 0
        for row in kept:
            tokens = self.rows[row][0]
            rows.append((tokens, start))
            start += len(tokens)
        self.rows = rows
        self.__post_init__()  # every kept row live again; nbytes of the copies

    def serves(self, needs: BatchNeeds) -> bool:
        """Whether a batch with ``needs`` can take prefixes from this one."""
        return (self.layers_run >= needs.layers_run and set(needs.layer_ids) <= set(self.layer_ids)
                and (self.final is not None or not needs.final))


@dataclass(frozen=True)
class BatchNeeds:
    """What a batch's forward must read from a cached batch: its layer union, whether it wants
    final states, how many decoder layers it runs."""

    layer_ids: tuple[int, ...]
    final: bool
    layers_run: int


@dataclass(frozen=True)
class PrefixUse:
    """A row's first ``length`` tokens, taken from ``source``'s row that starts at ``start``: their
    keys and values, and the states of its first ``served`` (``length``, or the whole row where the
    cached row holds all of its tokens: a row sent again gets the same states, bit for bit)."""

    source: CachedBatch
    row: int  # of ``source.rows``
    length: int
    served: int

    @property
    def start(self) -> int:
        return self.source.rows[self.row][1]

    @property
    def covers_source(self) -> bool:
        """Whether the source row is all of this row's first tokens (the new row holds it whole)."""
        return self.served == len(self.source.rows[self.row][0])


def batch_needs(requests: Sequence[EngineRequest], num_layers: int) -> BatchNeeds:
    """What a batch of ``requests`` reads from a cached batch (``num_layers``: the model's decoder
    layers): the forward stops before the highest wanted layer below ``num_layers``, unless a
    request wants final states or top-k (``layertap.worker.model.capture``)."""
    union = tuple(layer_union([request.layer_ids for request in requests]))
    final = any(request.want_final or request.topk for request in requests)
    return BatchNeeds(union, final, num_layers if final else min(max(union), num_layers))


def may_use_prefix(request: EngineRequest) -> bool:
    """Rows whose other outputs need no computed prefix: no images, no teacher top-k."""
    return request.model_inputs is None and not request.topk


def _chunk_keys(tokens: np.ndarray) -> Iterator[int]:
    """The chained hash of each whole :data:`CHUNK`-token block, in order."""
    chained = 0
    for end in range(CHUNK, len(tokens) + 1, CHUNK):
        chained = hash((chained, tokens[end - CHUNK:end].tobytes()))
        yield chained


def _common_length(a: np.ndarray, b: np.ndarray) -> int:
    """How many first tokens ``a`` and ``b`` share."""
    length = min(len(a), len(b))
    differ = np.flatnonzero(a[:length] != b[:length])
    return int(differ[0]) if differ.size else length


class PrefixCache:
    """Finished batches' keys, values and states, least recently used first out, within
    ``budget_bytes``. Used on the engine thread; :attr:`held_bytes` and ``len`` may be read from any.
    ``batch_bytes(tokens, layers)``: what a batch of ``tokens`` tokens capturing ``layers`` layers
    would hold (None: any batch is kept)."""

    def __init__(self, budget_bytes: int, batch_bytes: Callable[[int, int], int] | None = None):
        self.budget_bytes = budget_bytes
        self._batch_bytes = batch_bytes
        self._batches: OrderedDict[int, tuple[CachedBatch, list[int]]] = OrderedDict()  # id -> (batch, its keys)
        # chained hash -> every cached batch holding that block: id(batch) -> (batch, one of its rows), newest last
        self._index: dict[int, dict[int, tuple[CachedBatch, int]]] = {}
        self._held = 0
        self._ghosts: OrderedDict[int, None] = OrderedDict()  # keys of rows the budget evicted, oldest first
        self._kept_bytes = 0  # of every batch kept so far
        self._scan_until = 0  # of _kept_bytes: evict the newest unserved batch first until then

    @property
    def held_bytes(self) -> int:
        return self._held

    def __len__(self) -> int:
        return len(self._batches)

    def keeps(self, tokens: int, layers: int) -> bool:
        """Whether a batch of ``tokens`` tokens capturing ``layers`` layers is to be kept: at most half
        the budget (its forward holds every layer's keys and values until it ends; a batch over that,
        such as one 128k-token prompt, runs as it would without the cache)."""
        return self._batch_bytes is None or 2 * self._batch_bytes(tokens, layers) <= self.budget_bytes

    def plan(self, requests: Sequence[EngineRequest], needs: BatchNeeds) -> list[PrefixUse | None]:
        """Each request's longest cached prefix that a batch with ``needs`` can use (None: none)."""
        uses = []
        for request in requests:
            use = self._match(request, needs) if may_use_prefix(request) and request.num_tokens > CHUNK else None
            if use is not None:
                self._batches.move_to_end(id(use.source))
                use.source.served = True
            uses.append(use)
        return uses

    def _match(self, request: EngineRequest, needs: BatchNeeds) -> PrefixUse | None:
        tokens = request.token_ids.numpy()
        deepest = None  # the holders of the longest run of blocks found
        for key in _chunk_keys(tokens[:request.num_tokens - 1]):
            holders = self._index.get(key)
            if not holders:
                if key in self._ghosts:  # the budget evicted a row that held more of it
                    self._scan_until = self._kept_bytes + self.budget_bytes
                break
            deepest = holders
        if deepest is None:
            return None
        source, row = next(reversed(deepest.values()))  # the newest batch holding it
        if not source.serves(needs):
            return None
        common = _common_length(tokens, source.rows[row][0])
        length = min(common, request.num_tokens - 1)  # its last token is computed, whatever is cached
        return PrefixUse(source, row, length, common) if length >= CHUNK else None

    def add(self, batch: CachedBatch, uses: Sequence[PrefixUse | None]) -> None:
        """Keep ``batch``, which ran with ``uses`` (its rows' prefixes, in order): its rows are found
        from now on (ahead of older batches holding the same blocks), but those whose every token was
        cached; a cached row that one of its rows holds whole is found in it from now on, a cached batch
        none of whose rows is held only by it is dropped, and one whose such rows are half of its tokens
        or fewer keeps only those; then the least recently used go
        while beyond the budget. A batch over the budget is not kept and changes nothing."""
        if batch.nbytes > self.budget_bytes:
            return
        held_whole = {}
        for use in uses:
            if use is not None and use.covers_source:
                use.source.live.discard(use.row)
                held_whole[id(use.source)] = use.source
        for source in held_whole.values():
            if id(source) not in self._batches:
                continue
            if not source.live:
                self._evict(source)
            elif 2 * source.live_tokens() <= source.tokens:
                self._compact(source)
        for row, ((tokens, _start), use) in enumerate(zip(batch.rows, uses)):
            if use is not None and use.served == len(tokens):  # its source holds it whole
                batch.live.discard(row)
        self._batches[id(batch)] = (batch, self._hold(batch))
        self._held += batch.nbytes
        self._kept_bytes += batch.nbytes
        while self._held > self.budget_bytes:
            self._evict(self._victim(), remember=True)

    def _compact(self, batch: CachedBatch) -> None:
        """Keep only ``batch``'s live rows (:meth:`CachedBatch.compact`), found there still."""
        before = batch.nbytes
        try:
            batch.compact()
        except torch.OutOfMemoryError:  # no room for the copy: the batch goes instead
            self._evict(batch, remember=True)
            return
        self._held -= before - batch.nbytes
        self._let_go(batch, remember=False)
        self._batches[id(batch)] = (batch, self._hold(batch))  # its place in the eviction order unchanged

    def _victim(self) -> CachedBatch:
        """The batch to evict for room: the least recently used, but while rows lately missed a prefix
        the budget evicted, the most recently kept that has served no row (the least recently used
        is then the one the next rows need: each row's next turn comes after every other row's)."""
        if self._kept_bytes < self._scan_until:
            for batch, _ in reversed(self._batches.values()):
                if not batch.served:
                    return batch
        return next(iter(self._batches.values()))[0]

    def shrink(self) -> None:
        """Drop everything and halve the budget (out of memory: the forward needs the room)."""
        self.clear()
        self.budget_bytes //= 2

    def _hold(self, batch: CachedBatch) -> list[int]:
        """Index ``batch``'s live rows' blocks under it (as their newest holder); returns the keys."""
        keys: dict[int, None] = {}
        for row in sorted(batch.live):
            for key in _chunk_keys(batch.rows[row][0]):
                self._index.setdefault(key, {})[id(batch)] = (batch, row)
                keys[key] = None
        return list(keys)

    def _let_go(self, batch: CachedBatch, remember: bool) -> None:
        """Take ``batch``'s hold off its keys; a key no batch holds any more goes (with ``remember``,
        the budget evicted it: kept as a ghost)."""
        _, keys = self._batches[id(batch)]
        for key in keys:
            holders = self._index.get(key)
            if holders is None or holders.pop(id(batch), None) is None or holders:
                continue
            del self._index[key]
            if remember:
                self._ghosts[key] = None
        while len(self._ghosts) > GHOST_KEYS:
            self._ghosts.popitem(last=False)

    def _evict(self, batch: CachedBatch, remember: bool = False) -> None:
        """Drop ``batch``; with ``remember`` (the budget evicts it), keep the keys it alone held as ghosts."""
        self._let_go(batch, remember)
        del self._batches[id(batch)]
        self._held -= batch.nbytes

    def clear(self) -> None:
        """Drop everything, and forget what the budget evicted."""
        while self._batches:
            self._evict(next(iter(self._batches.values()))[0])
        self._ghosts.clear()
        self._scan_until = self._kept_bytes
