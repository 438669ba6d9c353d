"""hs-connectors' backend ``layertap``: speculators' own trainer (0.9) reads layertap data.

    speculators train --data-path DIR --hidden-states-backend layertap [--layertap-run RUN] ...

hs-connectors finds a backend by its ``@HiddenStatesBackend.register(name)`` when its module is
imported; layertap installs ``layertap-hs-connectors.pth``, whose hook (``_layertap_hs_connectors``)
imports this module right after ``hs_connectors`` (so ``speculators train`` and ``torchrun -m
speculators.train`` list it) and does nothing in a process that never imports hs-connectors.

``DIR`` is a speculators data folder (``trainers.rows``): an export; with ``--layertap-run RUN``,
rows whose jobs (a ``job_id`` column) the run holds or is extracting; or speculators' own folder
whose ``hs_{i}`` files its ``generate-offline-data`` moved there from ``layertap serve``'s answers
(the rows it did not write are asked of serve by ``--on-missing generate``). Each row
speculators asks for, in its own order and once per epoch, is handed over as its file's
``hidden_states [T, n_layers, H]`` and ``token_ids``: read once complete (the writer's lock), its
checksums verified, float8 states decoded (float32: what ``load_hidden_states`` returns), from the
job's own file only; a row whose job is not extracted yet is waited for, never skipped. A row with
no states (an error result, a missing or damaged file) is logged and returned as ``None``, so
speculators' ``--on-missing`` decides (``raise`` stops the run, ``skip`` counts it). Nothing is
removed unless ``--layertap-delete-after true`` (not with an export): each row's own file of a run
under the trainer's storage root once handed over, and the file of each ``layertap serve`` answer
(an answer is the job's own file under the trainer's roots, or it is not read).

Before the first step, :meth:`LayertapBackend.from_train_args` finds the data's layers (an export's
record; a run's first file; every file of speculators' own folder, whose runs' certificates must
agree in what changes the states, ``verify.RunStates``), checks the trainer's ``--target-layer-ids``
(or speculators' default) against their auxiliary layers and raises ``LayerIdError`` naming both
lists when they differ. Every file handed over, each answer of ``layertap serve`` too, must then
hold those layers.

Flags (hs-connectors' train-args hook; also under ``train: backend:`` in ``--config``):
``--layertap-run``, ``--layertap-group`` (the consumer group whose consumed hash records the rows
handed over; default ``speculators``), ``--layertap-delete-after``, ``--layertap-redis-url``.
Other settings come from layertap's own (``LAYERTAP_STORAGE_ROOT``, ``LAYERTAP_READ_ROOTS``,
``LAYERTAP_STORAGE_OPTIONS``, ...): files are read only under the trainer's storage roots, and
removed only under its storage root.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from typing import Any

from hs_connectors import HiddenStatesBackend, HiddenStatesTransfer

from layertap.producer.files.reader import load_hidden_states
from layertap.producer.trainers.rows import Rows, own_path, remove_own_file, rows_of
from layertap.protocol import fileformat as ff
from layertap.protocol.layers import check_target_layer_ids
from layertap.settings import Settings
from layertap.storage.registry import storage_at

log = logging.getLogger(__name__)

NAME = "layertap"
DEFAULT_GROUP = "speculators"
#: ``kv_transfer_params`` keys of a generated file's path (vLLM's, and its alternative), as speculators reads them.
PATH_KEYS = ("hidden_states_path", "handle")


def true_or_false(text: str) -> bool:
    """A flag's ``true``/``false`` (speculators copies a backend flag's ``type``, not its ``action``)."""
    value = text.strip().lower()
    if value not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return value == "true"


class LayertapTransfer(HiddenStatesTransfer):
    """Hands speculators each row's states (module doc); picklable into DataLoader workers."""

    def __init__(self, rows: Rows, layers: list[int], settings: Settings, *, delete_after: bool):
        self.rows, self.layers, self.settings, self.delete_after = rows, layers, settings, delete_after

    def get_cached(self, file_idx: int) -> dict[str, Any] | None:
        row = self.rows.file(file_idx)
        if row is None:
            return None
        try:
            states = self._load(row.path, lambda header: self.rows.checked(row, header, self.layers))
        except (OSError, ff.FileFormatError) as exc:
            log.warning("row %d (job %s of %s): %s; no states for it", row.index, row.job_id, self.rows.describe(),
                        exc)
            return None
        self.rows.handed_over(row)
        log.debug("row %d: job %s handed over (%d tokens)", row.index, row.job_id, len(states[ff.TOKEN_IDS]))
        return states

    def get_generated(self, hs_transfer_params: dict[str, Any]) -> dict[str, Any] | None:
        """A generated sample (``layertap serve``'s answer): a job's own file under this trainer's roots only,
        holding the trainer's layers (``ValueError``: speculators retries, then counts the row as missing)."""
        path = next((hs_transfer_params[key] for key in PATH_KEYS if hs_transfer_params.get(key)), None)
        if path is None:
            return None
        own = self._own(path)
        states = self._load(own, lambda header: self.rows.checked_answer(own, header, self.layers))
        log.debug("generated: %s handed over (%d tokens)", own, len(states[ff.TOKEN_IDS]))
        return states

    def delete(self, handle: str) -> None:
        """With ``delete_after``, remove a generated file if it is its job's own under this trainer's storage root."""
        if not self.delete_after:
            return
        try:
            run, job_id = self._run_and_job(handle)
        except FileNotFoundError:
            return
        remove_own_file(handle, run, job_id, self.settings)

    def _load(self, path: str, check: Callable[[ff.FileHeader], None]) -> dict[str, Any]:
        options = self.settings.storage_options
        check(storage_at(path, options).read_header(path))
        tensors = load_hidden_states(path, verify=True, storage_options=options)
        return {ff.HIDDEN_STATES: tensors[ff.HIDDEN_STATES], ff.TOKEN_IDS: tensors[ff.TOKEN_IDS]}

    def _run_and_job(self, path: str) -> tuple[str, str]:
        meta = storage_at(path, self.settings.storage_options).read_header(path).metadata
        return meta.get(ff.MetaKey.RUN, ""), meta.get(ff.MetaKey.JOB_ID, "")

    def _own(self, path: str) -> str:
        """``path`` if it is the own file of the run and job its header names (``rows.own_path``)."""
        run, job_id = self._run_and_job(path)
        own = own_path(path, run, job_id, self.settings)
        if own is None:
            raise ValueError(f"{path} is not the own file of a layertap run's job under this trainer's storage "
                             "roots (storage_root, read_roots): not read")
        return own


