"""Loading a causal LM once and finding its parts: decoder layers, final norm, sizes.

Decoder layers are found structurally (the ``nn.ModuleList`` of ``num_hidden_layers``
blocks inside the text decoder, alike or not: hybrids such as Jamba mix block classes),
so Llama, Qwen, Mistral, Gemma, Phi, GPT-2/NeoX-style, hybrid and multimodal wrappers
work without a table of attribute paths. A vision-language checkpoint (one saved as
``...ForConditionalGeneration``: Qwen-VL, Gemma 3, LLaVA, Llama 4, Qwen3.5...) loads as
that class, vision tower included, and its text decoder (the innermost ``get_decoder()``)
is what the engine runs for text and token-id jobs. The batching path is chosen here too
(``worker.model.batching``), and the model switched to packed attention only when packing is
exact for it; otherwise it keeps the attention implementation transformers gave it.

Every change to the model happens here: packed attention, the capture hooks
(``worker.model.capture``, registered once), the switch back to transformers' own
attention for a reference run (:func:`transformers_attention`) and ``torch.compile``
(:func:`compile_decoder_layers`). The engine only runs the model.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from producer.protocol.dtypes import AUTO, COMPUTE_DTYPES, normalize_dtype
from worker.model.attention import set_attention, use_packed_attention
from worker.model.batching import (
    BatchingPath,
    BatchingPlan,
    ModelRefused,
    plan_batching,
)
from worker.model.capture import LayerCapture
from worker.model.classes import auto_class

log = logging.getLogger(__name__)

#: Any of these in a model folder means it has a tokenizer (fast, slow or its config).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")
FINAL_NORM_NAMES = ("norm", "ln_f", "final_layernorm", "final_layer_norm", "norm_f", "final_norm")
#: The torch dtype of each protocol dtype name (``producer.protocol.dtypes``).
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
    batching: BatchingPlan
    native_attention: str  # the attention implementation transformers chose (the self-check's reference)
    capture: LayerCapture  # the hooks that copy layers out during the engine's forwards
    processor: Any | None = None  # a VLM's AutoProcessor (images -> model inputs), None for text models
    processor_problem: str = ""  # why a VLM has no processor (said in its image jobs' errors)

    @property
    def architecture(self) -> str:
        return type(self.model).__name__


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
    for scope in (decoder, model):
        candidates = [
            (name, module) for name, module in scope.named_modules()
            if isinstance(module, nn.ModuleList) and len(module) == num_layers
            and all(any(True for _ in block.parameters()) for block in module)
        ]
        if candidates:
            _, layers = min(candidates, key=lambda item: item[0].count("."))
            return decoder, layers
    raise ModelRefused(type(model).__name__, f"no list of its {num_layers} decoder blocks (num_hidden_layers in "
                       "its config) found, so its layers cannot be read")


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


#: Bytes read from each of a weight file's sample points (start, middle and end of its data).
FINGERPRINT_SAMPLE = 64 * 1024
#: Largest safetensors header hashed whole (a real checkpoint's is well under 1 MiB).
FINGERPRINT_MAX_HEADER = 16 * 1024 * 1024
#: Values sampled from each parameter of a model built in memory (no checkpoint folder).
FINGERPRINT_VALUES = 256


def weights_fingerprint(folder: Path) -> str:
    """A short hash that changes when the checkpoint in ``folder`` is rewritten, read in
    milliseconds whatever its size: for each regular file at its top level (weights, config,
    remote code; links followed, hidden files left out), its name, size and ``mtime_ns``, its
    safetensors header (tensor names, dtypes, shapes, offsets) when it has one, and
    :data:`FINGERPRINT_SAMPLE` bytes at the start, middle and end of its data. A rewrite
    that keeps every size, mtime and sampled byte is not seen; touching the files is enough."""
    digest = hashlib.sha256()
    for file in sorted(folder.iterdir()):
        if file.name.startswith(".") or not file.is_file():
            continue
        stat = file.stat()
        digest.update(f"{file.name}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
        with open(file, "rb") as handle:
            data_start = 0
            if file.suffix == ".safetensors" and stat.st_size >= 8:
                (header_len,) = struct.unpack("<Q", handle.read(8))
                if header_len <= min(FINGERPRINT_MAX_HEADER, stat.st_size - 8):
                    digest.update(handle.read(header_len))
                    data_start = 8 + header_len
            data_size = stat.st_size - data_start
            for offset in {data_start, data_start + max(0, data_size // 2 - FINGERPRINT_SAMPLE // 2),
                           max(data_start, stat.st_size - FINGERPRINT_SAMPLE)}:
                handle.seek(offset)
                digest.update(handle.read(FINGERPRINT_SAMPLE))
    return digest.hexdigest()[:16]


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
    batching path (``batching``: auto, packed or padded), for packed switch it to packed
    attention, and register the capture hooks. Raises :class:`ModelRefused` (one line) for a
    model that cannot be served. ``fingerprint``: the checkpoint's :func:`weights_fingerprint`;
    without it, that of the folder ``source`` when it is one, else :func:`parameters_fingerprint`."""
    config = model.config.get_text_config()
    num_layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None)
    if not num_layers:
        raise ModelRefused(type(model).__name__, "its config names no num_hidden_layers, so its decoder blocks "
                                                 "cannot be found")
    decoder, layers = find_decoder_layers(model, num_layers)
    plan = plan_batching(model, layers, batching)
    native_attention = str(getattr(model.config, "_attn_implementation", None) or "eager")
    if plan.path is BatchingPath.packed:
        use_packed_attention(model)
    model.eval().requires_grad_(False)
    parameter = next(model.parameters())
    vocab_size = model.get_input_embeddings().weight.shape[0]
    final_norm = find_final_norm(decoder)
    hidden_size = getattr(config, "hidden_size", None) or getattr(config, "n_embd")
    capture = LayerCapture(layers, final_norm, hidden_size=hidden_size, dtype=parameter.dtype,
                           device=parameter.device)
    return LoadedModel(
        model=model, decoder=decoder, layers=layers, final_norm=final_norm,
        lm_head=model.get_output_embeddings(),
        tokenizer=tokenizer, name=name, source=source, revision=revision, num_layers=num_layers,
        hidden_size=hidden_size, vocab_size=vocab_size, device=parameter.device, dtype=parameter.dtype,
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer), batching=plan, native_attention=native_attention,
        weights_fingerprint=fingerprint or (weights_fingerprint(Path(source)) if Path(source).is_dir()
                                            else parameters_fingerprint(model)),
        capture=capture,
    )


