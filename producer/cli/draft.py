"""``layertap check-draft``: refuse, before training starts, a draft whose target layer ids are not the data's.

Exit codes: 0 the ids agree (printed); 1 they differ, or the data or config cannot be read
(one ``error:`` line naming both lists); 2 bad arguments. Imports no torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from layertap.producer.cli.common import fail

if TYPE_CHECKING:
    from layertap.producer.files.export_config import ExportLayers


def check_draft(
    config: Optional[Path] = typer.Option(None, "--config", help="The draft's config: a config.json (or its folder: "
                                          "a checkpoint, a --from-pretrained folder) or a speculators train "
                                          "--config YAML."),
    target_layer_ids: Optional[str] = typer.Option(None, "--target-layer-ids", help="Instead of --config: the ids "
                                                   "given to speculators train --target-layer-ids, e.g. '2 18 33'."),
    export: Optional[Path] = typer.Option(None, "--export", help="The data: a layertap export folder."),
    run: Optional[str] = typer.Option(None, "--run", help="The data: a run's ok results (reads every file's header)."),
    from_manifest: Optional[Path] = typer.Option(None, "--manifest", help="The data: a manifest file."),
    data: Optional[Path] = typer.Option(None, "--data", help="The data: a speculators data folder whose "
                                        "hidden_states/hs_*.safetensors are layertap files (speculators' "
                                        "generate-offline-data through `layertap serve`; reads every file's header; "
                                        "their runs' certificates are looked for under the storage roots)."),
    redis_url: Optional[str] = typer.Option(None, help="Redis URL (with --run)."),
) -> None:
    """Check a draft's target layer ids against the data's auxiliary layers (after vLLM's ordering)."""
    from layertap.producer.files.draft_check import check_draft_config
    from layertap.protocol.layers import LayerIdError, check_target_layer_ids, parse_layer_list

    if (config is None) == (target_layer_ids is None):
        raise fail("give one of --config C or --target-layer-ids IDS", 2)
    if sum(source is not None for source in (export, run, from_manifest, data)) != 1:
        raise fail("give one of --export DIR, --run R, --manifest F or --data DIR", 2)
    try:
        found = data_layers(export, run, from_manifest, data, redis_url)
        if config is not None:
            ids = check_draft_config(config, found.layers, found.num_hidden_layers)
        else:
            ids = check_target_layer_ids(parse_layer_list(target_layer_ids or ""), found.layers,
                                         found.num_hidden_layers, source="--target-layer-ids")
    except (LayerIdError, ValueError, OSError, RuntimeError) as exc:
        raise fail(str(exc)) from None
    print(f"ok: target layer ids {ids} are the data's auxiliary layers (layers {found.layers}, "
          f"L = {found.num_hidden_layers})", flush=True)


def data_layers(export: Path | None, run: str | None, from_manifest: Path | None, data: Path | None,
                redis_url: str | None) -> ExportLayers:
    """The layers every file of the data holds (``export.check_entries``, ``export_config``,
    ``data_folder.folder_layers``)."""
    from layertap.producer.cli.data import RunListing
    from layertap.producer.files.export import check_entries
    from layertap.producer.files.export_config import read_export_layers
    from layertap.producer.files.manifest import iter_manifest

    if export is not None:
        return read_export_layers(export)
    if data is not None:
        from layertap.producer.files.data_folder import folder_layers
        from layertap.settings import Settings

        settings = Settings()
        return folder_layers(data, settings.reading_storages(), storage_options=settings.storage_options)
    entries = RunListing(run, redis_url) if run is not None else iter_manifest(from_manifest)  # type: ignore[arg-type]
    return check_entries(entries)


def register(app: typer.Typer) -> None:
    """Add ``check-draft`` to the ``layertap`` app."""
    app.command(name="check-draft")(check_draft)
