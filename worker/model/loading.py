"""Loading a causal LM once and finding its parts: decoder layers, final norm, sizes.

Decoder layers are found structurally (the ``nn.ModuleList`` of ``num_hidden_layers``
blocks inside the text decoder, alike or not: hybrids such as Jamba mix block classes),
so Llama, Qwen, Mistral, Gemma, Phi, GPT-2/NeoX-style, hybrid and multimodal wrappers
work without a table of attribute paths. A vision-language checkpoint (one saved as
``...ForConditionalGeneration``: Qwen-VL, Gemma 3, LLaVA, Llama 4, Qwen3.5...) loads as
that class, vision tower included, and its text decoder (the innermost ``get_decoder()``)
is what the engine runs for text and token-id jobs. The batching path is chosen here too
(``layertap.worker.model.batching``), and the model switched to packed attention only when packing is
exact for it; otherwise it keeps the attention implementation transformers gave it.

Every change to the model happens here: packed attention, the capture hooks
(``layertap.worker.model.capture``, registered once), the switch back to transformers' own
attention for a reference run (:func:`transformers_attention`) and ``torch.compile``
(:func:`compile_decoder_layers`). The engine only runs the model.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import logging
import os
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from layertap.protocol.dtypes import AUTO, COMPUTE_DTYPES, normalize_dtype
from layertap.protocol.fileformat import MetaKey
from layertap.protocol.layers import eagle3_layer_ids
from layertap.worker.model.attention import set_attention
from layertap.worker.model.batching import ModelRefused, layout_class, plan_batching
from layertap.worker.model.capture import LayerCapture, UncapturableStream, probe_stream
from layertap.worker.model.host_memory import LoadReport, peak_rss_bytes
from layertap.worker.model.vision.aligned_mlp import align_tower_mlps
from layertap.worker.model.vision.inputs import plan_image_batching, rope_index_module
from layertap.worker.model.vision.towers import grid_tower, takes_host_inputs
from layertap.worker.model.layouts.base import BatchLayout
from layertap.worker.model.quant.fp8 import choose_compute
from layertap.worker.model.quant.scheme import QuantScheme, UnsupportedQuantization, scheme_of
from layertap.worker.model.classes import auto_class
from layertap.worker.model.vision.processors import load_processor
from layertap.worker.model.split.stages import ModelSplit, place, plan_split
from layertap.worker.model.vision.tower_graphs import TowerGraphs
from layertap.worker.model.vision.attention import choose_vision_attention

log = logging.getLogger(__name__)

#: Any of these in a model folder means it has a tokenizer (fast, slow or its config).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")
FINAL_NORM_NAMES = ("norm", "ln_f", "final_layernorm", "final_layer_norm", "norm_f", "final_norm")
#: ``quant_compute`` of a checkpoint whose dense Linears run fp8 matmuls while its experts are dequantized.
FP8_DENSE_DEQUANT_EXPERTS = "fp8-dense-dequant-experts"
#: The torch dtype of each protocol dtype name (``layertap.protocol.dtypes``).
TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
                "float8": torch.float8_e4m3fn}


@dataclass
class LoadedModel:
    """A model ready for hooked prefill, with what the engine needs to know about it."""

    model: nn.Module  # the CausalLM (lm_head included; the engine calls ``decoder``)
    decoder: nn.Module  # the base model: embeddings -> layers -> final norm
    layers: nn.ModuleList
    final_norm: nn.Module | None
    lm_head: nn.Module | None  # hidden (after the final norm) -> logits
    tokenizer: Any | None
    name: str  # the served model name jobs use
    source: str  # folder or hub id it was loaded from
    revision: str | None
    num_layers: int
    hidden_size: int
    vocab_size: int
    device: torch.device
    dtype: torch.dtype
    tokenizer_fingerprint: str
    weights_fingerprint: str  # changes when the checkpoint's files change (:func:`weights_fingerprint`)
    batching: BatchLayout  # how jobs share a forward (``layertap.worker.model.layouts``); see use_layout
    native_attention: str  # the attention implementation transformers chose (the self-check's reference)
    capture: LayerCapture  # the hooks that copy layers out during the engine's forwards
    quantization: QuantScheme | None = None  # the checkpoint's, when its weights are quantized
    quant_compute: str = ""  # quantized checkpoints: "dequant" | "fp8" | FP8_DENSE_DEQUANT_EXPERTS
    load_report: LoadReport | None = None  # time and host memory that loading took (checkpoints only)
    experts: str | None = None  # mixture-of-experts models: transformers' experts implementation (grouped_mm, ...)
    processor: Any | None = None  # a VLM's AutoProcessor (images -> model inputs), None for text models
    processor_problem: str = ""  # why a VLM has no processor (said in its image jobs' errors)
    image_batching: BatchLayout | None = None  # how chats with images share a forward (``vision.inputs``)
    split: ModelSplit | None = None  # a model split over layers into stages (``layertap.worker.model.split``)
    vision_attention: str | None = None  # the vision tower's attention in image forwards (``vision.attention``)
    grid_tower: nn.Module | None = None  # a vision tower that takes ``grid_thw`` (``vision.towers``), found once
    rope_index: nn.Module | None = None  # the module that numbers M-RoPE positions (``vision.inputs``), found once
    tower_graphs: TowerGraphs | None = None  # the grid tower's CUDA graphs by image size (``vision.tower_graphs``), GPU only

    @property
    def architecture(self) -> str:
        return type(self.model).__name__

    def quantization_header(self) -> dict[str, str]:
        """File header fields for a quantized checkpoint (none otherwise): its scheme as JSON and the compute path."""
        if self.quantization is None:
            return {}
        scheme = self.quantization
        described = {"method": scheme.method, "weights": scheme.weights, "granularity": scheme.granularity,
                     "block": list(scheme.block) if scheme.block else None,
                     "activations": "dynamic" if scheme.dynamic_activations else "static"}
        return {MetaKey.QUANTIZATION: json.dumps(described), MetaKey.QUANT_COMPUTE: self.quant_compute}


def resolve_device(spec: str) -> torch.device:
    """``auto`` -> ``cuda`` when available, else ``cpu``."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {spec!r} asked for but CUDA is not available on this machine")
    return device