@contextlib.contextmanager
def transformers_attention(loaded: LoadedModel) -> Iterator[None]:
    """Within the block the model runs the attention implementation transformers chose for it
    (the reference the self-check and the bench compare batching with); after it, packed
    attention again where the model's plan packs (a padded model never leaves its own)."""
    packed = loaded.batching.path is BatchingPath.packed
    if packed:
        set_attention(loaded.model, loaded.native_attention)
    try:
        yield
    finally:
        if packed:
            use_packed_attention(loaded.model)


def compile_decoder_layers(loaded: LoadedModel) -> None:
    """``torch.compile`` each decoder layer's ``forward`` with dynamic shapes: norms, rotary,
    MLP and residual adds fuse; attention stays eager (``packed_attention`` is excluded)
    and the capture hooks stay outside (they run in ``Module.__call__``). Identical layers
    share one compiled graph; the engine's warm-up pays the compile time."""
    for layer in loaded.layers:
        layer.forward = torch.compile(layer.forward, dynamic=True)


def load_tokenizer(source: str, revision: str | None, trust_remote_code: bool) -> Any | None:
    """The model's tokenizer, or None for a local folder that holds weights only (such a
    worker takes ``token_ids`` jobs only). A tokenizer that is there but fails to load raises."""
    from transformers import AutoTokenizer

    folder = Path(source)
    if folder.is_dir() and not any((folder / name).exists() for name in TOKENIZER_FILES):
        log.warning("%s has no tokenizer files: serving token_ids jobs only", source)
        return None
    return AutoTokenizer.from_pretrained(source, revision=revision, trust_remote_code=trust_remote_code)


