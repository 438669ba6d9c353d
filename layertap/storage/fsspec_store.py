"""Job files through fsspec: object stores (``s3://`` with s3fs, ``gs://`` with gcsfs, ``az://``
with adlfs; the ``[s3]`` extra brings s3fs) and any other fsspec protocol as ``fsspec+<url>``
(``fsspec+sftp://host/dir``, ``fsspec+file:///mnt/share``: ``registry.backend_url``).

A writer's file is spooled to local disk (``spool_dir`` option, else the temp folder) and
committed to its final name whole or not at all, on every protocol:

* an object store (:data:`OBJECT_STORES`) uploads it to its final key: an object appears whole
  (a ``PUT``, or a multipart upload completed), so readers never see a partial object;
* any other protocol (a file system, where a copy writes in place) uploads it to a temp name
  beside the final one, ``.<name>.<host>-<pid>.<random>.tmp`` as ``local``'s, and moves it over
  the final name; a failed upload removes its temp file, a killed writer's is swept at start.

:meth:`FsspecStorage.lock` holds nothing: two workers writing one job commit equal content (its
``content_id``); the last wins. Readers read byte ranges (headers, checksums) or download to a
spool file (:meth:`FsspecStorage.local`).

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
from layertap.storage.local import HOST_TAG, TEMP_SUFFIX, is_stale_temp, sweep_temp_files, temp_name
from layertap.storage.registry import backend_url

#: Bytes per ranged read of an object (checksums read whole tensors in 16 MiB chunks).
BLOCK_SIZE = 16 << 20
#: fsspec protocols of object stores, where an upload to the final key appears whole or not at all.
OBJECT_STORES = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl"}


class FsspecStorage(Storage):
    """Files under an fsspec URL root; ``spool_dir`` (an option) is where they are staged locally."""

    def __init__(self, root: str | Path, options: dict[str, Any] | None = None):
        super().__init__(str(root).rstrip("/"), options)
        fs_options = dict(self.options)
        self.spool_dir = Path(fs_options.pop("spool_dir", None) or Path(tempfile.gettempdir()) / "layertap-spool")
        self.fs, _ = fsspec.core.url_to_fs(backend_url(self.root)[1], **fs_options)
        protocols = {self.fs.protocol} if isinstance(self.fs.protocol, str) else set(self.fs.protocol)
        self.object_store = bool(protocols & OBJECT_STORES)

    @staticmethod
    def _url(address: str) -> str:
        """``address`` as fsspec opens it (without a ``fsspec+`` backend prefix)."""
        return backend_url(address)[1]

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
            self._commit(spool, self._url(address))

    def _commit(self, spool: Path, url: str) -> None:
        """Put ``spool`` at ``url`` whole or not at all (module doc)."""
        if self.object_store:
            self.fs.put_file(str(spool), url)
            return
        parent, _, name = url.rpartition("/")
        temp = f"{parent}/{temp_name(Path(name)).name}"
        self.fs.makedirs(parent, exist_ok=True)
        try:
            self.fs.put_file(str(spool), temp)
            self.fs.mv(temp, url)
        except BaseException:
            with contextlib.suppress(Exception):
                self.fs.rm_file(temp)
            raise

    @contextlib.contextmanager
    def open(self, address: str, *, shared: bool = True) -> Iterator[BinaryIO]:
        with self.fs.open(self._url(address), "rb", block_size=BLOCK_SIZE) as handle:
            yield handle

    @contextlib.contextmanager
    def local(self, address: str) -> Iterator[Path]:
        with removing(self._spool(address)) as spool:
            self.fs.get_file(self._url(address), str(spool))
            yield spool

    def size(self, address: str) -> int:
        return int(self.fs.size(self._url(address)))

    def exists(self, address: str) -> bool:
        return bool(self.fs.exists(self._url(address)))

    def remove(self, address: str, *, keep_data: bool = False) -> None:
        if not keep_data:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(self._url(address))

    def sweep_stale(self) -> int:
        """Spool files of dead writers on this host, and on a file system their temp files beside
        the final names (an object upload either completed or never appeared)."""
        removed = sweep_temp_files(self.spool_dir.glob(f".*{TEMP_SUFFIX}")) if self.spool_dir.exists() else 0
        if self.object_store:
            return removed
        for temp in self.fs.glob(f"{self._url(self.root)}/*/*/.*{TEMP_SUFFIX}"):
            if is_stale_temp(temp.rsplit("/", 1)[-1], lambda temp=temp: self.fs.modified(temp).timestamp()):
                with contextlib.suppress(FileNotFoundError):
                    self.fs.rm_file(temp)
                    removed += 1
        return removed
