"""``layertap export --format speculators``: a run in the layout speculators (0.9) trains from.

Layout (``speculators train --config OUT/speculators.yaml --verifier-name-or-path MODEL``)::

    OUT/data-*.arrow, dataset_info.json, state.json   HF datasets, save_to_disk; torch format
        input_ids  list[int64]   the file's token_ids
        loss_mask  list[int64]   the file's loss_mask (all 1 for a file without one)
        seq_len    int64         len(input_ids)
        job_id     string        the layertap job of the row
    OUT/token_freq.pt            {token id: count} over loss_mask == 1 tokens (when torch is installed)
    OUT/hidden_states/hs_{i}.safetensors   row i's layertap file: a hard link, else a copy (or a download);
                                           of a float8 file, its bfloat16 copy (``dequantized``)
    OUT/hidden_states/hs_{i}.safetensors.lock   empty: vLLM's ``load_hidden_states`` opens it first
    OUT/layertap-export.json, OUT/speculators.yaml   the layer ids (``export_config``)

speculators loads ``hs_{i}`` with safetensors, takes ``hidden_states[:, :-1]`` as the
auxiliary layers and ``hidden_states[:, -1]`` as the verifier's last layer, and checks
``token_ids == input_ids``. So every file must hold the same layers, in ascending order (vLLM's,
``protocol.layers``), at least two, ending with vLLM id ``L`` (the last decoder layer before the
final norm); the export refuses otherwise (the last check is skipped with ``check_layers=False``).
The extra tensors and header of a layertap file are ignored by it, so files are linked as they
are (no bytes copied on one filesystem). hs_connectors' ``file`` backend removes a lock file the
first time it reads its file; the data stays.

Nothing is left half-written: :func:`check_entries` reads every entry's header facts before
anything is written (``layertap export`` runs it first), and an export that fails anyway (a
file gone meanwhile, a full disk) removes what it wrote, so the same command can run again.
"""

from __future__ import annotations

import importlib.util
import shutil
import tempfile
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from layertap.extras import need
from layertap.producer.files.dequantized import FLOAT8, write_dequantized
from layertap.producer.files.export_config import ExportLayers, write_export_config
from layertap.producer.files.manifest import ManifestEntry
from layertap.producer.files.verify import RunStates
from layertap.protocol import fileformat as ff
from layertap.storage.local import add_lock_file
from layertap.storage.registry import storage_at

HS_FOLDER = "hidden_states"


@dataclass
class ExportReport:
    """What :func:`export_speculators` wrote (``layertap export`` prints it): rows and tokens, files linked, copied or
    dequantized, whether ``token_freq.pt`` was written, and the first row's layers, model and hidden size."""

    rows: int = 0
    tokens: int = 0
    linked: int = 0
    copied: int = 0
    dequantized: int = 0  # float8 files written as their bfloat16 copies
    token_freq: bool = False
    layers: ExportLayers | None = None  # every file's (the first row's, checked against it)
    model: str = ""
    hidden_size: int = 0


def read_tokens(path: Path) -> tuple[Any, Any]:
    """``(token_ids, loss_mask)`` of an exported file (``hs_{i}``, a link or copy of a run's file
    that only ever appeared complete) as numpy arrays."""
    import numpy as np
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as handle:
        token_ids = handle.get_tensor(ff.TOKEN_IDS).astype(np.int64)
        names = set(handle.keys())
        mask = handle.get_tensor(ff.LOSS_MASK).astype(np.int64) if ff.LOSS_MASK in names else np.ones_like(token_ids)
    return token_ids, mask


def check_speculators_layers(entry: ManifestEntry, first: ManifestEntry, *, last_layer: bool = True) -> None:
    """Refuse files speculators would misread: layers differing between files, not in vLLM's ascending
    order (files written before layertap stored them so), fewer than two, or (``last_layer``) not ending with ``L``."""
    if list(entry.layers) != list(first.layers):
        raise ValueError(f"job {entry.job_id} has layers {entry.layers} but job {first.job_id} has {first.layers}: "
                         "speculators needs the same layers in every file")
    if list(entry.layers) != sorted(entry.layers):
        raise ValueError(f"job {entry.job_id} has layers {entry.layers}, not in ascending order: vLLM feeds a draft "
                         "its layers in ascending order; extract the run again (workers now store them so)")
    if len(entry.layers) < 2:
        raise ValueError(f"job {entry.job_id} has layers {entry.layers}: speculators needs auxiliary layers "
                         "before the last")
    if last_layer and entry.layers[-1] != entry.num_hidden_layers:
        raise ValueError(f"job {entry.job_id} has layers {entry.layers}: speculators reads the last one as the "
                         f"verifier's last layer, vLLM id {entry.num_hidden_layers} (ask for layers ending "
                         "with -1), or export with --any-layers")


