"""What ``layertap inspect`` shows: shapes, dtypes, metadata and per-layer statistics,
read with numpy alone (bfloat16 is widened to float32 bit-exactly), so it needs no torch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from layertap.protocol.fileformat import (
    HIDDEN_STATES,
    SCALE_SUFFIX,
    FileHeader,
    MetaKey,
    check_vllm_file,
    is_vllm_file,
    read_file_header,
    verify_file,
)
from layertap.protocol.fp8 import dequantize_array
from layertap.storage.registry import storage_at


def describe_file(path: str | Path, verify: bool = True) -> dict[str, Any]:
    """A JSON-ready description of one file (a path or URL); ``verify`` checks a layertap file whole,
    a file vLLM wrote as far as it can be (``fileformat.check_vllm_file``: it has no checksums)."""
    storage = storage_at(path)
    with storage.local(str(path)) as local:
        header = read_file_header(local, name=path)
        if verify and is_vllm_file(header):
            check_vllm_file(header, path)
        elif verify:
            verify_file(local, name=path)
        meta = header.metadata
        tensors = {name: {"shape": info["shape"], "dtype": info["dtype"]} for name, info in header.tensors.items()}
        layers = json.loads(meta.get(MetaKey.LAYERS, "[]"))
        stats = []
        if HIDDEN_STATES in header.tensors:
            hidden = hidden_states_float32(header)
            for slot, layer_id in enumerate(layers or range(hidden.shape[1])):
                values = hidden[:, slot, :]
                norms = np.linalg.norm(values, axis=-1)
                stats.append({"layer": layer_id, "mean": float(values.mean()), "std": float(values.std()),
                              "min": float(values.min()), "max": float(values.max()),
                              "mean_token_norm": float(norms.mean()), "finite": bool(np.isfinite(values).all())})
    return {"path": str(path), "bytes": storage.size(str(path)), "tensors": tensors, "metadata": meta,
            "layer_stats": stats}


def hidden_states_float32(header: FileHeader) -> np.ndarray:
    """A file's ``hidden_states`` as float32 (float8 files decoded with their scales)."""
    hidden = header.array(HIDDEN_STATES)
    scale = HIDDEN_STATES + SCALE_SUFFIX
    if scale in header.tensors:
        hidden = dequantize_array(hidden, header.array(scale))
    return hidden.astype(np.float32)


def read_hidden_states(path: str | Path) -> tuple[list[int], np.ndarray]:
    """``(layer ids, hidden_states as float32 [T, num_layers, H])`` of a file, under its shared lock."""
    with storage_at(path).local(str(path)) as local:
        header = read_file_header(local, name=path)
        if HIDDEN_STATES not in header.tensors:
            raise ValueError(f"{path} has no {HIDDEN_STATES} tensor")
        hidden = hidden_states_float32(header)
    layers = json.loads(header.metadata.get(MetaKey.LAYERS, "[]"))
    return (layers or list(range(hidden.shape[1]))), hidden


def token_norms(hidden: np.ndarray) -> np.ndarray:
    """L2 norm of each token's state in each layer: ``[num_layers, T]`` from ``[T, num_layers, H]``."""
    return np.linalg.norm(hidden, axis=-1).T


def layer_cosine_similarity(hidden: np.ndarray) -> np.ndarray:
    """``[num_layers, num_layers]``: mean over tokens of the cosine between two layers' states."""
    norms = np.linalg.norm(hidden, axis=-1, keepdims=True)
    unit = hidden / np.maximum(norms, np.finfo(np.float32).tiny)
    return np.einsum("tih,tjh->ij", unit, unit) / hidden.shape[0]