def resolve_dtype(spec: str, device: torch.device, config: Any | None = None) -> torch.dtype:
    """``auto`` -> float32 on the CPU; on a GPU the checkpoint's half dtype, else bfloat16."""
    if spec != AUTO:
        name = normalize_dtype(spec)
        if name not in COMPUTE_DTYPES:
            raise ValueError(f"dtype {spec!r} is not one of {sorted(COMPUTE_DTYPES)} or auto")
        return TORCH_DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    stored = getattr(config, "dtype", None)
    return stored if stored in (torch.bfloat16, torch.float16) else torch.bfloat16


def text_decoder(model: nn.Module) -> nn.Module:
    """The innermost text decoder: ``get_decoder()`` followed down (a vision-language model's
    returns its language model, which may itself be a causal LM wrapping the decoder, as
    Llama 4's is), else ``base_model``."""
    current: nn.Module = model
    while hasattr(current, "get_decoder"):
        inner = current.get_decoder()
        if not isinstance(inner, nn.Module) or inner is current:
            break
        current = inner
    return current if current is not model else getattr(model, "base_model", model)


def find_decoder_layers(model: nn.Module, num_layers: int) -> tuple[nn.Module, nn.ModuleList]:
    """Return ``(decoder, layers)``: the text decoder module and its list of ``num_layers``
    blocks (the shallowest such list with weights in every block; the blocks may differ in
    class, as in hybrids). Raises :class:`ModelRefused` when there is none."""
    decoder = text_decoder(model)
    base = getattr(model, "base_model", model)
    # the innermost get_decoder() is the text decoder, unless a model names another part so (ModernBERT-decoder's
    # output Linear): then its base model is searched
    scopes = [(decoder, decoder), (base, base), (model, base)]
    for scope, runs in scopes:
        candidates = [
            (name, module) for name, module in scope.named_modules()
            if isinstance(module, nn.ModuleList) and len(module) == num_layers
            and all(any(True for _ in block.parameters()) for block in module)
        ]
        if candidates:
            _, layers = min(candidates, key=lambda item: item[0].count("."))
            return runs, layers
    recorded = _recorded_block_lists(model)
    if len(recorded) == 1:  # num_hidden_layers counts something else (passes of a looped model, say)
        return scopes[0][1], recorded[0]
    if recorded:
        raise ModelRefused(type(model).__name__, f"its decoder blocks sit in {len(recorded)} separate lists (run in "
                           "turn or in cycles), which one list of layer ids cannot name")
    raise ModelRefused(type(model).__name__, f"no list of its {num_layers} decoder blocks (num_hidden_layers in "
                       "its config) found, so its layers cannot be read")