#: The trainer's ``--layertap-*`` flags: flag, type, default, help.
TRAIN_FLAGS: tuple[tuple[str, Callable[[str], Any], Any, str], ...] = (
    ("--layertap-run", str, None, "the run whose jobs the --data-path rows name (job_id column), read while it is "
                                  "extracted; without it --data-path is a `layertap export`, or speculators' own "
                                  "folder made through `layertap serve`"),
    ("--layertap-group", str, DEFAULT_GROUP, "the consumer group that records the rows of --layertap-run handed over"),
    ("--layertap-delete-after", true_or_false, False, "true removes each row's own file of --layertap-run under the "
                                                      "storage root once handed over (one epoch), and each generated "
                                                      "file; false (default) removes nothing"),
    ("--layertap-redis-url", str, None, "Redis of --layertap-run (default: LAYERTAP_REDIS_URL)"),
)


@HiddenStatesBackend.register(NAME)
class LayertapBackend(HiddenStatesBackend):
    """``--hidden-states-backend layertap`` (module doc)."""

    @staticmethod
    def add_train_args(parser: argparse.ArgumentParser) -> None:
        for flag, kind, default, help_text in TRAIN_FLAGS:
            parser.add_argument(flag, type=kind, default=default, help=f"layertap: {help_text}")

    @staticmethod
    def add_launch_args(parser: argparse.ArgumentParser) -> None:
        """Nothing: layertap's workers extract, not vLLM."""

    @staticmethod
    def from_train_args(args: argparse.Namespace, data_path: str) -> LayertapTransfer:
        settings = Settings()
        if args.layertap_redis_url:
            settings = settings.model_copy(update={"redis_url": args.layertap_redis_url})
        rows = rows_of(data_path, settings, run=args.layertap_run, group=args.layertap_group,
                       delete_after=args.layertap_delete_after)
        found = rows.layers()
        if getattr(args, "speculator_type", None) != "mtp":  # MTP reads the last layer alone: no target ids
            ids = check_target_layer_ids(getattr(args, "target_layer_ids", None), found.layers,
                                         found.num_hidden_layers, source="--target-layer-ids")
            log.info("layertap: %s holds layers %s (L = %d): target layer ids %s", rows.describe(), found.layers,
                     found.num_hidden_layers, ids)
        return LayertapTransfer(rows, found.layers, settings, delete_after=args.layertap_delete_after)

    @staticmethod
    def build_kv_transfer_config(args: argparse.Namespace) -> dict[str, Any]:
        raise ValueError("the layertap backend reads what layertap workers extract; it configures no vLLM "
                         "connector (for vLLM's own routes answered by layertap, run `layertap serve`)")

