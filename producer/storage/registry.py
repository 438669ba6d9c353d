"""Which class serves a storage root, by its URL scheme (a bare path is local), imported lazily:
a backend's library loads only when a root of its scheme is used, and a missing one is named
with the extra that brings it (``layertap.producer.extras``). A new backend: one module, one line here."""

from __future__ import annotations

from importlib import import_module
from pathlib import Path
from typing import Any

from layertap.producer.extras import need
from layertap.producer.protocol.naming import url_scheme
from layertap.producer.storage.base import Storage

#: scheme -> ("module:Class", the library it needs, the extra that installs it); "" where none
BACKENDS: dict[str, tuple[str, str, str]] = {
    "file": ("layertap.producer.storage.local:LocalStorage", "", ""),
    "s3": ("layertap.producer.storage.fsspec_store:FsspecStorage", "s3fs", "s3"),
    "gs": ("layertap.producer.storage.fsspec_store:FsspecStorage", "gcsfs", "gcs"),
    "az": ("layertap.producer.storage.fsspec_store:FsspecStorage", "adlfs", "azure"),
}


def storage_for(root: str | Path, options: dict[str, Any] | None = None) -> Storage:
    """The storage of a root (or of a file's address: its file-level methods work the same):
    a bare path is local; ``s3://bucket/prefix`` is S3, and so on by :data:`BACKENDS`."""
    if isinstance(root, Storage):
        return root
    scheme = url_scheme(root) or "file"
    if scheme not in BACKENDS:
        raise ValueError(f"no storage for {str(root)[:80]!r}: known schemes are {', '.join(sorted(BACKENDS))} "
                         "(or a local path)")
    target, library, extra = BACKENDS[scheme]
    if library:
        need(library, f"storage at {scheme}://", extra)
    module, _, name = target.partition(":")
    return getattr(import_module(module), name)(root, options)
