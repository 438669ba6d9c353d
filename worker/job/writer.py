"""Writing one job's file through its storage (``layertap.storage``), by the file-level protocol:

1. take the storage's writer lock of the file (local: exclusive ``flock`` on ``<file>.lock``;
   object stores: none, the object appears whole or not at all);
2. examine the file at its address, if any (``layertap.storage.examine``): one that verifies
   (structure, header and tensor checksums) and has the same ``content_id`` (another worker won a race, or a
   redelivered job) is kept and nothing is written; one that verifies but holds another job's
   content under this job id (another ``spec_hash``) is overwritten only for a job that says
   ``replace`` (else :class:`FileTaken`); a damaged one, or one computed with something else
   (layers, dtype, model weights, tokenizer, format version), is replaced;
3. else write the file to the local path :meth:`Storage.write` gives, which commits it whole
   (local: fsync, rename, fsync folder; object stores: upload to the final key).

A file at its address is therefore always complete, on every backend.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors.torch import save_file

from layertap.protocol.fileformat import MetaKey, sealed_metadata
from layertap.storage.base import Storage
from layertap.storage.examine import OnDisk, examine
from layertap.storage.registry import storage_at

log = logging.getLogger(__name__)


class FileTaken(Exception):
    """The job's final name holds a valid file of another job content (same run and job id)."""


def write_job_file(path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str],
                   storage: Storage | None = None, *, replace: bool = False) -> bool:
    """Write ``tensors`` to ``path`` in ``storage`` (by default the one its address names) by the
    protocol above (``metadata`` has the job's ``spec_hash`` and ``content_id``). Returns False if
    an equal file was kept; raises :class:`FileTaken` for a file of other job content there,
    which only ``replace`` (the job's own ``replace``) writes over."""
    storage, path = (storage_at(path) if storage is None else storage), str(path)
    tensors = {name: tensor.contiguous() for name, tensor in tensors.items()}
    metadata = sealed_metadata(metadata, {name: tensor.view(torch.uint8).numpy() for name, tensor in tensors.items()},
                               {name: list(tensor.shape) for name, tensor in tensors.items()})
    with storage.lock(path):
        existing = examine(path, metadata[MetaKey.SPEC_HASH], metadata[MetaKey.CONTENT_ID], storage)
        if existing.state is OnDisk.matches:
            return False
        if existing.state is OnDisk.taken and not replace:
            theirs = existing.header.metadata[MetaKey.SPEC_HASH]  # type: ignore[union-attr]
            raise FileTaken(f"{path} already holds job {metadata[MetaKey.JOB_ID]!r} of other content "
                            f"(spec_hash {theirs[:12]}..., this job's {metadata[MetaKey.SPEC_HASH][:12]}...)")
        if existing.state is OnDisk.damaged:
            log.warning("replacing a damaged file: %s", existing.reason)
        if existing.state is OnDisk.taken:
            log.info("replacing %s: its job asked for other content (replace)", path)
        with storage.write(path) as local:
            save_file(tensors, str(local), metadata=metadata)
    return True
