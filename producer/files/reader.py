"""Reading files: vLLM's reader protocol, plus validation.

Protocol (same as vLLM's ``load_hidden_states``): take the shared lock of
``producer.protocol.locking`` (it waits out a writer), then load.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

from producer.protocol import fp8
from producer.protocol.fileformat import (
    FileFormatError,
    check_checksums,
    read_file_header,
    verify_file,
)
from producer.protocol.locking import lock_path, shared_lock
from producer.protocol.naming import FILE_SUFFIX, storage_root_of


def load_hidden_states(
    path: str | Path,
    *,
    verify: bool = True,
    framework: Literal["pt", "np"] | None = None,
    device: str = "cpu",
    dequantize: bool = True,
) -> dict[str, Any]:
    """Load a job's tensors (``hidden_states``, ``token_ids``, ...) after the writer is done.

    With ``verify`` (default) shapes, dtypes and checksums are checked and a damaged file
    raises ``FileFormatError`` saying what is wrong (structure first; into the CPU with torch,
    the checksums on the loaded bytes, so that the file is read once). Without it the header
    is still checked: a damaged header raises ``FileFormatError`` either way. ``framework="np"``
    avoids torch (bfloat16 is widened to float32). Float8 states are returned as float32
    values (their ``_scale`` tensors consumed) unless ``dequantize=False``, which gives the
    stored tensors as they are (with numpy: raw uint8 codes).
    The default framework is ``"pt"`` where torch is installed and ``"np"`` where it is not
    (the client install).
    """
    if framework is None:
        framework = "pt" if importlib.util.find_spec("torch") is not None else "np"
    with shared_lock(path):
        in_place = verify and framework == "pt" and device == "cpu"  # checksums on the loaded bytes
        header = verify_file(path, checksums=not in_place) if verify else read_file_header(path)
        meta = header.metadata
        if framework == "pt":
            import torch
            from safetensors import SafetensorError
            from safetensors.torch import load_file as load_torch

            try:
                tensors = load_torch(str(path), device=device)
            except SafetensorError as exc:
                raise FileFormatError(f"{path}: {exc}") from None
            if in_place:
                check_checksums(path, meta, {name: tensor.reshape(-1).view(torch.uint8).numpy()
                                             for name, tensor in tensors.items()})
        else:
            tensors = {name: header.array(name) for name in header.tensors}
    return fp8.dequantize(tensors) if dequantize else tensors


def remove_emptied_folders(paths: Iterable[str | Path], run: str) -> int:
    """Remove the fan-out folders of ``paths`` (files of ``run`` already removed), then the run's
    folder, where each is left empty; returns how many went. Only folders of the file layout
    (``naming.job_path``: ``<root>/<run>/<fan-out>``) are touched, never the storage root."""
    fanouts = set()
    for path in map(Path, paths):
        if storage_root_of(path, run, path.name.removesuffix(FILE_SUFFIX)) is not None:
            fanouts.add(path.parent)
    removed = 0
    for folder in [*sorted(fanouts), *sorted({fanout.parent for fanout in fanouts})]:
        with contextlib.suppress(OSError):  # not empty (another file, a temp file), or gone
            folder.rmdir()
            removed += 1
    return removed


def cleanup_hidden_states(path: str | Path, *, keep_data: bool = False) -> None:
    """Remove a file's lock file and, unless ``keep_data``, the file itself (as vLLM's helper)."""
    for target in ([lock_path(path)] if keep_data else [lock_path(path), str(path)]):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(target)
