"""One forward's keys and values over its rows' whole lengths, cached prefixes included.

With the prefix cache on (``prefix_cache``), a packed forward computes each row's tokens from its
cached prefix's length ``p`` on, at positions ``p...``; attention (``layertap.worker.model.attention``)
hands each layer's new keys and values to :meth:`PrefixKeys.extend`, which lays them out over the
rows' whole lengths with the cached prefixes' in front, keeps them for the batch's
:class:`~layertap.worker.engine.prefix_cache.CachedBatch`, and returns them to attend over (every
query sees its row's keys up to its own position). :meth:`PrefixKeys.whole` does the same for the
captured states after the forward. A batch with no cached prefix keeps the tensors it computed
(no copy).

Which models take it (:func:`cache_refusal`): those of :data:`CACHED_TYPES` (the families its
tests cover) in packed batching on one device, every layer's attention full (no sliding window)
and numbered (``layer_idx``); the load-time self-check (``self_check.check_prefix_cache``) then
compares a row computed over its cached prefix with the row alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from layertap.worker.engine.prefix_cache import BatchNeeds, CachedBatch, PrefixUse
from layertap.worker.model.layouts.base import to_device

#: ``model_type`` of the families whose rows may be computed over a cached prefix (each in
#: ``tests/integration/test_prefix_cache.py``'s per-family check against plain transformers).
CACHED_TYPES = frozenset({"llama", "qwen2", "qwen3", "qwen3_moe", "mixtral"})


def cache_refusal(model: nn.Module, layers: nn.ModuleList, layout_name: str, split: bool) -> str | None:
    """None where rows of ``model`` may be computed over cached prefixes; else why not."""
    config = model.config.get_text_config()
    if config.model_type not in CACHED_TYPES:
        return f"model type {config.model_type!r} is not one the prefix cache is tested on"
    if layout_name != "packed":
        return f"{layout_name} batching (the cache needs packed rows)"
    if split:
        return "a model split over devices"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "sliding-window attention"
    if "sliding_attention" in (getattr(config, "layer_types", None) or []):
        return "sliding-window attention"
    numbered = [getattr(part, "layer_idx", None) for block in layers for part in block.modules()
                if hasattr(part, "k_proj") or hasattr(part, "qkv_proj")]
    if len(numbered) != len(layers) or None in numbered or len(set(numbered)) != len(layers):
        return "its attention modules are not one per decoder layer, numbered by layer_idx"
    return None


def batch_bytes(model: nn.Module, num_layers: int, tokens: int, layers: int, dtype: torch.dtype) -> int:
    """What a cached batch of ``tokens`` tokens capturing ``layers`` layers holds (every layer's keys
    and values, the states), for a model of :data:`CACHED_TYPES` (one key and value head size)."""
    config = model.config.get_text_config()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = 2 * num_layers * config.num_key_value_heads * head_dim + layers * config.hidden_size
    return tokens * per_token * dtype.itemsize


def _ranges(spans: Sequence[tuple[int, int]]) -> torch.Tensor:
    """int64 positions of every ``(start, end)`` span, in order."""
    if not spans:
        return torch.empty(0, dtype=torch.long)
    return torch.cat([torch.arange(start, end, dtype=torch.long) for start, end in spans])


class PrefixKeys:
    """Keys, values and states of one packed forward's rows over their whole lengths.

    ``lengths[i]`` is row ``i``'s whole length and ``uses[i]`` its cached prefix (None: none); the
    forward computes ``lengths[i] - uses[i].length`` tokens of it. Used on the engine thread."""

    def __init__(self, lengths: Sequence[int], uses: Sequence[PrefixUse | None], device: torch.device,
                 keep: bool = True):
        """``keep``: hold every layer's keys and values for :meth:`cached_batch` (else each is
        dropped after its layer)."""
        self.key_bounds = [0]
        for length in lengths:
            self.key_bounds.append(self.key_bounds[-1] + length)
        self.longest_key = max(lengths)
        self._keep = keep
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self._prefixed = any(use is not None for use in uses)
        self._computed: torch.Tensor | None = None
        self._from: list[tuple[CachedBatch, torch.Tensor, torch.Tensor]] = []  # (source, its rows, our rows)
        if not self._prefixed:
            return
        starts = self.key_bounds[:-1]
        skipped = [0 if use is None else use.length for use in uses]
        self._computed = to_device(_ranges([(start + skip, start + length)
                                            for start, skip, length in zip(starts, skipped, lengths)]), device)
        by_source: dict[int, tuple[CachedBatch, list[tuple[int, int]], list[tuple[int, int]]]] = {}
        for start, use in zip(starts, uses):
            if use is not None:  # ``served`` may cover the computed last token too: the cached one is kept
                _, theirs, ours = by_source.setdefault(id(use.source), (use.source, [], []))
                theirs.append((use.start, use.start + use.served))
                ours.append((start, start + use.served))
        self._from = [(source, to_device(_ranges(theirs), device), to_device(_ranges(ours), device))
                      for source, theirs, ours in by_source.values()]

    def extend(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s keys and values (``[computed tokens, heads, dim]``) over the rows' whole
        lengths (``[total, heads, dim]``, laid out by :attr:`key_bounds`); kept for the cache."""
        if self._prefixed:
            key = self._whole(key, lambda source: source.keys[layer])
            value = self._whole(value, lambda source: source.values[layer])
        if self._keep:
            self.keys[layer], self.values[layer] = key, value
        return key, value

    def whole(self, computed: torch.Tensor, of_source: Callable[[CachedBatch], torch.Tensor]) -> torch.Tensor:
        """``computed`` (``[computed tokens, ...]``) over the rows' whole lengths, the prefixes'
        rows from ``of_source(source)``."""
        return self._whole(computed, of_source) if self._prefixed else computed

    def whole_states(self, computed: torch.Tensor, layer_ids: Sequence[int]) -> torch.Tensor:
        """Captured states ``[computed tokens, len(layer_ids), ...]`` over the rows' whole lengths,
        the prefixes' from their sources' states of the same layers."""
        if not self._prefixed:
            return computed

        def of_source(source: CachedBatch) -> torch.Tensor:
            if source.layer_ids == tuple(layer_ids):
                return source.states
            columns = [source.layer_ids.index(layer) for layer in layer_ids]
            return source.states[:, columns]
        return self._whole(computed, of_source)

    def _whole(self, computed: torch.Tensor, of_source: Callable[[CachedBatch], torch.Tensor]) -> torch.Tensor:
        whole = computed.new_empty(self.key_bounds[-1], *computed.shape[1:])  # every position is written below
        whole.index_copy_(0, self._computed, computed)  # first: a served position computed too is overwritten
        for source, theirs, ours in self._from:
            whole.index_copy_(0, ours, of_source(source).index_select(0, theirs))
        return whole

    def cached_batch(self, tokens: Sequence[torch.Tensor], states: torch.Tensor, final: torch.Tensor | None,
                     needs: BatchNeeds) -> CachedBatch:
        """What this forward (a batch with ``needs``) leaves for later rows (``states``/``final``
        over the whole lengths)."""
        rows = [(ids.numpy(), start) for ids, start in zip(tokens, self.key_bounds)]
        return CachedBatch(dict(self.keys), dict(self.values), states, needs.layer_ids, final, needs.layers_run, rows)
