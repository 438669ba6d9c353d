"""A draft's target layer ids against the data it trains on, checked before the first step.

A draft trained or served on other layers than its data holds trains fine and accepts few
tokens, so a training script runs this first (``layertap check-draft``, or
:func:`check_draft_config`). Where a draft config names its ids (the first found wins):

* a draft's ``config.json`` (speculators' checkpoints and config-only ``--from-pretrained``
  folders, vLLM drafts): ``eagle_aux_hidden_state_layer_ids`` (EAGLE-3, P-EAGLE),
  ``eagle_config.eagle_aux_hidden_state_layer_ids`` (vLLM's nested form),
  ``aux_hidden_state_layer_ids`` (speculators' DFlash family);
* a ``speculators train --config`` file (its ``run.yaml``, an export's ``speculators.yaml``):
  ``train.draft.target_layer_ids``, or ``draft.target_layer_ids`` in a bare mapping.

A config naming none gets speculators' and vLLM's default ``[2, L//2, L-3]``. The comparison
(``protocol.layers.check_target_layer_ids``) is after vLLM's ordering: a draft's ids in another
order serve the same states.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from layertap.protocol.layers import check_target_layer_ids

#: Keys of a draft's config.json holding its ids, as (outer key or None, key).
CONFIG_KEYS = ((None, "eagle_aux_hidden_state_layer_ids"), ("eagle_config", "eagle_aux_hidden_state_layer_ids"),
               (None, "aux_hidden_state_layer_ids"))


def read_config(path: Path) -> dict[str, Any]:
    """A draft config file as a mapping: JSON, or YAML (needs PyYAML) for a ``.yaml``/``.yml`` file that is not JSON."""
    text = path.read_text()
    try:
        data = json.loads(text)
    except ValueError:
        if path.suffix not in (".yaml", ".yml"):
            raise ValueError(f"{path} is not JSON") from None
        try:
            import yaml
        except ImportError:
            raise RuntimeError(f"reading {path} needs PyYAML: pip install pyyaml") from None
        data = yaml.safe_load(text)
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a mapping of settings")
    return data


def draft_target_ids(config: dict[str, Any]) -> list[int] | None:
    """The target layer ids a draft config names, or None where it names none (see the module's list)."""
    train = config.get("train") if isinstance(config.get("train"), dict) else config
    draft = train.get("draft")
    if isinstance(draft, dict) and draft.get("target_layer_ids") is not None:
        return list(draft["target_layer_ids"])
    for outer, key in CONFIG_KEYS:
        holder = config if outer is None else config.get(outer)
        if isinstance(holder, dict) and holder.get(key):
            return list(holder[key])
    return None


def check_draft_config(path: str | Path, layers: Sequence[int], num_layers: int) -> list[int]:
    """Check the draft config at ``path`` (a file, or a folder with ``config.json``) against data holding
    ``layers`` of a model of ``num_layers`` decoder layers; return the data's auxiliary ids. Raises
    ``LayerIdError`` naming both lists when they differ."""
    path = Path(path) / "config.json" if Path(path).is_dir() else Path(path)
    return check_target_layer_ids(draft_target_ids(read_config(path)), layers, num_layers, source=str(path))
