"""The file format: tensor names, header metadata keys, checksums. Pure Python.

One safetensors file per job. Tensors (vLLM's first two, same names and shapes):

* ``hidden_states`` ``[T, n_layers, H]``; ``token_ids`` ``[T]`` int64;
* ``loss_mask`` ``[T]`` uint8 for chat jobs;
* ``final_hidden_states`` ``[T, H]`` when asked (after the final norm);
* ``topk_logprobs`` ``[T, k]`` float32 and ``topk_ids`` ``[T, k]`` int32 when asked; rows
  not computed hold ``-inf`` and ``-1``;
* a float8 (``F8_E4M3``) state tensor ``X`` comes with ``X_scale`` (float32, ``X``'s shape
  without the last dimension): the value is ``X.float() * X_scale[..., None]``.

Header metadata (all strings): see :class:`MetaKey`. ``checksums`` is a JSON object
mapping each tensor name to the CRC-32 of its raw bytes, which are exactly the bytes of
that tensor's range in the file, so a reader verifies them without decoding dtypes.
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

FORMAT_NAME = "layertap"
FORMAT_VERSION = "1"

HIDDEN_STATES = "hidden_states"
TOKEN_IDS = "token_ids"
LOSS_MASK = "loss_mask"
FINAL_HIDDEN_STATES = "final_hidden_states"
TOPK_LOGPROBS = "topk_logprobs"
TOPK_IDS = "topk_ids"
SCALE_SUFFIX = "_scale"
FLOAT8 = "F8_E4M3"

#: Tensors that may be stored as float8 with a per-row scale tensor ``<name>_scale``.
STATE_TENSORS = (HIDDEN_STATES, FINAL_HIDDEN_STATES)
_STATE_DTYPES = {"BF16", "F16", "F32", FLOAT8}

#: The dtypes each tensor may have (safetensors dtype names).
ALLOWED_DTYPES: dict[str, set[str]] = {
    HIDDEN_STATES: _STATE_DTYPES,
    FINAL_HIDDEN_STATES: _STATE_DTYPES,
    HIDDEN_STATES + SCALE_SUFFIX: {"F32"},
    FINAL_HIDDEN_STATES + SCALE_SUFFIX: {"F32"},
    TOKEN_IDS: {"I64"},
    LOSS_MASK: {"U8"},
    TOPK_LOGPROBS: {"F32"},
    TOPK_IDS: {"I32"},
}
REQUIRED_TENSORS = (HIDDEN_STATES, TOKEN_IDS)
#: numpy views of safetensors dtypes: bfloat16 is read as uint16 and widened, float8 stays raw codes.
_NUMPY_DTYPES = {"F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32, "U8": np.uint8,
                 "BF16": np.uint16, FLOAT8: np.uint8}
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
    DTYPE = "dtype"  # of the stored states (``dtypes.RECORDED_NAMES`` values)
    COMPUTE_DTYPE = "compute_dtype"  # the model's dtype in the forward
    BATCHING = "batching"  # how the worker batched jobs: a layout's name (worker.model.batching.LAYOUTS)
    RESIDUAL_COPIES = "residual_copies"  # copies per token of a multi-copy stream: hidden_states [T, L, copies, H]
    ARCHITECTURE = "architecture"  # the transformers class that computed the states
    LOSS_ON = "loss_on"  # chats: "all" | "last"
    TOPK = "topk"  # k of topk_logprobs/topk_ids, when stored
    TOPK_ON = "topk_on"  # "mask" | "all"
    TOKENIZER_FINGERPRINT = "tokenizer_fingerprint"
    JOB_ID = "job_id"
    JOB_METADATA = "job_metadata"  # the job's ``metadata`` string, when it has one
    RUN = "run"
    SPEC_HASH = "spec_hash"  # Job.spec_hash(): identifies inputs and options
    CHECKSUMS = "checksums"  # JSON {tensor name: crc32 hex}


class FileFormatError(ValueError):
    """A file that is not a complete, valid layertap file; the message says what is wrong."""


def crc32_hex(data: Any) -> str:
    """CRC-32 of a bytes-like object, as 8 hex digits (zlib releases the GIL on large buffers)."""
    return f"{zlib.crc32(data) & 0xFFFFFFFF:08x}"


@dataclass(frozen=True)
class FileHeader:
    """A safetensors header in its parts: ``tensors`` (name -> ``dtype``, ``shape``,
    ``data_offsets``; no ``__metadata__`` entry), the string ``metadata``, and ``data_start``,
    the byte offset where tensor data begins. The one reader of headers in layertap."""

    path: Path
    tensors: dict[str, dict[str, Any]]
    metadata: dict[str, str]
    data_start: int

    def array(self, name: str) -> np.ndarray:
        """One tensor as a numpy array, without torch: bfloat16 widened to float32 (exactly),
        float8 as its raw uint8 codes (``producer.protocol.fp8`` decodes them)."""
        info = self.tensors[name]
        begin, end = info["data_offsets"]
        raw = np.fromfile(self.path, dtype=np.uint8, count=end - begin, offset=self.data_start + begin)
        array = raw.view(_NUMPY_DTYPES[info["dtype"]]).reshape(info["shape"])
        if info["dtype"] == "BF16":
            array = (array.astype(np.uint32) << 16).view(np.float32)
        return array


def read_file_header(path: str | Path) -> FileHeader:
    """The header of the file at ``path``. Raises :class:`FileFormatError` or ``OSError``."""
    with open(path, "rb") as handle:
        return parse_header(handle, path)


def parse_header(handle: BinaryIO, path: str | Path = "") -> FileHeader:
    """Parse the safetensors header at the start of ``handle``. Raises :class:`FileFormatError`."""
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
    metadata = header.pop("__metadata__", None) or {}
    return FileHeader(Path(path), header, dict(metadata), 8 + header_len)


def metadata_of(path: str | Path) -> dict[str, str]:
    """The header metadata of a file, without loading any tensor."""
    return read_file_header(path).metadata


def verify_file(path: str | Path, *, checksums: bool = True) -> FileHeader:
    """Check a file's structure, tensor shapes/dtypes and checksums; return its header.

    Raises :class:`FileFormatError` naming the first problem found. ``checksums=False`` checks
    everything but the tensors' bytes, for a reader that loads them anyway and checks them there
    (:func:`check_checksums`), reading the file once instead of twice.
    """
    path = Path(path)
    with open(path, "rb") as handle:
        parsed = parse_header(handle, path)
        header, meta, data_start = parsed.tensors, parsed.metadata, parsed.data_start
        if meta.get(MetaKey.FORMAT) != FORMAT_NAME:
            raise FileFormatError(f"{path}: not a layertap file (header metadata has no format={FORMAT_NAME!r})")
        _check_shapes(path, header, meta)
        file_size = path.stat().st_size
        recorded = _recorded_checksums(path, meta)
        for name, info in header.items():
            begin, end = info["data_offsets"]
            if data_start + end > file_size:
                raise FileFormatError(
                    f"{path}: tensor {name!r} ends at byte {data_start + end} but the file has "
                    f"{file_size} bytes (truncated)"
                )
            expected = recorded.get(name)
            if expected is None:
                raise FileFormatError(f"{path}: no checksum recorded for tensor {name!r}")
            if not checksums:
                continue
            handle.seek(data_start + begin)
            crc, left = 0, end - begin
            while left:
                chunk = handle.read(min(_CHUNK, left))
                if not chunk:
                    raise FileFormatError(f"{path}: tensor {name!r} is truncated")
                crc = zlib.crc32(chunk, crc)
                left -= len(chunk)
            _check_crc(path, name, expected, crc)
    return parsed


def check_checksums(path: str | Path, meta: dict[str, str], tensor_bytes: dict[str, Any]) -> None:
    """Check each loaded tensor's bytes (a buffer: ``{name: uint8 array}``) against the checksum
    that ``meta`` (from :func:`verify_file`) records for it; raises :class:`FileFormatError`."""
    recorded = _recorded_checksums(Path(path), meta)
    for name, data in tensor_bytes.items():
        _check_crc(Path(path), name, recorded.get(name, ""), zlib.crc32(data))


def _recorded_checksums(path: Path, meta: dict[str, str]) -> dict[str, str]:
    try:
        return json.loads(meta.get(MetaKey.CHECKSUMS, ""))
    except json.JSONDecodeError:
        raise FileFormatError(f"{path}: header metadata 'checksums' is not valid JSON") from None


def _check_crc(path: Path, name: str, expected: str, crc: int) -> None:
    if f"{crc & 0xFFFFFFFF:08x}" != expected:
        raise FileFormatError(
            f"{path}: checksum mismatch in tensor {name!r} (expected {expected}, "
            f"found {crc & 0xFFFFFFFF:08x}): the file is corrupt"
        )


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
    copies = meta.get(MetaKey.RESIDUAL_COPIES)
    if [len(hidden), hidden[2:3]] != ([4, [int(copies)]] if copies else [3, hidden[2:3]]):
        raise FileFormatError(f"{path}: hidden_states has shape {hidden}, expected [tokens, layers, "
                              f"{f'{copies} copies, ' if copies else ''}hidden]")
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
    expected = {LOSS_MASK: hidden[:1], FINAL_HIDDEN_STATES: [hidden[0], hidden[-1]]}
    for name, shape in expected.items():
        if name in header and header[name]["shape"] != shape:
            raise FileFormatError(f"{path}: tensor {name!r} has shape {header[name]['shape']}, expected {shape}")
    _check_scales(path, header)
    _check_topk(path, header)


def _check_scales(path: Path, header: dict[str, Any]) -> None:
    """A float8 state tensor has a float32 scale per row; other tensors have none."""
    for name in STATE_TENSORS:
        scale = name + SCALE_SUFFIX
        quantized = name in header and header[name]["dtype"] == FLOAT8
        if quantized and scale not in header:
            raise FileFormatError(f"{path}: tensor {name!r} is float8 but its scale {scale!r} is missing")
        if not quantized and scale in header:
            raise FileFormatError(f"{path}: tensor {scale!r} is present but {name!r} is not float8")
        if quantized and header[scale]["shape"] != header[name]["shape"][:-1]:
            raise FileFormatError(f"{path}: tensor {scale!r} has shape {header[scale]['shape']}, expected "
                                  f"{header[name]['shape'][:-1]} (one scale per row of {name!r})")


def _check_topk(path: Path, header: dict[str, Any]) -> None:
    """``topk_logprobs`` and ``topk_ids`` come together, both ``[T, k]``."""
    present = [name for name in (TOPK_LOGPROBS, TOPK_IDS) if name in header]
    if len(present) == 1:
        raise FileFormatError(f"{path}: tensor {present[0]!r} is present without its pair")
    if present:
        logprobs, ids = header[TOPK_LOGPROBS]["shape"], header[TOPK_IDS]["shape"]
        if len(logprobs) != 2 or logprobs != ids:
            raise FileFormatError(f"{path}: topk_logprobs {logprobs} and topk_ids {ids} must both be [tokens, k]")