def _recorded_block_lists(model: nn.Module) -> list[nn.ModuleList]:
    """The module lists of the blocks whose outputs transformers records as the model's hidden
    states (its ``_can_record_outputs``), outermost first."""
    found: list[nn.ModuleList] = []
    for part in (model, getattr(model, "base_model", None)):
        recorder = (getattr(part, "_can_record_outputs", None) or {}).get("hidden_states")
        block_class = getattr(recorder, "target_class", recorder)  # a class, or a tuple of them
        if isinstance(block_class, type) or (isinstance(block_class, tuple) and block_class):
            found = [module for module in model.modules() if isinstance(module, nn.ModuleList) and len(module)
                     and all(isinstance(block, block_class) for block in module)]
            break
    return found


def block_count(model: nn.Module, config: Any) -> int | None:
    """How many decoder blocks the model has: ``num_hidden_layers``, unless the model's own record
    of its hidden states counts blocks by another field (LongCat-Flash: two attention sublayers per
    block, so ``num_hidden_layers`` is twice its blocks)."""
    for part in (model, getattr(model, "base_model", None)):
        recorder = (getattr(part, "_can_record_outputs", None) or {}).get("hidden_states")
        key = getattr(recorder, "num_hidden_layers_key", None)
        if key and isinstance(getattr(config, key, None), int):
            return getattr(config, key)
    return getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None)


def find_final_norm(decoder: nn.Module) -> nn.Module | None:
    """The norm applied after the last decoder layer, if the decoder has one of the usual names."""
    for attr in FINAL_NORM_NAMES:
        module = getattr(decoder, attr, None)
        if isinstance(module, nn.Module):
            return module
    return None


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


def checkpoint_folder(source: str, revision: str | None) -> Path | None:
    """The local folder ``from_pretrained`` read ``source`` from: itself, or its hub cache snapshot."""
    if Path(source).is_dir():
        return Path(source)
    from huggingface_hub import try_to_load_from_cache

    config = try_to_load_from_cache(source, "config.json", revision=revision)
    return Path(config).parent if isinstance(config, (str, os.PathLike)) else None


