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

Format version 2 adds ``weights_fingerprint``, ``content_id`` and ``header_checksum``:

* ``content_id`` is :func:`content_id` of the header's :data:`IDENTITY_KEYS`: everything that
  decides the file's bytes (the job's own fields through ``spec_hash``, the resolved layers,
  stored and compute dtype, the model's source, revision and weights fingerprint, a quantized
  checkpoint's scheme and compute path, the tokenizer and chat template, the format version, and
  the fixes since that changed the model's files, where it has any). A worker answers a job from an existing file only
  when the file's ``content_id`` is the one it would write now.
* ``header_checksum`` is the CRC-32 of the canonical JSON of the other metadata and the tensor
  shapes (:func:`header_checksum`): one changed character anywhere in them is found.

A file vLLM's hidden-states connector wrote (:func:`is_vllm_file`: no header metadata, exactly
``hidden_states`` and ``token_ids``) records no checksums, layers or model: :func:`check_vllm_file`
checks what can be checked of it (dtypes, shapes, the token count).

Every problem with a header (not JSON, missing or mistyped entries, a checksum that does not
match, JSON nested deeper or holding more arrays and objects than a layertap header can, a size
or offset past the file's end, a length larger than the file) raises :class:`FileFormatError`,
and the bounds are checked before the JSON is parsed or a size multiplied out; version 1 files
(no identity, no header checksum) are still read.
"""

from __future__ import annotations

import json
import queue
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from layertap.protocol.crc import crc32_of
from layertap.protocol.dtypes import STORED_AS
from layertap.protocol.naming import canonical_json, content_hash

FORMAT_NAME = "layertap"
FORMAT_VERSION = "2"

HIDDEN_STATES = "hidden_states"
TOKEN_IDS = "token_ids"
LOSS_MASK = "loss_mask"
IMAGE_TOKEN_MASK = "image_token_mask"  # [T] uint8, 1 at image positions (files of chats with images only)
FINAL_HIDDEN_STATES = "final_hidden_states"
TOPK_LOGPROBS = "topk_logprobs"
TOPK_IDS = "topk_ids"
SCALE_SUFFIX = "_scale"
FLOAT8 = STORED_AS["float8_e4m3"]

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
    IMAGE_TOKEN_MASK: {"U8"},
    TOPK_LOGPROBS: {"F32"},
    TOPK_IDS: {"I32"},
}
REQUIRED_TENSORS = (HIDDEN_STATES, TOKEN_IDS)
#: The safetensors dtypes of ``hidden_states`` in a file vLLM wrote (the model's dtype).
VLLM_STATE_DTYPES = {"BF16", "F16", "F32"}
#: numpy views of safetensors dtypes: bfloat16 is read as uint16 and widened, float8 stays raw codes.
_NUMPY_DTYPES = {"F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32, "U8": np.uint8,
                 "BF16": np.uint16, FLOAT8: np.uint8}
#: Bytes per element of each safetensors dtype name (a header naming another is refused).
_ITEM_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4,
               "U16": 2, "U8": 1, "BOOL": 1, FLOAT8: 1, "F8_E5M2": 1}
#: Bytes read and checksummed at a time, into a reused block (:func:`_block`) that stays in a
#: core's cache between the read and the CRC.
READ_BLOCK = 1 << 20
#: Read blocks not in use: one is taken per file being checked and given back, so there are as
#: many as files were ever checked at once.
_FREE_BLOCKS: queue.SimpleQueue[memoryview] = queue.SimpleQueue()
_MAX_HEADER = 100 * 1024 * 1024
#: A header is an object of tensor entries (each an object with two lists) and string metadata: 3
#: levels, 3 arrays and objects per tensor; the JSON in its metadata strings (layers, checksums) 1 level.
_MAX_JSON_DEPTH = 8
_MAX_JSON_BRACKETS = 8192
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
#: Digits of a decimal metadata value (``num_hidden_layers``, ``topk``, ``residual_copies``, ``format_version``).
_MAX_DIGITS = 18


#: What a file takes beyond its tensors, for :func:`file_bytes`: its header (metadata, checksums and
#: tensor entries: about 2 KB) and the rest of its last 4 KiB block, rounded up.
HEADER_ALLOWANCE = 4096


def file_bytes(tokens: int, layers: int, hidden_size: int, dtype: str, *, copies: int = 1, loss_mask: bool = False,
               final_hidden_states: bool = False, topk: int = 0) -> int:
    """The bytes of a file of ``tokens`` tokens and ``layers`` layers (``copies`` residual copies
    each) of ``hidden_size``, states stored as ``dtype`` (a recorded name,
    ``dtypes.RECORDED_NAMES``), with the tensors asked (the table above, float8 scales included),
    plus :data:`HEADER_ALLOWANCE`: a job's file on disk, known before it runs."""
    state = state_item_size(dtype)
    scale = _item_size(HIDDEN_STATES + SCALE_SUFFIX) if STORED_AS[dtype] == FLOAT8 else 0
    row = hidden_size * state + scale  # one state row: hidden_size values and a float8 row's scale
    per_token = layers * copies * row + _item_size(TOKEN_IDS)
    per_token += _item_size(LOSS_MASK) if loss_mask else 0
    per_token += row if final_hidden_states else 0
    per_token += topk * (_item_size(TOPK_LOGPROBS) + _item_size(TOPK_IDS))
    return tokens * per_token + HEADER_ALLOWANCE


def state_item_size(dtype: str) -> int:
    """Bytes per value of the state tensors stored as ``dtype`` (a recorded name)."""
    return _ITEM_SIZES[STORED_AS[dtype]]


def _item_size(name: str) -> int:
    """Bytes per element of a tensor that has one allowed dtype."""
    (dtype,) = ALLOWED_DTYPES[name]
    return _ITEM_SIZES[dtype]


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
    BATCHING = "batching"  # how the worker batched jobs: a layout's name (layertap.worker.model.batching.LAYOUTS)
    RESIDUAL_COPIES = "residual_copies"  # copies per token of a multi-copy stream: hidden_states [T, L, copies, H]
    ARCHITECTURE = "architecture"  # the transformers class that computed the states
    # Chats with images only: JSON saying where the model put its visual features into the stream the
    # states are read from: {"captured": ..., "merged_at": "input embeddings", "deepstack_in_layers": [ids]}.
    # Layer id i < L is what enters decoder layer i after the model's own additions (deepstack: Qwen3-VL
    # adds visual features to the outputs of its first layers, so ids 1..k hold them); id L is the last
    # layer's output.
    IMAGE_FEATURES = "image_features"
    # Quantized checkpoints only: the weights' scheme as JSON ({"method", "weights", "granularity", "block",
    # "activations"}) and how the worker computed with them: "dequant" (exact on the dequantized weights)
    # or "fp8" (fp8 matmuls with e4m3 activations quantized on the fly, as serving engines do).
    QUANTIZATION = "quantization"
    QUANT_COMPUTE = "quant_compute"
    LOSS_ON = "loss_on"  # chats: "all" | "last"
    TOPK = "topk"  # k of topk_logprobs/topk_ids, when stored
    TOPK_ON = "topk_on"  # "mask" | "all"
    TOKENIZER_FINGERPRINT = "tokenizer_fingerprint"
    JOB_ID = "job_id"
    JOB_METADATA = "job_metadata"  # the job's ``metadata`` string, when it has one
    # JSON: the job's ``provenance`` (e.g. regeneration: endpoint model, sampling, source row)
    PROVENANCE = "provenance"
    RUN = "run"
    SPEC_HASH = "spec_hash"  # Job.spec_hash(): identifies inputs and options
    # the checkpoint's files (layertap.worker.model.fingerprints.weights_fingerprint)
    WEIGHTS_FINGERPRINT = "weights_fingerprint"
    # The fixes that changed what this model's files hold (the worker's ``model.fixes``), where it has any:
    # a file written before one lacks it, so it no longer matches what a worker would write.
    COMPUTE_FIXES = "compute_fixes"
    # An export's bfloat16 copy of a float8 file (layertap.producer.files.dequantized): the dtype it was decoded from.
    DEQUANTIZED_FROM = "dequantized_from"
    CONTENT_ID = "content_id"  # content_id() of the IDENTITY_KEYS below
    # layertap.protocol.capture.capture_key(): the identity but for layers and stored dtype (files that
    # can answer each other's jobs); not part of the content_id, absent from files written before it
    CAPTURE_KEY = "capture_key"
    CHECKSUMS = "checksums"  # JSON {tensor name: crc32 hex}
    HEADER_CHECKSUM = "header_checksum"  # header_checksum() of the rest of the metadata and the tensor shapes


#: The metadata that, with the job's own fields (``spec_hash``), decides a file's bytes. The job's
#: ``final_hidden_states``, ``topk``, ``topk_on``, ``loss_on`` and input are in ``spec_hash``.
IDENTITY_KEYS = (MetaKey.FORMAT_VERSION, MetaKey.SPEC_HASH, MetaKey.MODEL_SOURCE, MetaKey.MODEL_REVISION,
                 MetaKey.WEIGHTS_FINGERPRINT, MetaKey.TOKENIZER_FINGERPRINT, MetaKey.LAYERS,
                 MetaKey.LAYER_CONVENTION, MetaKey.DTYPE, MetaKey.COMPUTE_DTYPE, MetaKey.QUANTIZATION,
                 MetaKey.QUANT_COMPUTE)
#: Identity keys added later, counted only where a file has them: files written before them (and
#: files of models they do not concern) keep their ``content_id``.
LATER_IDENTITY_KEYS = (MetaKey.COMPUTE_FIXES,)
#: Metadata every layertap file has (what readers and the manifest rely on).
REQUIRED_METADATA = (MetaKey.FORMAT, MetaKey.FORMAT_VERSION, MetaKey.MODEL, MetaKey.LAYERS, MetaKey.NUM_LAYERS,
                     MetaKey.DTYPE, MetaKey.JOB_ID, MetaKey.RUN, MetaKey.SPEC_HASH, MetaKey.CHECKSUMS)
#: Metadata a version 2 file has besides.
REQUIRED_METADATA_V2 = (MetaKey.WEIGHTS_FINGERPRINT, MetaKey.CONTENT_ID, MetaKey.HEADER_CHECKSUM)


class FileFormatError(ValueError):
    """A file that is not a complete, valid layertap file; the message says what is wrong."""


def crc32_hex(data: Any) -> str:
    """CRC-32 of a bytes-like object, as 8 hex digits (``crc``: the GIL is released on large buffers)."""
    return f"{crc32_of(data):08x}"


def content_id(metadata: dict[str, str]) -> str:
    """The content identity of a file with this header metadata (or of one a worker would write):
    a hash of its :data:`IDENTITY_KEYS` values (a missing key counts as empty) and of the
    :data:`LATER_IDENTITY_KEYS` it has (an empty or missing one is not counted)."""
    identity = {key: metadata.get(key, "") for key in IDENTITY_KEYS}
    identity |= {key: metadata[key] for key in LATER_IDENTITY_KEYS if metadata.get(key)}
    return content_hash(identity)[:32]


def header_checksum(metadata: dict[str, str], shapes: dict[str, list[int]]) -> str:
    """CRC-32 of the canonical JSON of ``metadata`` (without ``header_checksum``) and each
    tensor's shape: what the writer records and every header reader checks (version 2)."""
    rest = {key: value for key, value in metadata.items() if key != MetaKey.HEADER_CHECKSUM}
    return crc32_hex(canonical_json({"metadata": rest, "shapes": shapes}).encode("utf-8"))


def sealed_metadata(metadata: dict[str, str], tensor_bytes: dict[str, Any],
                    shapes: dict[str, list[int]]) -> dict[str, str]:
    """``metadata`` with what a writer records last: the ``checksums`` of each tensor's raw bytes
    (``tensor_bytes``: name -> a bytes-like object) and the :func:`header_checksum` over all of it
    and the tensors' ``shapes``."""
    sums = {name: crc32_hex(data) for name, data in tensor_bytes.items()}
    sealed = {**metadata, MetaKey.CHECKSUMS: json.dumps(sums, sort_keys=True)}
    sealed[MetaKey.HEADER_CHECKSUM] = header_checksum(sealed, shapes)
    return sealed


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
        float8 as its raw uint8 codes (``layertap.protocol.fp8`` decodes them)."""
        info = self.tensors[name]
        begin, end = info["data_offsets"]
        raw = np.fromfile(self.path, dtype=np.uint8, count=end - begin, offset=self.data_start + begin)
        array = raw.view(_NUMPY_DTYPES[info["dtype"]]).reshape(info["shape"])
        if info["dtype"] == "BF16":
            array = (array.astype(np.uint32) << 16).view(np.float32)
        return array


def read_file_header(path: str | Path, *, name: str | Path | None = None) -> FileHeader:
    """The header of the file at ``path`` (``name``: what errors call it, by default ``path``).
    Raises :class:`FileFormatError` or ``OSError``."""
    with open(path, "rb") as handle:
        return parse_header(handle, path, name=name)


def parse_header(handle: BinaryIO, path: str | Path = "", *, name: str | Path | None = None,
                 file_size: int | None = None) -> FileHeader:
    """Parse the safetensors header at the start of ``handle`` (the file at ``path``, ``file_size``
    bytes: by default its end; ``name``: what errors call it, by default ``path``). Every length,
    size and offset is checked against the file's size. Raises :class:`FileFormatError`."""
    return _parse_header(handle, path, name, file_size)[0]


def _parse_header(handle: BinaryIO, path: str | Path, name: str | Path | None,
                  file_size: int | None) -> tuple[FileHeader, dict[str, Any]]:
    """:func:`parse_header`, and the metadata's JSON fields as it parsed them (:func:`_check_metadata`)."""
    label = path if name is None else name
    if file_size is None:
        file_size = handle.seek(0, 2)
        handle.seek(0)
    raw_len = handle.read(8)
    if len(raw_len) != 8:
        raise FileFormatError(f"{label}: file is shorter than a safetensors header (truncated?)")
    (header_len,) = struct.unpack("<Q", raw_len)
    if header_len > _MAX_HEADER:
        raise FileFormatError(f"{label}: header length {header_len} is implausible (corrupt file?)")
    if 8 + header_len > file_size:
        raise FileFormatError(f"{label}: header length {header_len} runs past the end of the file "
                              f"({file_size} bytes; truncated?)")
    raw = handle.read(header_len)
    if len(raw) != header_len:
        raise FileFormatError(f"{label}: header is truncated ({len(raw)} of {header_len} bytes)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FileFormatError(f"{label}: header is not valid JSON ({exc})") from None
    header = _bounded_json(label, text, "header")
    if not isinstance(header, dict):
        raise FileFormatError(f"{label}: header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise FileFormatError(f"{label}: header metadata is not an object of strings")
    _check_entries(label, header, 8 + header_len, file_size)
    fields = _check_metadata(label, metadata, header)
    return FileHeader(Path(path), header, dict(metadata), 8 + header_len), fields


def _bounded_json(path: str | Path, text: str, what: str) -> Any:
    """``text`` (``what`` of the file at ``path``) parsed as JSON, after its nesting and its number of
    arrays and objects are checked against what a layertap header can hold (strings not counted):
    no deep recursion, no huge structure built. Raises :class:`FileFormatError`."""
    opening = text.count("[") + text.count("{")
    if opening <= _MAX_JSON_DEPTH and opening + text.count("]") + text.count("}") <= _MAX_JSON_BRACKETS:
        return _loads(path, text, what)  # too few brackets anywhere (strings included) to break a bound
    brackets = _NOT_BRACKET.sub("", _JSON_STRING.sub("", text))
    level = 0
    for bracket in brackets[:_MAX_JSON_BRACKETS + 1]:
        level += 1 if bracket in "[{" else -1
        if level > _MAX_JSON_DEPTH:
            raise FileFormatError(f"{path}: {what} nests arrays and objects more than {_MAX_JSON_DEPTH} levels deep, "
                                  "deeper than a layertap header can (corrupt file?)")
    if len(brackets) > _MAX_JSON_BRACKETS:
        raise FileFormatError(f"{path}: {what} has {len(brackets)} brackets, more than the {_MAX_JSON_BRACKETS} "
                              "a layertap header can (corrupt file?)")
    return _loads(path, text, what)


def _loads(path: str | Path, text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:  # not JSON, or a number of more digits than Python converts
        raise FileFormatError(f"{path}: {what} is not valid JSON ({exc})") from None


def _check_entries(path: str | Path, header: dict[str, Any], data_start: int, file_size: int) -> None:
    """Each tensor entry has a known dtype, a shape of sizes and offsets that hold exactly its
    bytes, within the file (its data starts at byte ``data_start`` of ``file_size``), and the
    tensors' ranges do not overlap."""
    ranges = []
    for name, info in header.items():
        if not isinstance(info, dict):
            raise FileFormatError(f"{path}: header entry {name!r} is not an object")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in _ITEM_SIZES:
            raise FileFormatError(f"{path}: tensor {name!r} has no known dtype ({_brief(dtype)})")
        if not isinstance(shape, list) or not all(_is_count(size) for size in shape):
            raise FileFormatError(f"{path}: tensor {name!r} has no valid shape ({_brief(shape)})")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets)
                or offsets[0] > offsets[1]):
            raise FileFormatError(f"{path}: tensor {name!r} has no valid data_offsets ({_brief(offsets)})")
        if data_start + offsets[1] > file_size:
            raise FileFormatError(f"{path}: tensor {name!r} ends at byte {data_start + offsets[1]} but the file "
                                  f"has {file_size} bytes (truncated)")
        if not _holds(shape, _ITEM_SIZES[dtype], offsets[1] - offsets[0]):
            raise FileFormatError(f"{path}: tensor {name!r} holds {offsets[1] - offsets[0]} bytes, not the "
                                  f"{_brief(shape)} x {dtype} its header gives")
        ranges.append((offsets[0], offsets[1], name))
    ranges.sort()
    for (_, end, first), (begin, _, second) in zip(ranges, ranges[1:]):
        if begin < end:
            raise FileFormatError(f"{path}: tensors {first!r} and {second!r} overlap in the file")


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _holds(shape: list[int], item_size: int, span: int) -> bool:
    """A tensor of ``shape`` has exactly ``span`` bytes; the product stops once it passes ``span``,
    so a size such as 2**70 is never multiplied out (nor overflows)."""
    if 0 in shape:
        return span == 0
    total = item_size
    for size in shape:
        total *= size
        if total > span:
            return False
    return total == span


def _brief(value: Any) -> str:
    """``repr(value)``, cut to 80 characters (a header's values can be any size)."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."


def _is_decimal(text: str) -> bool:
    return text.isascii() and text.isdigit() and len(text) <= _MAX_DIGITS


def _check_metadata(path: str | Path, meta: dict[str, str], header: dict[str, Any]) -> dict[str, Any]:
    """The typed metadata entries parse (where present), and the header checksum matches (where recorded);
    the JSON entries parsed (``layers``, ``checksums``: those present)."""
    recorded = meta.get(MetaKey.HEADER_CHECKSUM)
    if recorded is not None:
        found = header_checksum(meta, {name: info["shape"] for name, info in header.items()})
        if found != recorded:
            raise FileFormatError(f"{path}: header checksum mismatch (expected {recorded}, found {found}): "
                                  "its metadata or shapes were changed")
    fields: dict[str, Any] = {}
    if MetaKey.LAYERS in meta:
        layers = fields[MetaKey.LAYERS] = _json_field(path, meta, MetaKey.LAYERS)
        if not isinstance(layers, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers):
            raise FileFormatError(f"{path}: header metadata 'layers' is not a JSON list of layer ids")
    for key in (MetaKey.NUM_LAYERS, MetaKey.TOPK, MetaKey.RESIDUAL_COPIES):
        if key in meta and not _is_decimal(meta[key]):
            raise FileFormatError(f"{path}: header metadata {key!r} is not a number ({meta[key][:40]!r})")
    if MetaKey.CHECKSUMS in meta:
        sums = fields[MetaKey.CHECKSUMS] = _json_field(path, meta, MetaKey.CHECKSUMS)
        if not isinstance(sums, dict) or not all(isinstance(v, str) for v in sums.values()):
            raise FileFormatError(f"{path}: header metadata 'checksums' is not a JSON object of checksums")
    return fields


def _json_field(path: str | Path, meta: dict[str, str], key: str) -> Any:
    return _bounded_json(path, meta[key], f"header metadata {key!r}")


def layers_of(header: FileHeader) -> list[int]:
    """The layer ids a file's header lists, in file order (checked by :func:`parse_header`)."""
    if MetaKey.LAYERS not in header.metadata:
        raise FileFormatError(f"{header.path}: header metadata has no 'layers'")
    return json.loads(header.metadata[MetaKey.LAYERS])


def metadata_of(path: str | Path) -> dict[str, str]:
    """The header metadata of a file, without loading any tensor."""
    return read_file_header(path).metadata


def is_vllm_file(header: FileHeader) -> bool:
    """Whether a file is laid out as vLLM's hidden-states connector writes it: no header metadata
    (so no layertap file: every one has some), exactly ``hidden_states`` and ``token_ids``."""
    return not header.metadata and set(header.tensors) == set(REQUIRED_TENSORS)


def check_vllm_file(header: FileHeader, name: str | Path | None = None) -> None:
    """Check what a vLLM file's header allows (:func:`is_vllm_file`; it records no checksums, layers
    or model): ``hidden_states`` ``[T, n, H]`` in the model's dtype with ``n, H >= 1``, ``token_ids``
    ``[T]`` int64. Raises :class:`FileFormatError` (``name``: what it calls the file)."""
    label = header.path if name is None else name
    hidden, tokens = header.tensors[HIDDEN_STATES], header.tensors[TOKEN_IDS]
    if hidden["dtype"] not in VLLM_STATE_DTYPES or len(hidden["shape"]) != 3 or 0 in hidden["shape"][1:]:
        raise FileFormatError(f"{label}: hidden_states is {hidden['dtype']} {hidden['shape']}, not [tokens, layers, "
                              f"hidden] in one of {sorted(VLLM_STATE_DTYPES)} (a file vLLM wrote)")
    if tokens["dtype"] != "I64" or tokens["shape"] != hidden["shape"][:1]:
        raise FileFormatError(f"{label}: token_ids is {tokens['dtype']} {tokens['shape']} but hidden_states has "
                              f"{hidden['shape'][0]} tokens (int64 [tokens] expected)")


def verify_file(path: str | Path, *, checksums: bool = True, name: str | Path | None = None) -> FileHeader:
    """Check a file's structure, tensor shapes/dtypes and checksums; return its header.

    Raises :class:`FileFormatError` naming the first problem found. ``checksums=False`` checks
    everything but the tensors' bytes, for a reader that loads them anyway and checks them there
    (:func:`check_checksums`), reading the file once instead of twice.
    """
    with open(path, "rb") as handle:
        return verify_stream(handle, path, handle.seek(0, 2), checksums=checksums, name=name)


def verify_stream(handle: BinaryIO, path: str | Path, file_size: int, *, checksums: bool = True,
                  name: str | Path | None = None) -> FileHeader:
    """:func:`verify_file` on an open, seekable binary ``handle`` of ``file_size`` bytes (a local
    file or an object store's ranged reader) of the file at ``path``; ``name`` (by default
    ``path``) is what errors call it. Each tensor's bytes are read (``readinto``) into a reused
    block and checksummed there, a block at a time."""
    handle.seek(0)
    parsed, fields = _parse_header(handle, path, name, file_size)
    path = path if name is None else name
    header, meta, data_start = parsed.tensors, parsed.metadata, parsed.data_start
    if meta.get(MetaKey.FORMAT) != FORMAT_NAME:
        raise FileFormatError(f"{path}: not a layertap file (header metadata has no format={FORMAT_NAME!r})")
    _check_required(path, meta)
    _check_shapes(path, header, meta, fields[MetaKey.LAYERS])
    recorded = fields[MetaKey.CHECKSUMS]  # present and typed (checked before)
    block = _block() if checksums else None
    try:
        at = data_start
        for name, info in header.items():
            begin, end = info["data_offsets"]  # within the file (parse_header)
            expected = recorded.get(name)
            if expected is None:
                raise FileFormatError(f"{path}: no checksum recorded for tensor {name!r}")
            if block is None:
                continue
            if at != data_start + begin:
                at = handle.seek(data_start + begin)
            _check_crc(path, name, expected, _crc_of(handle, block, end - begin, path, name))
            at += end - begin
    finally:
        if block is not None:
            _FREE_BLOCKS.put(block)
    return parsed


def _block() -> memoryview:
    """A read block of :data:`READ_BLOCK` bytes; give it back to :data:`_FREE_BLOCKS` when done."""
    try:
        return _FREE_BLOCKS.get_nowait()
    except queue.Empty:
        return memoryview(bytearray(READ_BLOCK))


def _crc_of(handle: BinaryIO, block: memoryview, size: int, path: str | Path, name: str) -> int:
    """The CRC-32 of the next ``size`` bytes of ``handle`` (tensor ``name``), read through ``block``."""
    crc, left = 0, size
    while left:
        count = handle.readinto(block[:min(left, len(block))])
        if not count:
            raise FileFormatError(f"{path}: tensor {name!r} is truncated")
        crc = crc32_of(block[:count], crc)
        left -= count
    return crc


def check_checksums(path: str | Path, meta: dict[str, str], tensor_bytes: dict[str, Any]) -> None:
    """Check each loaded tensor's bytes (a buffer: ``{name: uint8 array}``) against the checksum
    that ``meta`` (from :func:`verify_file`) records for it; raises :class:`FileFormatError`."""
    recorded = _recorded_checksums(path, meta)
    for name, data in tensor_bytes.items():
        _check_crc(path, name, recorded.get(name, ""), crc32_of(data))


def _recorded_checksums(path: str | Path, meta: dict[str, str]) -> dict[str, str]:
    if MetaKey.CHECKSUMS not in meta:
        raise FileFormatError(f"{path}: header metadata has no 'checksums'")
    return _json_field(path, meta, MetaKey.CHECKSUMS)  # its type is checked by parse_header


def _check_required(path: str | Path, meta: dict[str, str]) -> None:
    """The metadata of the file's format version is all there, and its identity is its own."""
    version = meta.get(MetaKey.FORMAT_VERSION, "")
    if not _is_decimal(version) or not 1 <= int(version) <= int(FORMAT_VERSION):
        raise FileFormatError(f"{path}: format version {version[:20]!r} is not one this reader knows "
                              f"(1..{FORMAT_VERSION})")
    required = REQUIRED_METADATA + (REQUIRED_METADATA_V2 if int(version) >= 2 else ())
    missing = [key for key in required if key not in meta]
    if missing:
        raise FileFormatError(f"{path}: header metadata lacks {', '.join(missing)}")
    if int(version) >= 2 and meta[MetaKey.CONTENT_ID] != content_id(meta):
        raise FileFormatError(f"{path}: header metadata 'content_id' does not match its identity fields")


def _check_crc(path: str | Path, name: str, expected: str, crc: int) -> None:
    if f"{crc & 0xFFFFFFFF:08x}" != expected:
        raise FileFormatError(
            f"{path}: checksum mismatch in tensor {name!r} (expected {expected}, "
            f"found {crc & 0xFFFFFFFF:08x}): the file is corrupt"
        )


def _check_shapes(path: str | Path, header: dict[str, Any], meta: dict[str, str], layers: list[int]) -> None:
    """The tensors' shapes and dtypes agree with each other and with the header's ``layers`` (parsed)."""
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
    if len(layers) != hidden[1]:
        raise FileFormatError(
            f"{path}: header lists {len(layers)} layers {layers} but hidden_states has {hidden[1]}"
        )
    for name, info in header.items():
        if name in (HIDDEN_STATES, TOKEN_IDS):
            continue
        shape = info["shape"]
        if not shape or shape[0] != hidden[0]:
            raise FileFormatError(f"{path}: tensor {name!r} has shape {shape}, expected {hidden[0]} tokens first")
    stored_as = STORED_AS.get(meta[MetaKey.DTYPE])
    for name in STATE_TENSORS:
        if name in header and stored_as is not None and header[name]["dtype"] != stored_as:
            raise FileFormatError(f"{path}: tensor {name!r} is {header[name]['dtype']} but the header's dtype "
                                  f"is {meta[MetaKey.DTYPE]}")
    expected = {LOSS_MASK: hidden[:1], IMAGE_TOKEN_MASK: hidden[:1], FINAL_HIDDEN_STATES: [hidden[0], hidden[-1]]}
    for name, shape in expected.items():
        if name in header and header[name]["shape"] != shape:
            raise FileFormatError(f"{path}: tensor {name!r} has shape {header[name]['shape']}, expected {shape}")
    _check_scales(path, header)
    _check_topk(path, header)


def _check_scales(path: str | Path, header: dict[str, Any]) -> None:
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


def _check_topk(path: str | Path, header: dict[str, Any]) -> None:
    """``topk_logprobs`` and ``topk_ids`` come together, both ``[T, k]``."""
    present = [name for name in (TOPK_LOGPROBS, TOPK_IDS) if name in header]
    if len(present) == 1:
        raise FileFormatError(f"{path}: tensor {present[0]!r} is present without its pair")
    if present:
        logprobs, ids = header[TOPK_LOGPROBS]["shape"], header[TOPK_IDS]["shape"]
        if len(logprobs) != 2 or logprobs != ids:
            raise FileFormatError(f"{path}: topk_logprobs {logprobs} and topk_ids {ids} must both be [tokens, k]")
