"""Reading files: vLLM's reader protocol, plus validation.

Protocol (same as vLLM's ``load_hidden_states``): open ``<path>.lock`` and take a
*shared* ``flock`` on it, which sleeps while a writer holds the exclusive lock; then
load. A file whose lock file was removed (``cleanup_hidden_states``) loads directly:
files only ever appear at their final name complete (temp file + atomic rename).
``fcntl.flock`` is used directly because the protocol is defined by flock semantics
(filelock has no shared mode).
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from producer.protocol import fp8
from producer.protocol.fileformat import (
    check_checksums,
    read_array,
    read_header,
    verify_file,
)
from producer.protocol.naming import LOCK_SUFFIX


@contextlib.contextmanager
def shared_lock(path: str | Path) -> Iterator[None]:
    """Hold a shared flock on ``<path>.lock`` if it exists (blocks while a writer holds it)."""
    try:
        fd = os.open(f"{path}{LOCK_SUFFIX}", os.O_RDONLY)
    except FileNotFoundError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)  # closing releases the lock


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
    the checksums on the loaded bytes, so that the file is read once). ``framework="np"``
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
        if verify:
            meta = verify_file(path, checksums=not in_place)
        if framework == "pt":
            import torch
            from safetensors.torch import load_file as load_torch

            tensors = load_torch(str(path), device=device)
            if in_place:
                check_checksums(path, meta, {name: tensor.reshape(-1).view(torch.uint8).numpy()
                                             for name, tensor in tensors.items()})
        else:
            with open(path, "rb") as handle:
                header, data_start = read_header(handle, path)
            header.pop("__metadata__", None)
            tensors = {name: read_array(path, header, data_start, name) for name in header}
    return fp8.dequantize(tensors) if dequantize else tensors


def cleanup_hidden_states(path: str | Path, *, keep_data: bool = False) -> None:
    """Remove a file's lock file and, unless ``keep_data``, the file itself (as vLLM's helper)."""
    for target in ([f"{path}{LOCK_SUFFIX}"] if keep_data else [f"{path}{LOCK_SUFFIX}", str(path)]):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(target)
