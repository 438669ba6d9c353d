"""The file format: tensor names, header metadata keys, checksums. Pure Python.

One safetensors file per job. Tensors (vLLM's first two, same names and shapes):

* ``hidden_states`` ``[T, n_layers, H]``; ``token_ids`` ``[T]`` int64;
* ``loss_mask`` ``[T]`` uint8 for chat jobs.

Header metadata (all strings): see :class:`MetaKey`. ``checksums`` is a JSON object
mapping each tensor name to the CRC-32 of its raw bytes, which are exactly the bytes of
that tensor's range in the file, so a reader verifies them without decoding dtypes.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path
from typing import Any, BinaryIO

FORMAT_NAME = "layertap"
FORMAT_VERSION = "1"

HIDDEN_STATES = "hidden_states"
TOKEN_IDS = "token_ids"
LOSS_MASK = "loss_mask"

#: The dtypes each tensor may have (safetensors dtype names).
ALLOWED_DTYPES: dict[str, set[str]] = {
    HIDDEN_STATES: {"BF16", "F16", "F32"},
    TOKEN_IDS: {"I64"},
    LOSS_MASK: {"U8"},
}
REQUIRED_TENSORS = (HIDDEN_STATES, TOKEN_IDS)
_CHUNK = 16 * 1024 * 1024
_MAX_HEADER = 100 * 1024 * 1024


class MetaKey:
    """Header metadata keys."""

    FORMAT = "format"
    FORMAT_VERSION = "format_version"
    MODEL = "model"
    MODEL_SOURCE = "model_source"
    MODEL_REVISION = "model_revision"
    LAYERS = "layers"  # JSON list of resolved layer ids, in file order
    LAYER_CONVENTION = "layer_convention"
    NUM_LAYERS = "num_hidden_layers"
    DTYPE = "dtype"
    TOKENIZER_FINGERPRINT = "tokenizer_fingerprint"
    JOB_ID = "job_id"
    RUN = "run"
    SPEC_HASH = "spec_hash"  # Job.spec_hash(): identifies inputs and options
    CHECKSUMS = "checksums"  # JSON {tensor name: crc32 hex}


class FileFormatError(ValueError):
    """A file that is not a complete, valid layertap file; the message says what is wrong."""


def crc32_hex(data: Any) -> str:
    """CRC-32 of a bytes-like object, as 8 hex digits (zlib releases the GIL on large buffers)."""
    return f"{zlib.crc32(data) & 0xFFFFFFFF:08x}"


def read_header(handle: BinaryIO, path: str | Path = "") -> tuple[dict[str, Any], int]:
    """Parse a safetensors header: ``(header, data_start)``. Raises :class:`FileFormatError`."""
    raw_len = handle.read(8)
    if len(raw_len) != 8:
        raise FileFormatError(f"{path}: file is shorter than a safetensors header (truncated?)")
    (header_len,) = struct.unpack("<Q", raw_len)
    if header_len > _MAX_HEADER:
        raise FileFormatError(f"{path}: header length {header_len} is implausible (corrupt file?)")
    raw = handle.read(header_len)
    if len(raw) != header_len:
        raise FileFormatError(f"{path}: header is truncated ({len(raw)} of {header_len} bytes)")
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FileFormatError(f"{path}: header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise FileFormatError(f"{path}: header is not a JSON object")
    return header, 8 + header_len


def metadata_of(path: str | Path) -> dict[str, str]:
    """The header metadata of a file, without loading any tensor."""
    with open(path, "rb") as handle:
        header, _ = read_header(handle, path)
    return dict(header.get("__metadata__") or {})


def verify_file(path: str | Path) -> dict[str, str]:
    """Check a file's structure, tensor shapes/dtypes and checksums; return its metadata.

    Raises :class:`FileFormatError` naming the first problem found.
    """
    path = Path(path)
    with open(path, "rb") as handle:
        header, data_start = read_header(handle, path)
        meta = dict(header.pop("__metadata__", None) or {})
        if meta.get(MetaKey.FORMAT) != FORMAT_NAME:
            raise FileFormatError(f"{path}: not a layertap file (header metadata has no format={FORMAT_NAME!r})")
        _check_shapes(path, header, meta)
        file_size = path.stat().st_size
        try:
            checksums = json.loads(meta.get(MetaKey.CHECKSUMS, ""))
        except json.JSONDecodeError:
            raise FileFormatError(f"{path}: header metadata 'checksums' is not valid JSON") from None
        for name, info in header.items():
            begin, end = info["data_offsets"]
            if data_start + end > file_size:
                raise FileFormatError(
                    f"{path}: tensor {name!r} ends at byte {data_start + end} but the file has "
                    f"{file_size} bytes (truncated)"
                )
            expected = checksums.get(name)
            if expected is None:
                raise FileFormatError(f"{path}: no checksum recorded for tensor {name!r}")
            handle.seek(data_start + begin)
            crc, left = 0, end - begin
            while left:
                chunk = handle.read(min(_CHUNK, left))
                if not chunk:
                    raise FileFormatError(f"{path}: tensor {name!r} is truncated")
                crc = zlib.crc32(chunk, crc)
                left -= len(chunk)
            if f"{crc & 0xFFFFFFFF:08x}" != expected:
                raise FileFormatError(
                    f"{path}: checksum mismatch in tensor {name!r} (expected {expected}, "
                    f"found {crc & 0xFFFFFFFF:08x}): the file is corrupt"
                )
    return meta


def _check_shapes(path: Path, header: dict[str, Any], meta: dict[str, str]) -> None:
    for name in REQUIRED_TENSORS:
        if name not in header:
            raise FileFormatError(f"{path}: tensor {name!r} is missing")
    for name, allowed in ALLOWED_DTYPES.items():
        if name in header and header[name]["dtype"] not in allowed:
            raise FileFormatError(
                f"{path}: tensor {name!r} has dtype {header[name]['dtype']}, expected one of {sorted(allowed)}"
            )
    hidden = header[HIDDEN_STATES]["shape"]
    tokens = header[TOKEN_IDS]["shape"]
    if len(hidden) != 3:
        raise FileFormatError(f"{path}: hidden_states has shape {hidden}, expected [tokens, layers, hidden]")
    if len(tokens) != 1 or tokens[0] != hidden[0]:
        raise FileFormatError(f"{path}: token_ids has shape {tokens} but hidden_states has {hidden[0]} tokens")
    layers = json.loads(meta.get(MetaKey.LAYERS, "null") or "null")
    if isinstance(layers, list) and len(layers) != hidden[1]:
        raise FileFormatError(
            f"{path}: header lists {len(layers)} layers {layers} but hidden_states has {hidden[1]}"
        )
    for name, info in header.items():
        if name in (HIDDEN_STATES, TOKEN_IDS):
            continue
        shape = info["shape"]
        if not shape or shape[0] != hidden[0]:
            raise FileFormatError(f"{path}: tensor {name!r} has shape {shape}, expected {hidden[0]} tokens first")
