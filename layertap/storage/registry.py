"""Which class serves a storage root, by its URL scheme (a bare path is local), imported lazily:
a backend's library loads only when a root of its scheme is used, and a missing one is named
with the extra that brings it (``layertap.extras``). A new backend: one module, one line here.
A scheme ``<backend>+<url>`` names its backend before the ``+``, as Celery's result-backend URLs
do (``db+sqlite://``): ``fsspec+sftp://host/dir`` is the fsspec backend on ``sftp://host/dir``
(:func:`backend_url`). :func:`own_file` is the check a reader makes of a path taken from a result."""

from __future__ import annotations

from collections.abc import Sequence
from importlib import import_module
from pathlib import Path
from typing import Any

from layertap.extras import need
from layertap.protocol.naming import is_safe_name, url_scheme
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


def storage_for(root: str | Path, options: dict[str, Any] | None = None) -> Storage:
    """The storage of a root (or of a file's address: its file-level methods work the same):
    a bare path is local; ``s3://bucket/prefix`` is S3, and so on by :data:`BACKENDS`."""
    if isinstance(root, Storage):
        return root
    scheme, _ = backend_url(root)
    if scheme not in BACKENDS:
        raise ValueError(f"no storage for {str(root)[:80]!r}: known schemes are {', '.join(sorted(BACKENDS))} "
                         "(or a local path; fsspec+<url> for any other fsspec protocol)")
    target, library, extra = BACKENDS[scheme]
    if library:
        need(library, f"storage at {scheme}://", extra)
    module, _, name = target.partition(":")
    return getattr(import_module(module), name)(root, options)


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
