"""The layer ids an export carries, where each reader of the export looks for them.

* ``OUT/layertap-export.json`` (layertap's record, read by ``layertap check-draft --export OUT``):
  ``layers`` (vLLM ids, ascending: every file's), ``num_hidden_layers`` (``L``),
  ``target_layer_ids`` (the auxiliary ones speculators trains on: all but ``L``; null where the
  files do not end with ``L``), ``model``, ``hidden_size``, ``rows``, ``tokens``.
* ``OUT/speculators.yaml``: a ``speculators train --config`` file (stage-shaped, under ``train:``)
  setting ``data.data_path`` and ``draft.target_layer_ids``, so the trainer takes the data's ids
  instead of its default ``[2, L//2, L-3]``; flags given beside it win. It is written as JSON,
  which YAML reads as it is, and only where the files end with ``L``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from layertap.protocol.layers import LayerIdError, target_layer_ids

CONFIG_NAME = "layertap-export.json"
SPECULATORS_CONFIG = "speculators.yaml"


@dataclass(frozen=True)
class ExportLayers:
    """The layers every file of an export holds, and the model's decoder depth ``L``."""

    layers: list[int]
    num_hidden_layers: int

    @property
    def target_layer_ids(self) -> list[int] | None:
        """speculators' auxiliary ids of these files, or None where they do not end with ``L``."""
        try:
            return target_layer_ids(self.layers, self.num_hidden_layers)
        except LayerIdError:
            return None


def write_export_config(out: Path, found: ExportLayers, **facts: Any) -> None:
    """Write ``out``'s :data:`CONFIG_NAME` (``found`` and ``facts``) and, where the files end with ``L``,
    its :data:`SPECULATORS_CONFIG`."""
    record = {"layers": found.layers, "num_hidden_layers": found.num_hidden_layers,
              "target_layer_ids": found.target_layer_ids, **facts}
    (out / CONFIG_NAME).write_text(json.dumps(record, indent=2) + "\n")
    if found.target_layer_ids is not None:
        train = {"data": {"data_path": str(out.resolve())}, "draft": {"target_layer_ids": found.target_layer_ids}}
        (out / SPECULATORS_CONFIG).write_text(json.dumps({"train": train}, indent=2) + "\n")


def read_export_layers(out: Path) -> ExportLayers:
    """The layers an export's :data:`CONFIG_NAME` records; ``ValueError`` if it has none (not an export
    of this version)."""
    path = out / CONFIG_NAME
    try:
        record = json.loads(path.read_text())
        return ExportLayers(list(record["layers"]), int(record["num_hidden_layers"]))
    except FileNotFoundError:
        raise ValueError(f"{out} has no {CONFIG_NAME}: not a layertap export (or one made before it was written); "
                         "export again, or check against --run or --manifest") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path} is not a layertap export record ({exc})") from None
