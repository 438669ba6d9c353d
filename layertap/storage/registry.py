"""Which class serves a storage root, by its URL scheme (a bare path is local), imported lazily:
a backend's library loads only when a root of its scheme is used, and a missing one is named
with the extra that brings it (``layertap.extras``). A new backend: one module, one line here.
A scheme ``<backend>+<url>`` names its backend before the ``+``, as Celery's result-backend URLs
do (``db+sqlite://``): ``fsspec+sftp://host/dir`` is the fsspec backend on ``sftp://host/dir``
(:func:`backend_url`). :func:`own_file` is the check a reader makes of a path taken from a result.

Resolved once per process, with its options: :func:`storage_for` builds a root's storage once for
its options (``Settings.storage``), and a file's address is served by the storage already
resolved for the root that holds it (:func:`storage_at`), so a reader that names a path only
reads it with the options its process resolved its storage with. Options not given are those
(``use_options``; the Client gives its settings' at start).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from importlib import import_module
from pathlib import Path
from typing import Any

from layertap.extras import need
from layertap.protocol.naming import FILE_SUFFIX, is_safe_name, url_scheme
from layertap.storage.base import Storage

#: scheme -> ("module:Class", the library it needs, the extra that installs it); "" where none
BACKENDS: dict[str, tuple[str, str, str]] = {
    "file": ("layertap.storage.local:LocalStorage", "", ""),
    "s3": ("layertap.storage.fsspec_store:FsspecStorage", "s3fs", "s3"),
    "gs": ("layertap.storage.fsspec_store:FsspecStorage", "gcsfs", "gcs"),
    "az": ("layertap.storage.fsspec_store:FsspecStorage", "adlfs", "azure"),
    "fsspec": ("layertap.storage.fsspec_store:FsspecStorage", "fsspec", "s3"),  # fsspec+<any fsspec URL>
}


def backend_url(address: str | Path) -> tuple[str, str]:
    """The backend that serves ``address`` (a :data:`BACKENDS` name) and the address as that
    backend opens it: ``fsspec+memory://x/y`` -> ``("fsspec", "memory://x/y")``, ``s3://b/k`` ->
    ``("s3", "s3://b/k")``, a bare path -> ``("file", path)``."""
    scheme = url_scheme(address)
    if scheme is None:
        return "file", str(address)
    backend, plus, _ = scheme.partition("+")
    return (backend, str(address)[len(backend) + 1:]) if plus else (scheme, str(address))


#: This process's storages: (root, options as JSON) -> the storage, each built once.
_resolved: dict[tuple[str, str], Storage] = {}
#: Backend -> the options this process uses where a call gives none (:func:`use_options`).
_options: dict[str, dict[str, Any]] = {}
_lock = threading.Lock()


def use_options(root: str | Path, options: dict[str, Any]) -> None:
    """From now on, read and write every address of ``root``'s backend with ``options`` where a call
    names none (a process's settings: ``storage_root``, ``storage_options``)."""
    _options[backend_url(root)[0]] = dict(options)


def storage_for(root: str | Path, options: dict[str, Any] | None = None) -> Storage:
    """The storage of ``root``, built once per process for each root and options (a bare path is
    local; ``s3://bucket/prefix`` is S3, and so on by :data:`BACKENDS`). ``options`` None: this
    process's for the backend (:func:`use_options`, or the last given here), else none."""
    if isinstance(root, Storage):
        return root
    if str(root).endswith(FILE_SUFFIX):  # a job file's address, never a root
        return storage_at(root, options)
    scheme, _ = backend_url(root)
    if scheme not in BACKENDS:
        raise ValueError(f"no storage for {str(root)[:80]!r}: known schemes are {', '.join(sorted(BACKENDS))} "
                         "(or a local path; fsspec+<url> for any other fsspec protocol)")
    if options is None:
        options = _options.get(scheme, {})
    else:
        _options[scheme] = dict(options)
    key = (os.path.abspath(root) if scheme == "file" else str(root), json.dumps(options, sort_keys=True, default=repr))
    with _lock:
        if key not in _resolved:
            target, library, extra = BACKENDS[scheme]
            if library:
                need(library, f"storage at {scheme}://", extra)
            module, _, name = target.partition(":")
            _resolved[key] = getattr(import_module(module), name)(root, options)
        return _resolved[key]


def storage_at(address: str | Path, options: dict[str, Any] | None = None) -> Storage:
    """The storage that reads and writes the file at ``address``: the one resolved for the root
    that holds it (with ``options``, if given), else the storage of the address's location (its
    bucket, or the local file system) with ``options`` (None: :func:`storage_for`'s)."""
    held = max((storage for storage in list(_resolved.values())
                if storage.holds(str(address)) and (options is None or storage.options == options)),
               key=lambda storage: len(storage.root), default=None)
    if held is not None:
        return held
    scheme, url = backend_url(address)
    if scheme == "file":
        return storage_for("/", options)
    head, sep, rest = url.partition("://")
    return storage_for(str(address)[:len(str(address)) - len(url)] + head + sep + rest.split("/", 1)[0], options)


def resolved_storages() -> list[Storage]:
    """The storages this process has built, in order (each root and options once)."""
    return list(_resolved.values())


def own_file(address: str, run: str, job_id: str, roots: Sequence[Storage]) -> str | None:
    """``address`` as a reader acts on it if it is the file of ``run``/``job_id`` under one of
    ``roots``, the reader's own storage roots (``Settings.reading_storages``), by that storage's
    :meth:`Storage.owned` (the check before a delete: local paths with every symlink resolved);
    None for anything else, as a result entry is data anyone who can write to Redis could forge:
    another run's or job's file, a file under a root the reader was not given, a ``..`` path, a
    symlink that leads elsewhere, a name with a NUL (no file has one), a URL of a scheme no
    backend serves."""
    if "\0" in address or backend_url(address)[0] not in BACKENDS:
        return None
    if not (is_safe_name(run) and is_safe_name(job_id)):
        return None
    return next((own for storage in roots if (own := storage.owned(address, run, job_id)) is not None), None)


def foreign_path(address: str, run: str, roots: Sequence[Storage]) -> str:
    """What a reader reports of a result's path that :func:`own_file` refuses."""
    named = ", ".join(str(storage.root) for storage in roots)
    return (f"its result names {address!r}, which is not the job's own file in run {run} under this reader's "
            f"storage roots ({named}: storage_root and read_roots)")
