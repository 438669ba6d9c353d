"""The layer-id convention (vLLM's), resolved against a model's decoder depth ``L``.

* ``0 <= i < L``: the residual stream *entering* decoder layer ``i`` (0 = embeddings
  output; equal to Hugging Face ``output_hidden_states[i]``).
* ``i == L``: the output of the last decoder layer, *before* the final norm (HF's own
  ``hidden_states[L]`` is after the norm; that one is ``final_hidden_states``).
* ``-(L + 1) <= i < 0``: counts from ``L + 1``, so ``-1`` is ``L``.

Files store resolved (non-negative) ids in ascending order, whatever order was asked: vLLM
appends a layer's state as its forward passes that layer, so it extracts, and feeds a draft
while serving, the layers of ``eagle_aux_hidden_state_layer_ids`` in ascending order, whatever
order the config lists. A repeated id is refused (vLLM would capture it once, one state short).

speculators (0.9) reads a file's ``hidden_states[:, :-1]`` as the draft's auxiliary layers and
``[:, -1]`` as the verifier's last layer (id ``L``); its ``--target-layer-ids`` (a draft
config's ``eagle_aux_hidden_state_layer_ids``) name the auxiliary ones, defaulting to
``[2, L//2, L-3]`` (vLLM's default too), and must be distinct and within ``0..L``.
"""

from __future__ import annotations

from collections.abc import Sequence

CONVENTION = "vllm"


class LayerIdError(ValueError):
    """A layer id list that cannot be resolved for this model."""


def resolve_layer_ids(layer_ids: Sequence[int], num_layers: int) -> list[int]:
    """Map ids (negatives allowed) to ``0..L`` in ascending order (vLLM's); reject out-of-range or repeated ids."""
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
    return sorted(resolved)


def eagle3_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's default ``[2, L//2, L-3, L]``, clamped and deduplicated for shallow models.

    Its auxiliary part (all but ``L``) equals :func:`default_target_layer_ids` (ascending)
    wherever that is valid (``L == 3`` and ``L >= 7``), and is distinct and within ``0..L-1``
    at every depth, so speculators accepts it as ``--target-layer-ids`` where its own default
    (``[2, 2, 1]`` for ``L == 4``) is refused."""
    wanted = [2, num_layers // 2, num_layers - 3, num_layers]
    return sorted({min(max(i, 0), num_layers) for i in wanted})


def default_target_layer_ids(num_layers: int) -> list[int]:
    """The auxiliary layers speculators and vLLM take for a draft config naming none: ``[2, L//2, L-3]``
    as written (possibly repeated or negative for shallow models, which speculators refuses)."""
    return [2, num_layers // 2, num_layers - 3]


def target_layer_ids(layers: Sequence[int], num_layers: int) -> list[int]:
    """The auxiliary layer ids speculators trains on from files holding ``layers``: all but the
    last, which must be ``L`` (the verifier's last layer) with at least one before it."""
    if len(layers) < 2 or layers[-1] != num_layers:
        raise LayerIdError(f"layers {list(layers)} are not auxiliary layers followed by the last layer "
                           f"{num_layers} (vLLM id L), as speculators reads them")
    return list(layers[:-1])


def check_target_layer_ids(draft_ids: Sequence[int] | None, layers: Sequence[int], num_layers: int,
                           source: str = "the draft config") -> list[int]:
    """Check a draft's target layer ids (``None``: it names none, so the default) against data holding
    ``layers``, after vLLM's ordering; return the data's auxiliary ids. Raises :class:`LayerIdError`
    naming both lists when they differ, or when the draft's ids are not distinct ids in ``0..L``."""
    expected = target_layer_ids(layers, num_layers)
    named = list(default_target_layer_ids(num_layers) if draft_ids is None else draft_ids)
    said = f"{source} names {named}" if draft_ids is not None else f"{source} names none, so the default {named}"
    if (not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= num_layers for i in named)
            or len(set(named)) != len(named)):
        raise LayerIdError(f"target layer ids: {said}, not distinct ids in 0..{num_layers}; the data's "
                           f"auxiliary layers are {expected}")
    if sorted(named) != expected:
        raise LayerIdError(f"target layer ids differ: {said} but the data's auxiliary layers are {expected} "
                           f"(then the last layer {num_layers}); train with --target-layer-ids "
                           f"{' '.join(map(str, expected))}")
    return expected


def parse_layer_list(text: str) -> list[int]:
    """Parse ``"2,18,-1"`` (the CLI form; ``"2 18 -1"``, as speculators' flags take them, too) into integers."""
    try:
        return [int(part) for part in text.replace(",", " ").split()]
    except ValueError as exc:
        raise LayerIdError(f"layers {text!r} must be comma-separated integers, e.g. 2,18,-1") from exc
