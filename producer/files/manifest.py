"""A run's manifest: one row per job with an ok result and a valid file, for training and export.

Built from the run's ledger (``layertap.producer.client.runs.ok_files``, which ``layertap manifest``
calls): the jobs whose stream entries were trimmed first (by job id, found on disk under the run's storage
roots), then the stream's: each job id once (its last ok result; later duplicates of a job that ran
twice are the same file), in the order jobs first finished ok. A job's ``metadata`` comes
from its result, else from its file's header. A result's path must be the job's own file in
the run under the reader's storage roots (``storage.registry.own_file``: not another run's file,
not under another root, no ``..``), each file's header
is read (``verify=True`` also checks every tensor's checksum), and the file must name the same
job; a job whose path is not its own file, or whose file is missing or damaged, is reported as
:class:`Skipped`, never listed. Parquet needs ``pyarrow`` (the ``[data]`` extra); JSONL
needs nothing. Memory: one (path, metadata) pair per ok job while the stream is read.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from layertap.protocol import fileformat as ff
from layertap.protocol.fileformat import FileFormatError, MetaKey
from layertap.storage.base import Storage
from layertap.storage.registry import foreign_path, own_file, storage_at

WRITE_BATCH = 10_000


@dataclass
class ManifestEntry:
    """One job's file. ``layers`` are vLLM-convention ids in file order; ``checksums`` is the
    header's JSON object of CRC-32s per tensor; ``tensors`` the names of the tensors stored."""

    job_id: str
    path: str
    num_tokens: int
    layers: list[int]
    num_hidden_layers: int
    hidden_size: int
    dtype: str
    model: str
    tensors: list[str]
    spec_hash: str
    checksums: str
    metadata: str | None = None


COLUMNS = tuple(f.name for f in fields(ManifestEntry))


@dataclass
class Skipped:
    """An ok result whose file cannot be listed, and why."""

    job_id: str
    path: str
    reason: str


def entry_from_file(job_id: str, path: str, metadata: str | None = None, *, verify: bool = False,
                    storage_options: dict[str, Any] | None = None) -> ManifestEntry:
    """The manifest entry of one file (a path or URL; ``storage_options`` for an object store),
    from its header. Raises ``FileFormatError`` or ``OSError``."""
    storage = storage_at(path, storage_options)
    parsed = storage.verify(path) if verify else storage.read_header(path)
    header, meta = parsed.tensors, parsed.metadata
    if meta.get(MetaKey.JOB_ID) != job_id:
        raise FileFormatError(f"{path}: the file is of job {meta.get(MetaKey.JOB_ID)!r}, not {job_id!r}")
    if ff.HIDDEN_STATES not in header or ff.TOKEN_IDS not in header:
        raise FileFormatError(f"{path}: not a complete layertap file (hidden_states or token_ids missing)")
    shape = header[ff.HIDDEN_STATES]["shape"]  # [T, layers, (copies,) H]
    num_tokens, hidden_size = shape[0], shape[-1]
    return ManifestEntry(
        job_id=job_id, path=str(path), num_tokens=num_tokens, layers=json.loads(meta[MetaKey.LAYERS]),
        num_hidden_layers=int(meta[MetaKey.NUM_LAYERS]), hidden_size=hidden_size, dtype=meta[MetaKey.DTYPE],
        model=meta[MetaKey.MODEL], tensors=sorted(header), spec_hash=meta[MetaKey.SPEC_HASH],
        checksums=meta[MetaKey.CHECKSUMS],
        metadata=metadata if metadata is not None else meta.get(MetaKey.JOB_METADATA),
    )


def collect(results: dict[str, tuple[str, str | None]], *, run: str, roots: Sequence[Storage], verify: bool = False,
            storage_options: dict[str, Any] | None = None) -> Iterator[ManifestEntry | Skipped]:
    """An entry (or why not) for each ok result of ``run`` (job id -> (path, metadata)), in order;
    a path must be its job's file under one of ``roots`` (``Settings.reading_storages``)."""
    for job_id, (path, metadata) in results.items():
        if own_file(path, run, job_id, roots) is None:
            yield Skipped(job_id, path, foreign_path(path, run, roots))
            continue
        try:
            yield entry_from_file(job_id, path, metadata, verify=verify, storage_options=storage_options)
        except (FileFormatError, OSError, KeyError, ValueError) as exc:
            yield Skipped(job_id, path, str(exc) if not isinstance(exc, KeyError) else f"header has no {exc}")


def arrow_schema() -> Any:
    """The Parquet manifest's schema: :class:`ManifestEntry`'s fields, in order (``COLUMNS``); needs pyarrow."""
    import pyarrow as pa

    return pa.schema([
        ("job_id", pa.string()), ("path", pa.string()), ("num_tokens", pa.int64()), ("layers", pa.list_(pa.int64())),
        ("num_hidden_layers", pa.int64()), ("hidden_size", pa.int64()), ("dtype", pa.string()),
        ("model", pa.string()), ("tensors", pa.list_(pa.string())), ("spec_hash", pa.string()),
        ("checksums", pa.string()), ("metadata", pa.string()),
    ])


def default_manifest_path(run: str) -> Path:
    """``<run>.manifest.parquet`` when pyarrow is installed, else ``<run>.manifest.jsonl``."""
    import importlib.util

    return Path(f"{run}.manifest.{'parquet' if importlib.util.find_spec('pyarrow') else 'jsonl'}")


def write_manifest(entries: Iterable[ManifestEntry], out: str | Path) -> int:
    """Write entries to ``out`` (``.parquet``, else JSON lines) through a temp file; returns the count."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    temp = out.with_name(f".{out.name}.tmp")
    count = 0
    if out.suffix == ".parquet":
        from layertap.extras import need

        pa, pq = need("pyarrow"), need("pyarrow.parquet")
        schema = arrow_schema()
        with pq.ParquetWriter(temp, schema) as writer:
            batch: list[dict[str, Any]] = []
            for entry in entries:
                batch.append(asdict(entry))
                count += 1
                if len(batch) >= WRITE_BATCH:
                    writer.write_table(pa.Table.from_pylist(batch, schema=schema))
                    batch = []
            if batch or count == 0:
                writer.write_table(pa.Table.from_pylist(batch, schema=schema))
    else:
        with open(temp, "w", encoding="utf-8") as handle:
            for entry in entries:
                handle.write(json.dumps(asdict(entry), ensure_ascii=False) + "\n")
                count += 1
    os.replace(temp, out)
    return count


def iter_manifest(path: str | Path) -> Iterator[ManifestEntry]:
    """The entries of a manifest file (parquet read batch by batch, or JSON lines)."""
    path = Path(path)
    if path.suffix == ".parquet":
        from layertap.extras import need

        parquet = need("pyarrow.parquet").ParquetFile(path)
        for batch in parquet.iter_batches(batch_size=WRITE_BATCH):
            for row in batch.to_pylist():
                yield ManifestEntry(**{name: row.get(name) for name in COLUMNS})
        return
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                row = json.loads(line)
                yield ManifestEntry(**{name: row.get(name) for name in COLUMNS})
