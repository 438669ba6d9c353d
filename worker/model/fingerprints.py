"""Fingerprints of what a model was loaded from, recorded in every file's header: its tokenizer
(vocabulary, rules, chat template), its checkpoint's files (read in about a second whatever
their size) or, for a model built in memory, its parameters."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any

import torch
from torch import nn


def tokenizer_fingerprint(tokenizer: Any | None) -> str:
    """Short hash of the tokenizer's vocabulary/rules and chat template ('' without a tokenizer)."""
    if tokenizer is None:
        return ""
    digest = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    digest.update((backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items()))).encode())
    digest.update(str(getattr(tokenizer, "chat_template", None) or "").encode())
    return digest.hexdigest()[:16]


#: Bytes read at each sample point of a large file: the start of every tensor's data (safetensors)
#: and the start, middle and end of the file's data.
FINGERPRINT_SAMPLE = 4096
#: Files up to this size (config, tokenizer, remote code) are hashed whole.
FINGERPRINT_WHOLE = 1 << 20
#: Largest safetensors header hashed and parsed (a real checkpoint's is well under 1 MiB).
FINGERPRINT_MAX_HEADER = 16 * 1024 * 1024
#: Values sampled from each parameter of a model built in memory (no checkpoint folder).
FINGERPRINT_VALUES = 256


def weights_fingerprint(folder: Path) -> str:
    """A short hash of the checkpoint in ``folder`` that changes when it is rewritten, read in
    about a second whatever its size: for each regular file at its top level (links followed,
    hidden files left out), its name and size; small files (config, tokenizer, code) whole;
    of a large one its safetensors header (tensor names, dtypes, shapes, offsets) and
    :data:`FINGERPRINT_SAMPLE` bytes at the start of each tensor's data and at the start,
    middle and end of the file. Contents only, no times: copies of one checkpoint on several
    hosts agree. A rewrite that keeps the header and every sampled byte is not seen."""
    digest = hashlib.sha256()
    for file in sorted(folder.iterdir()):
        if file.name.startswith(".") or not file.is_file():
            continue
        size = file.stat().st_size
        digest.update(f"{file.name}\0{size}\0".encode())
        with open(file, "rb") as handle:
            if size <= FINGERPRINT_WHOLE:
                digest.update(handle.read())
                continue
            header, offsets = _safetensors_layout(handle, size) if file.suffix == ".safetensors" else (b"", [])
            digest.update(header)
            data_start = 8 + len(header) if header else 0
            offsets += [data_start, (data_start + size) // 2, max(data_start, size - FINGERPRINT_SAMPLE)]
            for offset in sorted(set(offsets)):
                handle.seek(offset)
                digest.update(handle.read(FINGERPRINT_SAMPLE))
    return digest.hexdigest()[:16]


def _safetensors_layout(handle: Any, size: int) -> tuple[bytes, list[int]]:
    """A safetensors file's raw header and the file offset where each tensor's data starts
    (``(b"", [])`` for a file whose header does not parse: it is sampled as any file)."""
    (header_len,) = struct.unpack("<Q", handle.read(8))
    if header_len > min(FINGERPRINT_MAX_HEADER, size - 8):
        return b"", []
    raw = handle.read(header_len)
    try:
        entries = json.loads(raw)
        starts = [8 + header_len + int(entry["data_offsets"][0]) for name, entry in entries.items()
                  if name != "__metadata__"]
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return raw, []
    return raw, [start for start in starts if start < size]


def parameters_fingerprint(model: nn.Module) -> str:
    """A short hash of a model built in memory: each parameter's and buffer's name, dtype and
    shape, and :data:`FINGERPRINT_VALUES` of its values spread over it (no full read)."""
    digest = hashlib.sha256()
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        flat = tensor.detach().reshape(-1)
        step = max(1, flat.numel() // FINGERPRINT_VALUES)
        sample = flat[::step][:FINGERPRINT_VALUES].to("cpu", torch.float32)
        digest.update(f"{name}\0{tensor.dtype}\0{list(tensor.shape)}\0".encode())
        digest.update(sample.numpy().tobytes())
    return digest.hexdigest()[:16]