def check_entries(entries: Iterable[ManifestEntry], *, check_layers: bool = True,
                  storage_options: dict[str, Any] | None = None) -> ExportLayers:
    """Refuse, before anything is written, what :func:`export_speculators` would refuse midway
    (:func:`check_speculators_layers`; ``check_layers=False`` skips its last-layer check; files of
    runs whose certificates disagree in their states, ``verify.RunStates``) and an empty run;
    return the layers every entry holds."""
    first: ManifestEntry | None = None
    states = RunStates(storage_options)
    for entry in entries:
        first = first or entry
        check_speculators_layers(entry, first, last_layer=check_layers)
        states.see(entry.path)
    if first is None:
        raise ValueError("nothing to export: no ok results")
    return ExportLayers(list(first.layers), first.num_hidden_layers)


def export_speculators(entries: Iterable[ManifestEntry], out: str | Path, *, check_layers: bool = True,
                       on_row: Callable[[ManifestEntry], None] | None = None,
                       storage_options: dict[str, Any] | None = None) -> ExportReport:
    """Write the speculators layout of ``entries`` to ``out`` (missing or empty); rows in entry order
    (files in an object store are downloaded, with ``storage_options``). On any failure what was
    written is removed (``out`` is left as it was found)."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} is not empty: export into a new folder")
    created = not out.exists()
    try:
        return _write_speculators(entries, out, check_layers=check_layers, on_row=on_row,
                                  storage_options=storage_options)
    except BaseException:
        if created:
            shutil.rmtree(out, ignore_errors=True)
        else:
            for child in out.iterdir():
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child)
                else:
                    child.unlink()
        raise


def _write_speculators(entries: Iterable[ManifestEntry], out: Path, *, check_layers: bool,
                       on_row: Callable[[ManifestEntry], None] | None,
                       storage_options: dict[str, Any] | None) -> ExportReport:
    datasets = need("datasets")
    hs_folder = out / HS_FOLDER
    hs_folder.mkdir(parents=True, exist_ok=True)
    report, token_freq = ExportReport(), Counter[int]()

    def rows() -> Iterator[dict[str, Any]]:
        import numpy as np

        first: ManifestEntry | None = None
        states = RunStates(storage_options)
        for index, entry in enumerate(entries):
            states.see(entry.path)
            if first is None:
                first = entry
                report.layers = ExportLayers(list(entry.layers), entry.num_hidden_layers)
                report.model, report.hidden_size = entry.model, entry.hidden_size
            check_speculators_layers(entry, first, last_layer=check_layers)
            target = hs_folder / f"hs_{index}.safetensors"
            if entry.dtype == FLOAT8:
                write_dequantized(entry.path, target, storage_options)
                report.dequantized += 1
            elif storage_at(entry.path, storage_options).copy_to(entry.path, target):  # a link, or a copy
                report.linked += 1
            else:
                report.copied += 1
            add_lock_file(target)
            token_ids, mask = read_tokens(target)
            report.rows, report.tokens = report.rows + 1, report.tokens + len(token_ids)
            ids, counts = np.unique(token_ids[mask == 1], return_counts=True)
            token_freq.update(dict(zip(ids.tolist(), counts.tolist())))
            if on_row:
                on_row(entry)
            yield {"input_ids": token_ids, "loss_mask": mask, "seq_len": len(token_ids), "job_id": entry.job_id}

    features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int64")),
                                  "loss_mask": datasets.Sequence(datasets.Value("int64")),
                                  "seq_len": datasets.Value("int64"), "job_id": datasets.Value("string")})
    with tempfile.TemporaryDirectory(prefix=f".{out.name}-", dir=out.parent) as cache:
        try:
            dataset = datasets.Dataset.from_generator(rows, features=features, cache_dir=cache,
                                                      fingerprint=uuid.uuid4().hex)
        except datasets.exceptions.DatasetGenerationError as exc:
            raise (exc.__cause__ or exc) from None
        if report.rows == 0:
            raise ValueError("nothing to export: no ok results")
        if importlib.util.find_spec("torch") is not None:  # speculators indexes rows as tensors
            dataset = dataset.with_format("torch")
            save_token_freq(dict(token_freq), out / "token_freq.pt")
            report.token_freq = True
        dataset.save_to_disk(str(out))
    assert report.layers is not None  # set with the first row
    write_export_config(out, report.layers, model=report.model, hidden_size=report.hidden_size, rows=report.rows,
                        tokens=report.tokens)
    return report


def save_token_freq(token_freq: dict[int, int], path: Path) -> None:
    """The ``token_freq.pt`` speculators builds its draft vocabulary from (torch.save of a dict)."""
    import torch

    torch.save(token_freq, path)
