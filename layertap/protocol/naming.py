"""Names that become paths or keys: validation, content-hash ids and the file layout.

Invariants: every name that reaches a Redis key or a log line (model, run, job id, consumer
group and consumer, worker node) passes :func:`check_printable_name`: no control, format or
separator character of any script (tab, CR, LF, DEL, U+0085, U+2028 included), so a key holds
what it says and a log line cannot be forged. A run name or job id that passes :func:`check_name`
(which applies that rule first) is also a single safe path
component (no separators, no ``..``, no NUL or control characters, bounded length), so
``<root>/<run>/<fan-out>/<job_id>.safetensors`` always stays under ``<root>``. A path taken from
Redis is acted on (deleted, linked) only as :func:`file_under_root` returns it, so a forged
result entry cannot lead out of the storage root.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, TypeGuard

#: Names are checked with ``fullmatch`` (``$`` would let a trailing newline through).
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
#: A Hugging Face hub repo id: ``name`` or ``org/name`` (models and datasets alike).
HUB_ID_PATTERN = re.compile(r"(?:[\w.-]+/)?[\w.-]+")
#: Most characters of a name that is not a path component (a model: a hub id, a shape or a folder path).
MAX_NAME_CHARS = 256
FILE_SUFFIX = ".safetensors"
LOCK_SUFFIX = ".lock"
#: Hex digits of the fan-out folder: 16**3 = 4096 folders keep 10^7 files at ~2.4k per folder.
FANOUT_DIGITS = 3


def is_safe_name(value: object) -> TypeGuard[str]:
    """``value`` is a string that may be a run name or job id: one safe path component."""
    return isinstance(value, str) and NAME_PATTERN.fullmatch(value) is not None and ".." not in value


def check_printable_name(value: object, what: str, max_chars: int = MAX_NAME_CHARS) -> str:
    """Return ``value`` if it is a string of 1 to ``max_chars`` printable characters, else raise
    ``ValueError`` saying why. Printable is ``str.isprintable``: no character of Unicode's Other
    (control, format, surrogate, private use, unassigned) or Separator categories but the ASCII
    space; so tab, CR, LF, DEL, U+0085, U+2028, U+2029 and U+200B are refused."""
    if not isinstance(value, str):
        raise ValueError(f"{what} must be a string")
    if not 1 <= len(value) <= max_chars:
        raise ValueError(f"{what} must have 1 to {max_chars} characters, not {len(value)}")
    _refuse_unprintable(value, what)
    return value


def _refuse_unprintable(value: str, what: str) -> None:
    """Raise ``ValueError`` naming the first character of ``value`` that is not printable."""
    bad = next((char for char in value if not char.isprintable()), None)
    if bad is not None:
        raise ValueError(f"{what} {value[:80]!r} holds the character U+{ord(bad):04X}: names reach Redis keys and "
                         "log lines, so control, format and separator characters are not allowed")


def check_name(value: str, what: str) -> str:
    """Return ``value`` if it is a safe name, else raise ``ValueError`` saying why (a character
    that is not printable by :func:`check_printable_name`'s rule named as such)."""
    if not isinstance(value, str):
        raise ValueError(f"{what} must be a string")
    _refuse_unprintable(value, what)
    if not is_safe_name(value):
        raise ValueError(
            f"{what} {value[:80]!r} is not allowed: use 1-128 characters from "
            "A-Z a-z 0-9 . _ -, starting with a letter or digit, without '..'"
        )
    return value


def is_hub_id(text: str) -> bool:
    """``text`` has the form of a hub repo id (it may still not exist there)."""
    return (len(text) <= 96 and HUB_ID_PATTERN.fullmatch(text) is not None and "--" not in text and ".." not in text
            and not text.startswith((".", "-")))


#: A random-weight model shape (``shape:qwen3-8b``), as ``layertap.worker.model.shapes`` reads it.
SHAPE_PREFIX = "shape:"


def served_model_name(source: str) -> str:
    """The one naming rule for a ``--model`` string, applied by the worker (the name it serves
    without ``--name``) and by the client (the queue a job goes to), so that the same string
    meets on both sides. A hub id, a shape or any string that is not an existing folder stays
    as given; an existing folder becomes its basename, or ``org/name`` for a Hugging Face cache
    snapshot (``.../models--org--name/snapshots/<revision>``)."""
    folder = Path(source).expanduser()
    if source.startswith(SHAPE_PREFIX) or not folder.is_dir():
        return source
    folder = folder.resolve()
    if folder.parent.name == "snapshots" and folder.parent.parent.name.startswith("models--"):
        return folder.parent.parent.name.removeprefix("models--").replace("--", "/")
    return folder.name


def canonical_json(obj: Any) -> str:
    """JSON with sorted keys and no whitespace: equal values give equal strings."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def content_hash(obj: Any) -> str:
    """Hex sha256 of the canonical JSON of ``obj``."""
    return hashlib.sha256(canonical_json(obj).encode("utf-8")).hexdigest()


def fanout(job_id: str) -> str:
    """The fan-out folder of a job: leading hex digits of a hash of its id (stable)."""
    return hashlib.sha256(job_id.encode("utf-8")).hexdigest()[:FANOUT_DIGITS]


def job_path(storage_root: str | Path, run: str, job_id: str) -> Path:
    """Where the worker writes a job's file. Both names are checked again here."""
    check_name(run, "run")
    check_name(job_id, "job_id")
    return Path(storage_root) / run / fanout(job_id) / f"{job_id}{FILE_SUFFIX}"


#: ``scheme://`` at the start of a storage root or file address (``s3://bucket/prefix``).
URL_PATTERN = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")


def url_scheme(address: str | Path) -> str | None:
    """The scheme of a URL (``s3``), lower-cased; None for a bare path (a local one)."""
    found = URL_PATTERN.match(str(address))
    return found.group(1).lower() if found else None


def job_location(storage_root: str | Path, run: str, job_id: str) -> str:
    """:func:`job_path` under a root that may be a URL: ``<root>/<run>/<fan-out>/<job_id>.safetensors``,
    joined with ``/`` after a URL root, as a local path after a bare one."""
    if url_scheme(storage_root) is None:
        return str(job_path(storage_root, run, job_id))
    check_name(run, "run")
    check_name(job_id, "job_id")
    return f"{str(storage_root).rstrip('/')}/{run}/{fanout(job_id)}/{job_id}{FILE_SUFFIX}"


def storage_root_of(path: str | Path, run: str, job_id: str) -> str | None:
    """The storage root (path or URL) under which ``path`` is the :func:`job_location` of ``run``/``job_id``;
    None if it is none."""
    if url_scheme(path) is not None:
        tail = job_location("x://", run, job_id).removeprefix("x:")
        root = str(path).removesuffix(tail)
        return root if root != str(path) and url_scheme(root) and job_location(root, run, job_id) == path else None
    path = Path(path)
    if len(path.parents) < 3:
        return None
    root = path.parents[2]
    return str(root) if job_path(root, run, job_id) == path else None


def file_under_root(path: str | Path, storage_root: str | Path, run: str, job_id: str) -> Path | None:
    """The real path of ``path`` if, every symlink resolved, it is exactly the file of ``run``/``job_id``
    under ``storage_root`` (:func:`job_path`); None for anything else: a ``..`` component, a symlink
    that leads out, another job's or another run's file, an unsafe name."""
    if not (is_safe_name(run) and is_safe_name(job_id)) or ".." in Path(path).parts:
        return None
    real = Path(os.path.realpath(path))
    return real if real == job_path(os.path.realpath(storage_root), run, job_id) else None