#: Any of these in a model folder means it has a processor (images, not only text).
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")


def load_processor(model: nn.Module, source: str, revision: str | None,
                   trust_remote_code: bool) -> tuple[Any | None, str]:
    """A vision-language model's ``AutoProcessor`` and '', or None and why there is none
    (a text model, no processor files, or one that fails to load: its image jobs are refused
    with that reason, its text jobs served)."""
    if not type(model).__name__.endswith("ForConditionalGeneration"):
        return None, f"{type(model).__name__} takes no images"
    folder = Path(source)
    if folder.is_dir() and not any((folder / name).exists() for name in PROCESSOR_FILES):
        return None, f"{source} has no processor files ({' or '.join(PROCESSOR_FILES)})"
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(source, revision=revision, trust_remote_code=trust_remote_code), ""
    except (ImportError, OSError, ValueError, TypeError, AttributeError) as exc:
        log.warning("%s: its processor does not load (%s); serving text and token_ids jobs only", source, exc)
        return None, f"its processor does not load ({type(exc).__name__}: {str(exc).strip().splitlines()[0]})"


def load_model(source: str, *, name: str | None = None, device: str = "auto", dtype: str = "auto",
               revision: str | None = None, trust_remote_code: bool = False,
               chat_template: str | None = None, batching: str = "auto") -> LoadedModel:
    """Load model and tokenizer once with ``from_pretrained`` (local folder or hub id), or
    build a config-only shape with random weights (``shape:qwen3-8b``, see ``worker.model.shapes``).
    ``chat_template`` (Jinja text) replaces the tokenizer's own template. The model keeps
    the attention implementation transformers picks for it (SDPA where it has one, else
    its own), and is switched to packed attention only where packing is exact."""
    from transformers import AutoConfig

    from worker.model.shapes import (
        SHAPE_PREFIX,
        build_random_model,
        is_shape,
        shape_config,
    )

    torch_device = resolve_device(device)
    if is_shape(source):
        if chat_template is not None:
            raise ValueError(f"{source} has no tokenizer, so a chat template cannot be used with it")
        shape = source.removeprefix(SHAPE_PREFIX)
        model = build_random_model(shape, torch_device, resolve_dtype(dtype, torch_device, shape_config(shape)))
        return describe(model, None, name=name or source, source=source, batching=batching)
    config = AutoConfig.from_pretrained(source, revision=revision, trust_remote_code=trust_remote_code)
    torch_dtype = resolve_dtype(dtype, torch_device, config)
    tokenizer = load_tokenizer(source, revision, trust_remote_code)
    if chat_template is not None:
        if tokenizer is None:
            raise ValueError(f"{source} has no tokenizer, so a chat template cannot be used with it")
        tokenizer.chat_template = chat_template
    split = torch_device.type == "cuda" and torch_device.index is None and torch.cuda.device_count() > 1
    folder = checkpoint_folder(source, revision)  # fingerprinted before the weights are read: a rewrite
    fingerprint = weights_fingerprint(folder) if folder is not None else None  # during the load costs a recompute
    try:
        model = auto_class(config).from_pretrained(
            source, revision=revision, trust_remote_code=trust_remote_code, dtype=torch_dtype,
            device_map="auto" if split else None,
        )
    except ValueError as exc:
        if "Unrecognized configuration class" in str(exc):
            raise ModelRefused(f"{type(config).__name__} ({config.model_type})",
                               "transformers has no causal LM class for it, so it has no decoder to read") from None
        raise
    if not split:  # several visible GPUs (--gpus-per-worker): device_map spread the layers
        model = model.to(torch_device)
    loaded = describe(model, tokenizer, name=name or source, source=source, revision=revision, batching=batching,
                      fingerprint=fingerprint)
    loaded.processor, loaded.processor_problem = load_processor(model, source, revision, trust_remote_code)
    return loaded