def describe(model: nn.Module, tokenizer: Any | None, *, name: str, source: str,
             revision: str | None = None, batching: str = "auto", fingerprint: str | None = None) -> LoadedModel:
    """Wrap an already-built model (eval mode, no grads) as a :class:`LoadedModel`, choose its
    batching layout (``batching``: auto or a layout's name), switch it to the layout's attention,
    and register the capture hooks. Raises :class:`ModelRefused` (one line) for a
    model that cannot be served. ``fingerprint``: the checkpoint's :func:`weights_fingerprint`;
    without it, that of the folder ``source`` when it is one, else :func:`parameters_fingerprint`."""
    config = model.config.get_text_config()
    num_layers = block_count(model, config)
    if not num_layers:
        raise ModelRefused(type(model).__name__, "its config names no num_hidden_layers, so its decoder blocks "
                                                 "cannot be found")
    decoder, layers = find_decoder_layers(model, num_layers)
    num_layers = len(layers)
    plan = plan_batching(model, layers, batching)
    model.eval().requires_grad_(False)
    parameter = next(model.parameters())
    hidden_size = getattr(config, "hidden_size", None) or getattr(config, "n_embd")
    try:  # through the model's own attention: the stream's shape is the model's, not the layout's
        stream = probe_stream(decoder, layers, hidden_size, parameter.device)
    except UncapturableStream as exc:
        raise ModelRefused(type(model).__name__, str(exc)) from None
    native_attention = str(getattr(model.config, "_attn_implementation", None) or "eager")
    vision = choose_vision_attention(model, parameter.device, parameter.dtype)  # before the switch below
    weights = fingerprint or (weights_fingerprint(Path(source)) if Path(source).is_dir()
                              else parameters_fingerprint(model))
    tower = grid_tower(model)
    align_tower_mlps(tower, parameter.device, parameter.dtype)  # the same function, on Hopper's kernels
    if plan.attention is not None:
        set_attention(model, plan.attention)
    vocab_size = model.get_input_embeddings().weight.shape[0]
    final_norm = find_final_norm(decoder)
    capture = LayerCapture(layers, final_norm, stream=stream, dtype=parameter.dtype, device=parameter.device)
    return LoadedModel(
        model=model, decoder=decoder, layers=layers, final_norm=final_norm,
        lm_head=model.get_output_embeddings(),
        tokenizer=tokenizer, name=name, source=source, revision=revision, num_layers=num_layers,
        hidden_size=hidden_size, vocab_size=vocab_size, device=parameter.device, dtype=parameter.dtype,
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer), batching=plan, native_attention=native_attention,
        weights_fingerprint=weights,
        capture=capture, vision_attention=vision, grid_tower=tower, rope_index=rope_index_module(model),
    )


def use_layout(loaded: LoadedModel, layout: BatchLayout) -> None:
    """Serve ``loaded`` with ``layout`` from now on (the self-check's fallback): its attention
    implementation, or the one transformers chose."""
    set_attention(loaded.model, layout.attention or loaded.native_attention)
    loaded.batching = layout


@contextlib.contextmanager
def transformers_attention(loaded: LoadedModel) -> Iterator[None]:
    """Within the block the model runs the attention implementation transformers chose for it
    (the reference the self-check and the bench compare batching with); after it, the layout's
    again (a layout that keeps the model's own never leaves it)."""
    switched = loaded.batching.attention
    if switched is not None:
        set_attention(loaded.model, loaded.native_attention)
    try:
        yield
    finally:
        if switched is not None:
            set_attention(loaded.model, switched)


@contextlib.contextmanager
def _one_per_forward(loaded: LoadedModel, field: str, reason: str) -> Iterator[None]:
    """Within the block ``loaded.<field>`` (a layout) is the one-per-forward layout, under
    transformers' attention; the served layout again after it."""
    with transformers_attention(loaded):
        served = getattr(loaded, field)
        setattr(loaded, field, layout_class("single")(reason))
        try:
            yield
        finally:
            setattr(loaded, field, served)


def each_sequence_alone(loaded: LoadedModel) -> contextlib.AbstractContextManager[None]:
    """Within the block every text batch is one sequence run as the model runs it by itself:
    transformers' attention for it (:func:`transformers_attention`), and no ``position_ids``
    (the one-per-forward layout), so the model numbers the positions itself. That is the
    self-check's reference: packing passes positions restarting at 0, which a model that
    numbers its own otherwise (Kosmos-2.5 from its padding id + 1) would not compute."""
    return _one_per_forward(loaded, "batching", "the self-check's reference: each sequence alone")


