"""Reading job files for ``layertap enqueue``: one job per JSONL line, validated as it streams.

Each line is a JSON object with one input (``prompt``, ``messages`` or ``token_ids``)
plus optional job fields; the command line's fields (model, run, layers, ...) fill in
what a line leaves out. A bad line is reported with its line number and skipped.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from producer.schema import Job


@dataclass
class BadLine:
    line: int
    reason: str


def describe_errors(exc: ValidationError) -> str:
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "job"
    more = f" (+{exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return f"{where}: {first['msg']}{more}"


def job_from_data(data: Any, defaults: dict[str, Any]) -> Job:
    """A job from one row's data with ``defaults`` under it; raises ``ValueError`` saying why not."""
    if not isinstance(data, dict):
        raise ValueError(f"expected a JSON object, got {type(data).__name__}")
    try:
        return Job.model_validate({**defaults, **data}).with_id()
    except ValidationError as exc:
        raise ValueError(describe_errors(exc)) from None


def read_jsonl_jobs(path: str | Path, defaults: dict[str, Any]) -> Iterator[Job | BadLine]:
    """Yield a :class:`Job` or a :class:`BadLine` for each non-blank line of ``path``."""
    with open(path, encoding="utf-8", errors="strict") as handle:
        line_no = 0
        while True:
            try:
                line = handle.readline()
            except UnicodeDecodeError as exc:
                yield BadLine(line_no + 1, f"not valid UTF-8 ({exc.reason}); stopping here")
                return
            if not line:
                return
            line_no += 1
            if not line.strip():
                continue
            try:
                data = json.loads(line)
            except json.JSONDecodeError as exc:
                yield BadLine(line_no, f"not valid JSON ({exc.msg} at column {exc.colno})")
                continue
            try:
                yield job_from_data(data, defaults)
            except ValueError as exc:
                yield BadLine(line_no, str(exc))
