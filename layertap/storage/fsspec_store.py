"""Job files in an object store through fsspec (``s3://`` with s3fs, ``gs://`` with gcsfs,
``az://`` with adlfs): the ``[s3]`` extra brings s3fs.

A writer's file is spooled to local disk (``spool_dir`` option, else the temp folder) and
uploaded to its final key on commit; the only lock is the object appearing whole (a ``PUT``,
or a multipart upload completed), so readers never see a partial object and :meth:`lock` holds
nothing. Two workers writing one job upload equal content (its ``content_id``); the last wins.
Readers read byte ranges (headers, checksums) or download to a spool file (:meth:`local`).

Options (``settings.storage_options`` or ``storage_for(url, options)``) go to the fsspec
filesystem: for s3fs ``endpoint_url``, ``key``, ``secret``, ``client_kwargs``...; credentials
also come from the standard places (``AWS_*`` variables, ``~/.aws``, ``FSSPEC_S3_*``).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import fsspec

from layertap.storage.base import Storage, removing
from layertap.storage.local import HOST_TAG, TEMP_SUFFIX, sweep_temp_files

#: Bytes per ranged read of an object (checksums read whole tensors in 16 MiB chunks).
BLOCK_SIZE = 16 << 20


class FsspecStorage(Storage):
    """Files under an fsspec URL root; ``spool_dir`` (an option) is where they are staged locally."""

    def __init__(self, root: str | Path, options: dict[str, Any] | None = None):
        super().__init__(str(root).rstrip("/"), options)
        fs_options = dict(self.options)
        self.spool_dir = Path(fs_options.pop("spool_dir", None) or Path(tempfile.gettempdir()) / "layertap-spool")
        self.fs, _ = fsspec.core.url_to_fs(self.root, **fs_options)

    def _spool(self, address: str) -> Path:
        self.spool_dir.mkdir(parents=True, exist_ok=True)
        name = address.rsplit("/", 1)[-1]
        return self.spool_dir / f".{name}.{HOST_TAG}-{os.getpid()}.{uuid.uuid4().hex[:8]}{TEMP_SUFFIX}"

    def lock(self, address: str) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def write(self, address: str) -> Iterator[Path]:
        with removing(self._spool(address)) as spool:
            yield spool
            self.fs.put_file(str(spool), address)

    @contextlib.contextmanager
    def open(self, address: str, *, shared: bool = True) -> Iterator[BinaryIO]:
        with self.fs.open(address, "rb", block_size=BLOCK_SIZE) as handle:
            yield handle

    @contextlib.contextmanager
    def local(self, address: str) -> Iterator[Path]:
        with removing(self._spool(address)) as spool:
            self.fs.get_file(address, str(spool))
            yield spool

    def size(self, address: str) -> int:
        return int(self.fs.size(address))

    def exists(self, address: str) -> bool:
        return bool(self.fs.exists(address))

    def remove(self, address: str, *, keep_data: bool = False) -> None:
        if not keep_data:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(address)

    def sweep_stale(self) -> int:
        """Spool files of dead writers on this host (an upload either completed or never appeared)."""
        return sweep_temp_files(self.spool_dir.glob(f".*{TEMP_SUFFIX}")) if self.spool_dir.exists() else 0