def each_image_chat_alone(loaded: LoadedModel) -> contextlib.AbstractContextManager[None]:
    """Within the block image chats run one per forward, unpadded, which runs them plain (as a
    user runs the model on its processor's output: transformers' attention, the chat's mask, the
    positions and tower inputs the model derives itself; ``engine.runner.run_with_images``).
    That is the image self-check's reference, so it covers the worker's host numbering too (a
    wrong one would otherwise pass, batched and alone alike)."""
    return _one_per_forward(loaded, "image_batching", "the image self-check's reference: each chat alone")


def compile_decoder_layers(loaded: LoadedModel, backend: str = "inductor") -> None:
    """``torch.compile`` each decoder layer's ``forward`` with dynamic shapes: norms, rotary,
    MLP and residual adds fuse; attention stays eager (``packed_attention`` is excluded)
    and the capture hooks stay outside (they run in ``Module.__call__``), as do accelerate's
    (a split model's: the layer's own forward is compiled, under them). Identical layers
    share one compiled graph; the engine's warm-up pays the compile time. ``backend``: torch's
    (``eager`` traces the graphs without generating code, as the tests of their breaks do).
    A VLM's grid tower (``layertap.worker.model.vision.towers``) has its blocks compiled the same
    way, one graph for all of them, its varlen flash attention a custom op inside it (no graph
    break). Not the whole tower: that unrolls every block into one graph; on an H200
    (Qwen2.5-VL-7B's 32 blocks) a first forward so compiled had not ended after a minute (17 s
    with its blocks compiled). The image warm-up compiles them."""
    for layer in [*loaded.layers, *getattr(loaded.grid_tower, "blocks", [])]:
        if hasattr(layer, "_old_forward"):  # accelerate's hook calls it
            layer._old_forward = torch.compile(layer._old_forward, dynamic=True, backend=backend)
        else:
            layer.forward = torch.compile(layer.forward, dynamic=True, backend=backend)


def use_tower_graphs(loaded: LoadedModel, limit: int) -> None:
    """Replay ``loaded``'s grid tower as CUDA graphs by image size (``layertap.worker.model.vision.tower_graphs``)
    in batched image forwards, for up to ``limit`` sizes: where chats with images batch, for a
    tower given its inputs on the host (:func:`~layertap.worker.model.vision.towers.takes_host_inputs`)
    that attends by one varlen flash op (``vision.attention``: a GPU, bf16/fp16), so that its
    forward never waits on the device. Else (or ``limit`` 0) nothing changes."""
    batched = loaded.image_batching is not None and not loaded.image_batching.slow
    if limit and batched and loaded.vision_attention is not None and takes_host_inputs(loaded.grid_tower):
        loaded.tower_graphs = TowerGraphs(limit)


def load_tokenizer(source: str, revision: str | None, trust_remote_code: bool) -> Any | None:
    """The model's tokenizer, or None for a local folder that holds weights only (such a
    worker takes ``token_ids`` jobs only). A tokenizer that is there but fails to load raises."""
    from transformers import AutoTokenizer

    folder = Path(source)
    if folder.is_dir() and not any((folder / name).exists() for name in TOKENIZER_FILES):
        log.warning("%s has no tokenizer files: serving token_ids jobs only", source)
        return None
    return AutoTokenizer.from_pretrained(source, revision=revision, trust_remote_code=trust_remote_code)


