"""Loading a causal LM once and finding its parts: decoder layers, final norm, sizes.

Decoder layers are found structurally (the ``nn.ModuleList`` of ``num_hidden_layers``
blocks inside the text decoder, alike or not: hybrids such as Jamba mix block classes),
so Llama, Qwen, Mistral, Gemma, Phi, GPT-2/NeoX-style, hybrid and multimodal wrappers
work without a table of attribute paths. The batching path is chosen here too
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
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from producer.protocol.dtypes import AUTO, COMPUTE_DTYPES, normalize_dtype
from worker.model.attention import set_attention
from worker.model.batching import ModelRefused, plan_batching
from worker.model.capture import LayerCapture, UncapturableStream, probe_stream
from worker.model.layouts.base import BatchLayout

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
    batching: BatchLayout  # how jobs share a forward (``worker.model.layouts``); see use_layout
    native_attention: str  # the attention implementation transformers chose (the self-check's reference)
    capture: LayerCapture  # the hooks that copy layers out during the engine's forwards

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


def find_decoder_layers(model: nn.Module, num_layers: int) -> tuple[nn.Module, nn.ModuleList]:
    """Return ``(decoder, layers)``: the text decoder module and its list of ``num_layers``
    blocks (the shallowest such list with weights in every block; the blocks may differ in
    class, as in hybrids). Raises :class:`ModelRefused` when there is none."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    base = getattr(model, "base_model", model)
    # get_decoder() is the text decoder, unless a model names another part so (ModernBERT-decoder's output Linear)
    scopes = [(decoder, decoder), (base, base), (model, base)] if isinstance(decoder, nn.Module) else [(base, base),
                                                                                                      (model, base)]
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


def describe(model: nn.Module, tokenizer: Any | None, *, name: str, source: str,
             revision: str | None = None, batching: str = "auto") -> LoadedModel:
    """Wrap an already-built model (eval mode, no grads) as a :class:`LoadedModel`, choose its
    batching layout (``batching``: auto or a layout's name), switch it to the layout's attention,
    and register the capture hooks. Raises :class:`ModelRefused` (one line) for a
    model that cannot be served."""
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
        capture=capture,
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


def load_model(source: str, *, name: str | None = None, device: str = "auto", dtype: str = "auto",
               revision: str | None = None, trust_remote_code: bool = False,
               chat_template: str | None = None, batching: str = "auto") -> LoadedModel:
    """Load model and tokenizer once with ``from_pretrained`` (local folder or hub id), or
    build a config-only shape with random weights (``shape:qwen3-8b``, see ``worker.model.shapes``).
    ``chat_template`` (Jinja text) replaces the tokenizer's own template. The model keeps
    the attention implementation transformers picks for it (SDPA where it has one, else
    its own), and is switched to packed attention only where packing is exact."""
    from transformers import AutoConfig, AutoModelForCausalLM

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
    options = dict(revision=revision, trust_remote_code=trust_remote_code, dtype=torch_dtype,
                   device_map="auto" if split else None)
    try:
        try:
            model = AutoModelForCausalLM.from_pretrained(source, **options)
        except ValueError as exc:
            if "does not support an attention implementation" not in str(exc):
                raise
            log.warning("%s; loading it with transformers' eager attention instead", str(exc).split(". ")[0])
            model = AutoModelForCausalLM.from_pretrained(source, attn_implementation="eager", **options)
    except ValueError as exc:
        if "Unrecognized configuration class" in str(exc):
            raise ModelRefused(f"{type(config).__name__} ({config.model_type})",
                               "transformers has no causal LM class for it, so it has no decoder to read") from None
        raise
    if not split:  # several visible GPUs (--gpus-per-worker): device_map spread the layers
        model = model.to(torch_device)
    return describe(model, tokenizer, name=name or source, source=source, revision=revision, batching=batching)
