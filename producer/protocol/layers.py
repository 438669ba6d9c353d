"""The layer-id convention (vLLM's), resolved against a model's decoder depth ``L``.

* ``0 <= i < L``: the residual stream *entering* decoder layer ``i`` (0 = embeddings
  output; equal to Hugging Face ``output_hidden_states[i]``).
* ``i == L``: the output of the last decoder layer, *before* the final norm (HF's own
  ``hidden_states[L]`` is after the norm; that one is ``final_hidden_states``).
* ``-(L + 1) <= i < 0``: counts from ``L + 1``, so ``-1`` is ``L``.

Files store resolved (non-negative) ids in the order asked.
"""

from __future__ import annotations

from collections.abc import Sequence

CONVENTION = "vllm"


class LayerIdError(ValueError):
    """A layer id list that cannot be resolved for this model."""


def resolve_layer_ids(layer_ids: Sequence[int], num_layers: int) -> list[int]:
    """Map ids (negatives allowed) to ``0..L``, keeping order; reject out-of-range or repeated ids."""
    if not layer_ids:
        raise LayerIdError("layers is empty: ask for at least one layer id")
    resolved: list[int] = []
    for layer_id in layer_ids:
        if isinstance(layer_id, bool) or not isinstance(layer_id, int):
            raise LayerIdError(f"layer id {layer_id!r} is not an integer")
        if not -(num_layers + 1) <= layer_id <= num_layers:
            raise LayerIdError(
                f"layer id {layer_id} is out of range for a model with {num_layers} decoder "
                f"layers: valid ids are {-(num_layers + 1)}..{num_layers}"
            )
        value = layer_id % (num_layers + 1)
        if value in resolved:
            raise LayerIdError(f"layer id {layer_id} repeats layer {value}")
        resolved.append(value)
    return resolved


def eagle3_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's default ``[2, L//2, L-3, L]``, clamped and deduplicated for shallow models."""
    wanted = [2, num_layers // 2, num_layers - 3, num_layers]
    return sorted({min(max(i, 0), num_layers) for i in wanted})


def parse_layer_list(text: str) -> list[int]:
    """Parse ``"2,18,-1"`` (the CLI form) into integers."""
    try:
        return [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError as exc:
        raise LayerIdError(f"layers {text!r} must be comma-separated integers, e.g. 2,18,-1") from exc