def load_model(source: str, *, name: str | None = None, device: str = "auto", dtype: str = "auto",
               revision: str | None = None, trust_remote_code: bool = False,
               chat_template: str | None = None, batching: str = "auto", quant_compute: str = "auto",
               stages: int = 0, token_budget: int = 0, captured_layers: int | None = None) -> LoadedModel:
    """Load model and tokenizer once with ``from_pretrained`` (local folder or hub id), or
    build a config-only shape with random weights (``shape:qwen3-8b``, see ``layertap.worker.model.shapes``).
    Weights go from the checkpoint to the device tensor by tensor (``device_map``), never
    through a host copy of the model; peak host memory while loading is logged. A quantized
    checkpoint (``layertap.worker.model.quant``) keeps its weights quantized on the device and computes
    by ``quant_compute`` (auto | dequant | fp8).
    ``chat_template`` (Jinja text) replaces the tokenizer's own template. The model keeps
    the attention implementation transformers picks for it (SDPA where it has one, else
    its own), and is switched to packed attention only where packing is exact.
    ``stages``: split the layers into that many stages over the devices (:func:`split_devices`;
    0: one stage per visible GPU when ``device`` is ``cuda`` and several are visible, else none);
    ``token_budget`` x ``captured_layers`` (default EAGLE-3's count): the states a batch stages,
    counted on the first stage when the layers are balanced."""
    from transformers import AutoConfig

    from layertap.worker.model.shapes import (
        SHAPE_PREFIX,
        build_random_model,
        fill_random,
        is_shape,
        shape_config,
    )

    torch_device = resolve_device(device)
    if is_shape(source):
        if chat_template is not None:
            raise ValueError(f"{source} has no tokenizer, so a chat template cannot be used with it")
        shape = source.removeprefix(SHAPE_PREFIX)
        devices = split_devices(torch_device, stages)
        shape_dtype = resolve_dtype(dtype, torch_device, shape_config(shape))
        plans = None
        if len(set(devices)) > 1:  # over several GPUs: each stage's weights made on its GPU
            model = empty_model(shape_config(shape), trust_remote_code=False, dtype=shape_dtype)
            plans, placed = split_plan(model, devices, token_budget, captured_layers, shape_dtype)
            fill_random(model, placed, shape_dtype)
            place(model, placed)
        else:
            model = build_random_model(shape, torch.device(devices[0]), shape_dtype)
            if len(devices) > 1:  # stages sharing one device
                plans, placed = split_plan(model, devices, token_budget, captured_layers)
                place(model, placed)
        return with_split(describe(model, None, name=name or source, source=source, batching=batching), plans)
    config = AutoConfig.from_pretrained(source, revision=revision, trust_remote_code=trust_remote_code)
    if getattr(config, "is_encoder_decoder", False):  # a multimodal one loads as image-text-to-text: refused here
        raise ModelRefused(f"{type(config).__name__} ({config.model_type})",
                           "an encoder-decoder: its decoder cross-attends to its encoder's states, so it has no "
                           "decoder-only forward of the tokens to read")
    torch_dtype = resolve_dtype(dtype, torch_device, config)
    tokenizer = load_tokenizer(source, revision, trust_remote_code)
    if chat_template is not None:
        if tokenizer is None:
            raise ValueError(f"{source} has no tokenizer, so a chat template cannot be used with it")
        tokenizer.chat_template = chat_template
    scheme = quantization_scheme(config)
    devices = split_devices(torch_device, stages or (1 if scheme is not None else 0))  # quantized: split if asked
    if scheme is not None and len(devices) > 1:
        raise ModelRefused(type(config).__name__, f"{scheme.describe()}: a quantized checkpoint is not split over "
                           "stages yet (serve it on one device: --split-stages 1)")
    plans, placement = None, str(torch_device)
    if len(devices) > 1:
        plans, placement = split_plan(empty_model(config, trust_remote_code), devices, token_budget, captured_layers,
                                      torch_dtype)
    folder = checkpoint_folder(source, revision)  # fingerprinted before the weights are read: a rewrite
    fingerprint = weights_fingerprint(folder) if folder is not None else None  # during the load costs a recompute
    rss_before, started = peak_rss_bytes(), time.monotonic()
    if scheme is not None:
        model, quantized, quantized_experts = load_quantized_checkpoint(source, config, scheme, torch_device,
                                                                        torch_dtype)
        choice = choose_compute(scheme, quantized, torch_device, torch_dtype, quant_compute)
        compute = choice.path.value
        if quantized_experts and quantized and choice.path.value == "fp8":
            compute = FP8_DENSE_DEQUANT_EXPERTS
        log.info("quantized checkpoint: %s, kept quantized on %s (%d Linear layers, %d experts modules); "
                 "compute: %s%s", scheme.describe(), torch_device, len(quantized), quantized_experts,
                 choice.describe(), "; experts dequantized layer by layer just in time" if quantized_experts else "")
    else:
        # device_map streams each tensor from the checkpoint to the device (no host copy of the model);
        # a split (--gpus-per-worker, --split-stages) places each stage's layers on its device.
        options = dict(revision=revision, trust_remote_code=trust_remote_code, dtype=torch_dtype,
                       device_map=placement, output_loading_info=True)
        try:
            try:
                model, loading_info = auto_class(config).from_pretrained(source, **options)
            except ValueError as exc:
                if "does not support an attention implementation" not in str(exc):
                    raise
                log.warning("%s; loading it with transformers' eager attention instead", str(exc).split(". ")[0])
                model, loading_info = auto_class(config).from_pretrained(source, attn_implementation="eager",
                                                                         **options)
        except ValueError as exc:
            if "Unrecognized configuration class" in str(exc):
                raise ModelRefused(f"{type(config).__name__} ({config.model_type})",
                                   "transformers has no causal LM class for it, so it has no decoder to read") from None
            raise
        refuse_unloaded_weights(model, loading_info)
        refuse_image_only(model)
    if plans is not None:
        place(model, placement, dispatched=True)  # type: ignore[arg-type]
    report = LoadReport(time.monotonic() - started, rss_before, peak_rss_bytes(), weights_bytes(model))
    log.info("%s: %s", source, report.describe())
    loaded = with_split(describe(model, tokenizer, name=name or source, source=source, revision=revision,
                                 batching=batching, fingerprint=fingerprint), plans)
    loaded.load_report = report
    loaded.processor, loaded.processor_problem = load_processor(model, source, revision, trust_remote_code)
    if type(model).__name__.endswith("ForConditionalGeneration"):
        loaded.image_batching = plan_image_batching(model)
    loaded.experts = experts_implementation(model)
    if loaded.experts is not None:
        log.info("experts: %s (grouped_mm: one grouped matmul per projection over the tokens each expert got; "
                 "an expert no token chose costs nothing)", loaded.experts)
    if scheme is not None:
        loaded.quantization, loaded.quant_compute = scheme, compute
    return loaded


