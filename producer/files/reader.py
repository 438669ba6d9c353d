"""Reading files: vLLM's reader protocol, plus validation, from any storage (``layertap.storage``).

Protocol (same as vLLM's ``load_hidden_states``): take the shared lock of the local lock
protocol (it waits out a writer), then load; from an object store the object is whole once it
exists, so it is read as it is. A path or URL names the storage (``s3://bucket/...``).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Literal

from layertap.protocol import fp8
from layertap.protocol.fileformat import (
    FileFormatError,
    check_checksums,
    check_vllm_file,
    is_vllm_file,
    read_file_header,
    verify_file,
)
from layertap.storage.registry import storage_at


def load_hidden_states(
    path: str | Path,
    *,
    verify: bool = True,
    framework: Literal["pt", "np"] | None = None,
    device: str = "cpu",
    dequantize: bool = True,
    storage_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Load a job's tensors (``hidden_states``, ``token_ids``, ...) after the writer is done.

    ``path`` is a local path or a URL (``s3://bucket/prefix/run/abc/job.safetensors``; its
    fsspec options in ``storage_options``, else the standard places). With ``verify`` (default)
    shapes, dtypes and checksums are checked and a damaged file
    raises ``FileFormatError`` saying what is wrong (structure first; into the CPU with torch,
    the checksums on the loaded bytes, so that the file is read once). Without it the header
    is still checked: a damaged header raises ``FileFormatError`` either way. ``framework="np"``
    avoids torch (bfloat16 is widened to float32). Float8 states are returned as float32
    values (their ``_scale`` tensors consumed) unless ``dequantize=False``, which gives the
    stored tensors as they are (with numpy: raw uint8 codes).
    The default framework is ``"pt"`` where torch is installed and ``"np"`` where it is not
    (the client install). A file vLLM wrote (``fileformat.is_vllm_file``: no header metadata,
    only ``hidden_states`` and ``token_ids``) has no checksums: ``verify`` checks its dtypes and
    shapes (``fileformat.check_vllm_file``) and nothing of its bytes.
    """
    if framework is None:
        framework = "pt" if importlib.util.find_spec("torch") is not None else "np"
    with storage_at(path, storage_options).local(str(path)) as local:
        header = read_file_header(local, name=path)
        vllm = is_vllm_file(header)
        in_place = verify and not vllm and framework == "pt" and device == "cpu"  # checksums on the loaded bytes
        if verify and vllm:
            check_vllm_file(header, path)
        elif verify:
            header = verify_file(local, checksums=not in_place, name=path)
        meta = header.metadata
        if framework == "pt":
            import torch
            from safetensors import SafetensorError
            from safetensors.torch import load_file as load_torch

            try:
                tensors = load_torch(str(local), device=device)
            except SafetensorError as exc:
                raise FileFormatError(f"{path}: {exc}") from None
            if in_place:
                check_checksums(path, meta, {name: tensor.reshape(-1).view(torch.uint8).numpy()
                                             for name, tensor in tensors.items()})
        else:
            tensors = {name: header.array(name) for name in header.tensors}
    return fp8.dequantize(tensors) if dequantize else tensors


def cleanup_hidden_states(path: str | Path, *, keep_data: bool = False,
                          storage_options: dict[str, Any] | None = None) -> None:
    """Remove a file's lock file and, unless ``keep_data``, the file itself (as vLLM's helper)."""
    storage_at(path, storage_options).remove(str(path), keep_data=keep_data)
