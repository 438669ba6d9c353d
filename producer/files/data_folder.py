"""A speculators data folder whose states came through ``layertap serve``: ``speculators prepare-data``'s
rows (no ``job_id`` column) and ``hidden_states/hs_{i}.safetensors``, the layertap files of serve's
answers that speculators' ``generate-offline-data`` moved there (each header names its run and job).

:func:`folder_layers` reads every file's header before training, as ``export.check_entries`` reads an
export's: the same layers in every file, ascending, ending with ``L`` (``export.check_speculators_layers``),
and no two runs whose certificates disagree in their states (``verify.RunStates``: a run's certificate
is looked for under the reader's storage roots, since the files were moved out of their runs' folders).
A file without layertap's header (one vLLM wrote) names no layers and is refused. Torch-free.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from layertap.producer.files.export import HS_FOLDER, check_speculators_layers
from layertap.producer.files.export_config import ExportLayers
from layertap.producer.files.manifest import ManifestEntry, entry_from_file
from layertap.producer.files.verify import RunStates
from layertap.protocol.fileformat import MetaKey
from layertap.storage.base import Storage
from layertap.storage.registry import storage_at


def row_file(folder: str | Path, index: int) -> Path:
    """Where row ``index`` of ``folder`` has its states (speculators' name for it)."""
    return Path(folder) / HS_FOLDER / f"hs_{index}.safetensors"


def folder_entries(folder: str | Path, storage_options: dict[str, Any] | None = None
                   ) -> Iterator[tuple[ManifestEntry, str]]:
    """``(entry, run)`` per ``hidden_states/hs_*.safetensors`` file of ``folder``, from its header (the job and
    run it names); ``ValueError`` for a file without layertap's header, or a folder without files."""
    files = sorted(map(str, (Path(folder) / HS_FOLDER).glob("hs_*.safetensors")))
    if not files:
        raise ValueError(f"{Path(folder) / HS_FOLDER} holds no hs_*.safetensors files: its layers are not known "
                         "before training (write some with speculators generate-offline-data through layertap "
                         "serve; for rows naming jobs of a run, give the run)")
    for path in files:
        meta = storage_at(path, storage_options).read_header(path).metadata
        if MetaKey.JOB_ID not in meta:
            raise ValueError(f"{path} has no layertap header (a file vLLM wrote?): it records no layer ids")
        yield entry_from_file(meta[MetaKey.JOB_ID], path, storage_options=storage_options), meta.get(MetaKey.RUN, "")


def folder_layers(folder: str | Path, roots: Sequence[Storage], states: RunStates | None = None,
                  storage_options: dict[str, Any] | None = None) -> ExportLayers:
    """The layers every file of ``folder`` holds, after the module's checks (``ValueError``); ``roots``: where
    the runs' certificates lie (``Settings.reading_storages``); ``states``: the runs seen, for later files."""
    states = states if states is not None else RunStates(storage_options)
    first: ManifestEntry | None = None
    for entry, run in folder_entries(folder, storage_options):
        first = first or entry
        check_speculators_layers(entry, first)
        states.see_run(run, roots)
    assert first is not None  # folder_entries raised for a folder without files
    return ExportLayers(list(first.layers), first.num_hidden_layers)