def refuse_unloaded_weights(model: nn.Module, loading_info: dict[str, Any]) -> None:
    """Raise :class:`ModelRefused` where ``from_pretrained`` left weights of ``model`` out of its
    checkpoint (missing, or of another shape): transformers initializes those at random and only
    logs it, so every file would hold states of a model the checkpoint is not."""
    unloaded = sorted(set(loading_info.get("missing_keys") or ()) | {
        entry[0] if isinstance(entry, tuple) else entry for entry in loading_info.get("mismatched_keys") or ()})
    if unloaded:
        shown = ", ".join(unloaded[:3]) + (f" and {len(unloaded) - 3} more" if len(unloaded) > 3 else "")
        raise ModelRefused(type(model).__name__, f"{len(unloaded)} of its weights are not in its checkpoint as its "
                           f"class names them ({shown}): transformers would initialize them at random, so the "
                           "files would not be the checkpoint's model")


def refuse_image_only(model: nn.Module) -> None:
    """Raise :class:`ModelRefused` for a model whose ``forward`` requires ``pixel_values`` (BLIP,
    BLIP-2, InstructBLIP): it computes nothing for text alone, and its text decoder run bare may
    not be run as it runs it (BLIP's attends both ways unless its parent says ``is_decoder``)."""
    parameter = inspect.signature(type(model).forward).parameters.get("pixel_values")
    if parameter is not None and parameter.default is inspect.Parameter.empty:
        raise ModelRefused(type(model).__name__, "its forward requires pixel_values: it computes nothing for text "
                           "alone, so there are no text states of it to read")


