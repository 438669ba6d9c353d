"""Where row ``i`` of a speculators data folder has its hidden states, under layertap's rules.

speculators' ``ArrowDataset`` asks for rows by index, in its own (shuffled) order, one each per
epoch; a folder's rows are HF ``datasets`` rows (``input_ids``, ``loss_mask``, ``seq_len``), with a
``job_id`` column naming the layertap job of each where layertap made them. Three kinds of folder:

* an export (``layertap export --format speculators``, :class:`ExportRows`): row ``i``'s file is
  ``hidden_states/hs_{i}.safetensors`` (a link to, or copy of, its job's file); never removed;
* a run's rows (:class:`RunRows`): row ``i``'s file is the ok result of job ``job_id[i]`` in the
  run. A job not yet final is waited for (the run may be extracted while the trainer reads it),
  as long as it may still come: it is submitted, or the run is not sealed. An error result, or a
  job the sealed and complete run never got, gives no file (logged; speculators' ``--on-missing``
  decides). A path a result names is taken only when it is the job's own file in the run under
  the reader's storage roots (``storage.registry.own_file``): results are data anyone who can
  write to Redis could forge.
  A row handed to the trainer is recorded as consumed by consumer group ``group`` (the run
  ledger's ``mark_consumed``), and with ``delete_after`` its file and lock are removed first,
  only when it is that own file under the reader's storage root (``Storage.owned``);
* speculators' own (``prepare-data``'s rows, no ``job_id`` column; :class:`GeneratedRows`,
  ``files.data_folder``): row ``i``'s file is ``hidden_states/hs_{i}.safetensors`` where
  speculators' ``generate-offline-data`` moved ``layertap serve``'s answer for it; a row without
  one has no file (``--on-missing generate`` asks the endpoint: ``LayertapTransfer.get_generated``).
  Every file's header is read before training (the same layers in each; runs whose certificates
  disagree in their states refused, ``verify.RunStates``); the files are never removed.

Every file handed over must hold the trainer's layers, and so must each file ``layertap serve``
answers (:meth:`FolderRows.checked`, :meth:`FolderRows.checked_answer`); an answer's run is held
to the certificates of the runs seen before, as the folder's files are.

Torch-free; ``trainers.hs_backend`` loads the files (checksums verified) and hands them over.
torch's DataLoader pickles objects here into speculators' worker processes (inside the trainer, never
on a wire: Redis carries JSON only): Redis clients and the folder's ``job_id`` column are opened
again in each process.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from layertap.extras import need
from layertap.producer.client import runs
from layertap.producer.files.data_folder import folder_layers, row_file
from layertap.producer.files.export_config import CONFIG_NAME, ExportLayers, read_export_layers
from layertap.producer.files.manifest import entry_from_file
from layertap.producer.files.verify import RunStates
from layertap.protocol.fileformat import FileFormatError, FileHeader, MetaKey, is_vllm_file
from layertap.protocol.schema import Result, Status
from layertap.settings import Settings
from layertap.storage.registry import foreign_path, own_file, storage_at
from layertap.transport.ledger import Ledger
from layertap.transport.redis_conn import connect

log = logging.getLogger(__name__)

#: The data folder's column naming each row's job.
JOB_ID_COLUMN = "job_id"
#: How long a wait for a job blocks on the results stream before it looks again (ms).
WAKE_MS = 1000
#: A wait for a job says so in the log at its start and then every this many seconds.
WAIT_LOG_S = 60.0
#: Seconds Redis is waited out (a restart) before a read gives up.
REDIS_GIVE_UP_S = 300.0


class RowError(LookupError):
    """A row that can have no file: the folder names no job for it, or the run will never hold its job."""


@dataclass(frozen=True)
class RowFile:
    """Row ``index``'s file: job ``job_id``'s, at ``path`` (a local path or a URL)."""

    index: int
    job_id: str
    path: str


class FolderRows:
    """A data folder's rows and their job ids (its ``job_id`` column, opened lazily in each process)."""

    def __init__(self, data_path: str | Path, settings: Settings):
        self.data_path, self.settings = Path(data_path), settings
        self.states = RunStates(settings.storage_options)  # the runs of the files seen, by their certificates
        self._job_ids: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_job_ids": None}  # each DataLoader process opens its own

    def job_id(self, index: int) -> str:
        if self._job_ids is None:
            dataset = need("datasets", "reading a speculators data folder", "speculators").load_from_disk(
                str(self.data_path))
            if JOB_ID_COLUMN not in dataset.column_names:
                raise RowError(f"{self.data_path} has no {JOB_ID_COLUMN!r} column: its rows name no layertap jobs "
                               f"(columns: {', '.join(dataset.column_names)})")
            self._job_ids = dataset.with_format(None).select_columns([JOB_ID_COLUMN])
        return self._job_ids[index][JOB_ID_COLUMN]

    def checked(self, row: RowFile, header: FileHeader, layers: list[int]) -> None:
        """Refuse a file that is not row's job's or holds other layers than ``layers`` (``ValueError``);
        a file vLLM wrote (no header metadata) names neither and passes."""
        if is_vllm_file(header):
            return
        meta = header.metadata
        if meta.get(MetaKey.JOB_ID) != row.job_id:
            raise ValueError(f"{row.path}: the file is of job {meta.get(MetaKey.JOB_ID)!r}, but row {row.index} of "
                             f"{self.data_path} names job {row.job_id!r}")
        check_layers(row.path, f"row {row.index}, job {row.job_id}", header, layers)

    def checked_answer(self, path: str, header: FileHeader, layers: list[int]) -> None:
        """Refuse a file ``layertap serve`` answered (``ValueError``) that holds other layers than ``layers``,
        or whose run's certificate disagrees with those of the runs seen before (``verify.RunStates``)."""
        check_layers(path, "layertap serve's answer", header, layers)
        self.states.see(path)

    def handed_over(self, row: RowFile) -> None:
        """Row's states went to the trainer (nothing to record for a folder of files)."""


