"""Where rows come from: JSONL, JSON arrays, parquet and HF ``datasets`` saved to disk, streamed.

Invariants: no source holds more than one batch of rows in memory (JSONL is read line
by line, a JSON array item by item with ``ijson``, parquet batch by batch, a saved
dataset through its memory-mapped Arrow files); every row carries where it came from
(``line N`` counting from 1 for text files, ``item N`` / ``row N`` counting from 0 for
arrays and datasets, as their indexes do) so a bad row is reported precisely.
``datasets``, ``pyarrow`` and ``ijson`` (the ``[data]`` extra) are imported only when used.
"""

from __future__ import annotations

import io
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from layertap.extras import need
from layertap.protocol.naming import is_hub_id

BATCH_ROWS = 1024


@dataclass
class SourceRow:
    """One row, or why it could not be read (``error``); ``where`` names its place in the file."""

    where: str
    data: Any = None
    error: str | None = None


@dataclass
class RowSource:
    """An open source: its kind, its row count when known without reading it, and its rows."""

    kind: str
    total: int | None
    rows: Iterator[SourceRow]


#: The ``--file`` that means standard input (JSONL).
STDIN = "-"


def iter_jsonl(path: Path | str) -> Iterator[SourceRow]:
    """One row per non-blank line (of standard input for ``-``); a line that is not JSON is an error
    row; bad UTF-8 stops the file."""
    opened = (io.TextIOWrapper(sys.stdin.buffer, encoding="utf-8", errors="strict") if str(path) == STDIN
              else open(path, encoding="utf-8", errors="strict"))
    with opened as handle:
        line_no = 0
        while True:
            try:
                line = handle.readline()
            except UnicodeDecodeError as exc:
                yield SourceRow(f"line {line_no + 1}", error=f"not valid UTF-8 ({exc.reason}); stopping here")
                return
            if not line:
                return
            line_no += 1
            if not line.strip():
                continue
            try:
                yield SourceRow(f"line {line_no}", json.loads(line))
            except json.JSONDecodeError as exc:
                yield SourceRow(f"line {line_no}", error=f"not valid JSON ({exc.msg} at column {exc.colno})")


def iter_json_array(path: Path) -> Iterator[SourceRow]:
    """The items of a top-level JSON array (ShareGPT's own files), parsed incrementally."""
    ijson = need("ijson")
    index = 0
    with open(path, "rb") as handle:
        try:
            for item in ijson.items(handle, "item", use_float=True):
                yield SourceRow(f"item {index}", item)
                index += 1
        except ijson.JSONError as exc:
            yield SourceRow(f"item {index}", error=f"not valid JSON ({exc}); stopping here")


def is_json_array(path: Path) -> bool:
    """True when the file's first non-blank character opens an array."""
    with open(path, "rb") as handle:
        while chunk := handle.read(4096):
            stripped = chunk.lstrip()
            if stripped:
                return stripped.startswith(b"[")
    return False


def table_rows(batch: Any) -> list[dict[str, Any]]:
    """Rows of an Arrow record batch (or a column dict from ``datasets``) as dicts."""
    if isinstance(batch, dict):
        names = list(batch)
        return [dict(zip(names, values)) for values in zip(*batch.values())]
    return batch.to_pylist()


def split_files(files: list[Path], root: Path, split: str | None) -> list[Path]:
    """Parquet files of ``split``: a folder named like it, or a file named ``<split>-*`` / ``<split>.*``."""
    if split is None:
        return files
    chosen = [f for f in files if split in f.relative_to(root).parent.parts
              or f.name.startswith((f"{split}-", f"{split}."))]
    if not chosen:
        raise ValueError(f"no parquet file of split {split!r} under {root}")
    return chosen


def parquet_source(path: Path, split: str | None) -> RowSource:
    """Parquet files (one, or every ``*.parquet`` under a folder in path order), read batch by batch."""
    pq = need("pyarrow.parquet")
    files = [path] if path.is_file() else split_files(sorted(path.rglob("*.parquet")), path, split)
    opened = [pq.ParquetFile(f) for f in files]

    def rows() -> Iterator[SourceRow]:
        index = 0
        for parquet in opened:
            for batch in parquet.iter_batches(batch_size=BATCH_ROWS):
                for row in table_rows(batch):
                    yield SourceRow(f"row {index}", row)
                    index += 1

    return RowSource("parquet", sum(p.metadata.num_rows for p in opened), rows())


def saved_dataset_source(path: Path, split: str | None) -> RowSource:
    """A dataset saved with ``save_to_disk`` (a ``Dataset``, or one split of a ``DatasetDict``)."""
    datasets = need("datasets")
    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        names = list(loaded)
        if split is None:
            if "train" not in loaded and len(names) != 1:
                raise ValueError(f"{path} has the splits {', '.join(names)}: choose one with --split")
            split = "train" if "train" in loaded else names[0]
        if split not in loaded:
            raise ValueError(f"{path} has no split {split!r} (it has {', '.join(names)})")
        loaded = loaded[split]
    elif split is not None:
        raise ValueError(f"{path} is a single dataset without splits; leave out --split")
    dataset = loaded.with_format(None)

    def rows() -> Iterator[SourceRow]:
        index = 0
        for batch in dataset.iter(batch_size=BATCH_ROWS):
            for row in table_rows(batch):
                yield SourceRow(f"row {index}", row)
                index += 1

    return RowSource("dataset", len(dataset), rows())


#: Suffixes that name a local file, never a hub dataset id.
FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".txt", ".arrow")


def hub_dataset_source(dataset_id: str, split: str | None) -> RowSource:
    """A dataset on the Hugging Face hub (or in its local cache), streamed with ``datasets.load_dataset``."""
    datasets = need("datasets", "a hub dataset id")
    try:
        loaded = datasets.load_dataset(dataset_id, split=split or "train", streaming=True)
    except Exception as exc:  # datasets raises many types (hub, network, missing split)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"{dataset_id}: no such file, and datasets could not load it as a hub dataset: "
                         f"{first}") from None

    def rows() -> Iterator[SourceRow]:
        for index, row in enumerate(loaded):
            yield SourceRow(f"row {index}", row)

    return RowSource("hub", None, rows())


def open_source(path: str | Path, *, split: str | None = None) -> RowSource:
    """Open ``path`` by what it is: ``-`` for JSONL on standard input, a saved dataset folder, parquet, a
    JSON array, JSONL (any other file), or, when no such file exists and it has the form ``org/name``,
    a hub dataset."""
    text = str(path)
    if text == STDIN:
        return RowSource("jsonl", None, iter_jsonl(STDIN))
    path = Path(path)
    if not path.exists():
        if is_hub_id(text) and not text.endswith(FILE_SUFFIXES):
            return hub_dataset_source(text, split)
        raise FileNotFoundError(f"{path} does not exist")
    if path.is_dir():
        if (path / "dataset_dict.json").exists() or (path / "state.json").exists():
            return saved_dataset_source(path, split)
        if any(path.rglob("*.parquet")):
            return parquet_source(path, split)
        raise ValueError(f"{path} is a folder but neither a saved dataset (save_to_disk) nor parquet files")
    if split is not None:
        raise ValueError(f"--split applies to a saved dataset or a folder of parquet files, not to {path.name}")
    if path.suffix == ".parquet":
        return parquet_source(path, None)
    if path.suffix == ".json" and is_json_array(path):
        return RowSource("json", None, iter_json_array(path))
    return RowSource("jsonl", None, iter_jsonl(path))