def split_devices(device: torch.device, stages: int) -> list[str]:
    """The device of each stage, one entry when the model is not split. ``device`` ``cuda`` without
    an index means the visible GPUs (one worker over ``--gpus-per-worker`` of them); ``stages`` 0:
    one per visible GPU, fewer: the first that many GPUs, more: they share the devices in order
    (``--split-stages 2`` on one GPU, or on the CPU)."""
    from layertap.worker.model.split.placement import stage_devices

    if device.type == "cuda" and device.index is None:
        visible = [f"cuda:{index}" for index in range(max(1, torch.cuda.device_count()))]
    else:
        visible = [str(device)]
    stages = stages or len(visible)
    return stage_devices(visible[:stages], stages)


def empty_model(config: Any, trust_remote_code: bool, dtype: torch.dtype | None = None) -> nn.Module:
    """The checkpoint's model class with its parameters on the meta device (no memory; buffers
    real): its module tree and sizes."""
    from accelerate import init_empty_weights

    with init_empty_weights():
        return auto_class(config).from_config(config, trust_remote_code=trust_remote_code,
                                              **({"dtype": dtype} if dtype is not None else {}))


def split_plan(model: nn.Module, devices: list[str], token_budget: int, captured_layers: int | None,
               dtype: torch.dtype | None = None) -> tuple[list, dict[str, str]]:
    """Stages of ``model`` (built, or on the meta device) over ``devices`` and the device map placing
    them; the first stage also holds a batch's staging tensor (``token_budget`` tokens of
    ``captured_layers``, default EAGLE-3's count). ``dtype``: the weights' once loaded (default: the model's)."""
    config = model.config.get_text_config()
    decoder, layers = find_decoder_layers(model, block_count(model, config))
    dtype = dtype or next(model.parameters()).dtype
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd")
    captured = captured_layers or len(eagle3_layer_ids(len(layers)))
    return plan_split(model, layers, find_final_norm(decoder), dtype, devices, len(devices),
                      token_budget * captured * hidden * dtype.itemsize)


def with_split(loaded: LoadedModel, plans: list | None) -> LoadedModel:
    """``loaded`` with its stages installed (``plans`` None: not split); logs them and each GPU's memory."""
    if plans is None:
        return loaded
    loaded.split = ModelSplit(plans, loaded.decoder, loaded.layers)
    loaded.capture.gather, loaded.capture.send = loaded.split.gather, loaded.split.send
    log.info("split over %d stages: %s", len(plans), loaded.split.describe())
    return loaded


def experts_implementation(model: nn.Module) -> str | None:
    """transformers' experts implementation the model runs (it picks ``grouped_mm`` where the kernel
    dispatches, else ``eager``, which loops over the experts chosen); None for a model without experts."""
    if not any(type(module).__name__.endswith("Experts") for module in model.modules()):
        return None
    return str(getattr(model.config.get_text_config(), "_experts_implementation", None) or "eager")


def weights_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers as they sit on the device."""
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def quantization_scheme(config: Any) -> QuantScheme | None:
    """The checkpoint's quantization (None: unquantized); a declared one that is not served is a refusal."""
    try:
        return scheme_of(config)
    except UnsupportedQuantization as exc:
        raise ModelRefused(f"{type(config).__name__} ({config.model_type})", str(exc)) from None


def load_quantized_checkpoint(source: str, config: Any, scheme: QuantScheme, device: torch.device,
                              dtype: torch.dtype) -> tuple[nn.Module, list, int]:
    """A quantized checkpoint folder streamed onto ``device`` (``layertap.worker.model.quant.load``); refusals name the cause."""
    from layertap.worker.model.quant.load import load_quantized

    folder = Path(source)
    if not folder.is_dir():
        raise ModelRefused(type(config).__name__, f"{scheme.describe()}: quantized checkpoints are read from a local "
                           "folder (download it first); nothing is fetched at run time")
    try:
        return load_quantized(folder, config, scheme, device, dtype)
    except UnsupportedQuantization as exc:
        raise ModelRefused(type(config).__name__, str(exc)) from None