class ExportRows(FolderRows):
    """An export's rows: row ``i``'s file is ``hidden_states/hs_{i}.safetensors`` (module doc)."""

    def file(self, index: int) -> RowFile:
        return RowFile(index, self.job_id(index), str(row_file(self.data_path, index)))

    def layers(self) -> ExportLayers:
        return read_export_layers(self.data_path)

    def describe(self) -> str:
        return f"the export {self.data_path}"


class GeneratedRows(FolderRows):
    """speculators' own data folder made through ``layertap serve`` (module doc)."""

    def file(self, index: int) -> RowFile | None:
        """Row ``index``'s file, of the job its header names; None where the row has none (or it does not read)."""
        path = str(row_file(self.data_path, index))
        try:
            meta = storage_at(path, self.settings.storage_options).read_header(path).metadata
        except FileNotFoundError:
            return None  # not generated yet: speculators' --on-missing decides
        except (OSError, FileFormatError) as exc:
            log.warning("row %d: %s; no states for it", index, exc)
            return None
        return RowFile(index, meta.get(MetaKey.JOB_ID, ""), path)

    def layers(self) -> ExportLayers:
        """The layers of every file of the folder (``data_folder.folder_layers``), their runs seen."""
        return folder_layers(self.data_path, self.settings.reading_storages(), self.states,
                             self.settings.storage_options)

    def describe(self) -> str:
        return f"the data folder {self.data_path}"


