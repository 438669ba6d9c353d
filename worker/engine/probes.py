"""The load-time self-check's probe lengths, read from the model's config.

A batching fault shows only where a model's selective paths engage: a sliding or chunked window
longer than the prompt selects nothing, an indexer whose top-k covers every key block picks them
all, a compression block longer than the prompt never forms. So the probes run from a few tokens
to :data:`SPAN_MULTIPLE` times the largest span the config names (:func:`selection_span`), never
under :data:`MIN_LONGEST`, spread geometrically so that one batch mixes very short and very long
prompts (the padded layout pads the short ones by hundreds of positions; the packed layout sets
them beside a long neighbour).

Invariant: the probes are distinct lengths (a padded batch pads all but the longest), and their
captured states (every layer ``0..L``) fit in :data:`PROBE_STATE_BYTES`; where that bound, or the
model's position limit, keeps the longest probe under the multiple, :attr:`ProbePlan.short_of`
says so and the worker logs it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

#: How many times the largest span the longest probe covers.
SPAN_MULTIPLE = 3
#: The longest probe is never shorter than this (models that name no span).
MIN_LONGEST = 64
#: The shortest probe.
SHORTEST = 3
#: How many probes run together in the batched half of the check.
PROBE_COUNT = 8
#: The captured states of all probes (every layer, the model's dtype) stay under this many bytes.
PROBE_STATE_BYTES = 1 << 30
#: Config fields that name a span over tokens: a window, a chunk, a block or a selection.
SPAN_FIELDS = ("sliding_window", "attention_chunk_size", "chunk_size", "mamba_chunk_size", "window_size",
               "local_attention", "keep_window_size", "block_size", "attention_window", "index_block_size",
               "compress_rates", "compress_rate")
#: Top-k over keys or key blocks, multiplied by the block the config names (a top-k selects only
#: where there are more candidates than k): (top-k field, block fields whose smallest value sizes a candidate).
SELECTIONS = (("index_topk", ("compress_rates", "compress_rate")), ("index_topk_blocks", ("index_block_size",)))


def _ints(value: Any) -> list[int]:
    """The positive integers in a config value (an int, or a list or dict of them)."""
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value] if value > 0 else []
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [number for item in value for number in _ints(item)]
    return []


def selection_span(config: Any) -> tuple[int, list[str]]:
    """The largest span over tokens the (text) config names, and the fields that name it (0, []
    when none does)."""
    spans: dict[str, int] = {}
    for field in SPAN_FIELDS:
        values = _ints(getattr(config, field, None))
        if values:
            spans[field] = max(values)
    for topk_field, block_fields in SELECTIONS:
        topk = _ints(getattr(config, topk_field, None))
        blocks = [number for field in block_fields for number in _ints(getattr(config, field, None))]
        if topk:
            spans[topk_field] = max(topk) * (min(blocks) if blocks else 1)
    if not spans:
        return 0, []
    largest = max(spans.values())
    return largest, sorted(field for field, span in spans.items() if span == largest)


@dataclass(frozen=True)
class ProbePlan:
    """The self-check's probes for one model (:func:`plan_probes`): their lengths and the span they were sized on."""

    lengths: tuple[int, ...]  # in batch order: long and short interleaved
    span: int  # the largest span the config names (0: none)
    span_fields: tuple[str, ...]
    short_of: str  # why the longest probe is under SPAN_MULTIPLE x span ("" when it is not)

    def describe(self) -> str:
        named = f"{self.span} ({', '.join(self.span_fields)})" if self.span else "none"
        return f"{len(self.lengths)} probes of {min(self.lengths)}-{max(self.lengths)} tokens; span named: {named}"


def spread(longest: int, count: int = PROBE_COUNT, shortest: int = SHORTEST) -> list[int]:
    """``count`` distinct lengths from ``shortest`` to ``longest``, geometric, ascending."""
    lengths: list[int] = []
    for index in range(count):
        length = round(shortest * (longest / shortest) ** (index / max(count - 1, 1)))
        lengths.append(max(length, lengths[-1] + 1 if lengths else shortest))
    return lengths


def interleaved(lengths: Iterable[int]) -> tuple[int, ...]:
    """Longest, shortest, second longest, second shortest...: every short probe sits beside a long one."""
    ordered = sorted(lengths)
    out: list[int] = []
    while ordered:
        out.append(ordered.pop())
        if ordered:
            out.append(ordered.pop(0))
    return tuple(out)


def plan_probes(config: Any, num_layers: int, state_width: int, dtype_bytes: int) -> ProbePlan:
    """The probes for a model: ``config`` its text config, ``state_width`` the captured width of
    one layer's state (hidden size x residual copies), ``dtype_bytes`` its dtype's size."""
    span, fields = selection_span(config)
    wanted = max(MIN_LONGEST, SPAN_MULTIPLE * span)
    limits = {"the self-check's memory bound": PROBE_STATE_BYTES // ((num_layers + 1) * state_width * dtype_bytes)
              // 2}  # the probes add up to about twice the longest
    positions = getattr(config, "max_position_embeddings", None)
    if isinstance(positions, int) and positions > 0:
        limits["the model's max_position_embeddings"] = positions
    longest, short_of = wanted, ""
    for reason, limit in limits.items():
        if limit < longest:
            longest, short_of = limit, f"{SPAN_MULTIPLE} x {span} tokens is over {reason} ({limit})"
    longest = max(longest, SHORTEST + PROBE_COUNT)
    return ProbePlan(interleaved(spread(longest)), span, tuple(fields), short_of if span else "")