class RunRows(FolderRows):
    """A data folder's rows as jobs of ``run``, sealed or still extracted (module doc)."""

    def __init__(self, data_path: str | Path, run: str, settings: Settings, *, group: str, delete_after: bool):
        super().__init__(data_path, settings)
        self.run, self.group, self.delete_after = run, group, delete_after
        self._redis: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "_redis": None}

    @property
    def ledger(self) -> Ledger:
        """The run's ledger, opened in this process; it waits Redis out for :data:`REDIS_GIVE_UP_S`."""
        if self._redis is None:
            self._redis = connect(self.settings, decode_responses=True)
        return Ledger(self._redis, REDIS_GIVE_UP_S)

    def describe(self) -> str:
        return f"run {self.run} (rows of {self.data_path})"

    def file(self, index: int) -> RowFile | None:
        """Row ``index``'s file once its job is final; None for an error result or a path that is not the job's own."""
        job_id = self.job_id(index)
        result = self.final_result(job_id, f"row {index}")
        if not result.ok or not result.path:
            log.warning("row %d: job %s of run %s ended %s (%s); no states for it", index, job_id, self.run,
                        result.error_type.value if result.error_type else result.status.value, result.error)
            return None
        path = own_path(result.path, self.run, job_id, self.settings)
        if path is None:
            log.warning("row %d: job %s: %s; not read", index, job_id,
                        foreign_path(result.path, self.run, self.settings.reading_storages()))
            return None
        return RowFile(index, job_id, path)

    def layers(self) -> ExportLayers:
        """The layers of the run's files: the header of the first ok job's file found (waited for)."""
        waiting = Waiting(f"the first ok result of run {self.run} (its files' layers)")
        while True:
            found = self._first_file_layers()
            if found is not None:
                return found
            waiting.say()
            self._sleep_until_a_result()

    def handed_over(self, row: RowFile) -> None:
        """Record row's job as consumed by the group; with ``delete_after`` remove its own file first."""
        if self.delete_after:
            remove_own_file(row.path, self.run, row.job_id, self.settings)
        self.ledger.mark_consumed(self.run, self.group, row.job_id, Status.ok)

    def final_result(self, job_id: str, what: str) -> Result:
        """Job ``job_id``'s final result, waiting for it while it may come; :class:`RowError` when it never will."""
        waiting = Waiting(f"job {job_id} of run {self.run} ({what})")
        while True:
            found = self._final_or_why_not(job_id)
            if isinstance(found, Result):
                return found
            if found is not None:
                raise RowError(f"{what}: {found}")
            waiting.say()
            self._sleep_until_a_result()

    def _final_or_why_not(self, job_id: str) -> Result | str | None:
        """The job's final result; else why it never will have one; else None (it may still come)."""
        run, book = self.run, self.ledger
        status, entry_id, submitted, sealed = book.job_state(run, job_id)
        if status is not None:
            return book.results_at(run, [entry_id])[0] or runs.ledger_result(book, run, job_id, status)
        if not submitted and sealed and runs.is_complete(book.redis, run):
            return f"job {job_id} is not in run {run}, which is sealed and complete"
        return None

    def _first_file_layers(self) -> ExportLayers | None:
        """The layers in the header of an ok job's own file that reads, or None while there is none."""
        for job_id, status in self.ledger.statuses(self.run):
            result = self._final_or_why_not(job_id) if status == Status.ok.value else None
            if not (isinstance(result, Result) and result.path):
                continue
            path = own_path(result.path, self.run, job_id, self.settings)
            if path is None:
                continue
            try:
                entry = entry_from_file(job_id, path, storage_options=self.settings.storage_options)
            except (OSError, FileFormatError, KeyError, ValueError):  # removed (delete_after) or damaged: another
                continue
            return ExportLayers(list(entry.layers), entry.num_hidden_layers)
        return None

    def _sleep_until_a_result(self) -> None:
        """Block until the run's stream has an entry after its last one now (or :data:`WAKE_MS`)."""
        book = self.ledger
        book.read_results(self.run, book.last_entry_id(self.run) or "0-0", count=1, block_ms=WAKE_MS)


def check_layers(path: str, what: str, header: FileHeader, layers: list[int]) -> None:
    """Refuse (``ValueError``) the file at ``path`` (``what`` it is) whose header names other layers than ``layers``."""
    found = json.loads(header.metadata[MetaKey.LAYERS])
    if found != layers:
        raise ValueError(f"{path} ({what}) holds layers {found}, not the {layers} the trainer was started with: "
                         "speculators would take other layers")


def own_path(path: str, run: str, job_id: str, settings: Settings) -> str | None:
    """``path`` as the reader acts on it if it is the file of ``run``/``job_id`` under the reader's storage
    roots (``storage.registry.own_file`` with ``Settings.reading_storages``: ``storage_root``, ``read_roots``),
    else None."""
    return own_file(path, run, job_id, settings.reading_storages())


def remove_own_file(path: str, run: str, job_id: str, settings: Settings) -> bool:
    """Remove ``path`` (and its lock) if it is the file of ``run``/``job_id`` under the reader's storage
    root (``settings.storage_root``, by ``Storage.owned``); else leave it, say so in the log, and return False."""
    storage = settings.storage()
    own = storage.owned(path, run, job_id)
    if own is None:
        log.warning("job %s: %s is not its own file in run %s under the storage root %s; not removed",
                    job_id, path, run, storage.root)
        return False
    storage.remove(own)
    return True


class Waiting:
    """Says in the log what a reader waits for: at once, then every :data:`WAIT_LOG_S`."""

    def __init__(self, what: str):
        self.what, self.since, self.next = what, time.monotonic(), 0.0

    def say(self) -> None:
        now = time.monotonic()
        if now >= self.next:
            log.info("waiting for %s: not extracted yet (%.0fs so far)", self.what, now - self.since)
            self.next = now + WAIT_LOG_S


Rows = ExportRows | GeneratedRows | RunRows


def rows_of(data_path: str | Path, settings: Settings, *, run: str | None, group: str,
            delete_after: bool) -> Rows:
    """A folder's rows: a run's with ``run``, else an export's (it has ``export_config.CONFIG_NAME``), else
    speculators' own (``delete_after`` there removes ``layertap serve``'s answers only; an export refuses it)."""
    if run is not None:
        return RunRows(data_path, run, settings, group=group, delete_after=delete_after)
    if not (Path(data_path) / CONFIG_NAME).exists():
        return GeneratedRows(data_path, settings)
    if delete_after:
        raise ValueError("delete_after removes a run's files once read: it needs the run (an export's files "
                         "are never removed)")
    return ExportRows(data_path, settings)
