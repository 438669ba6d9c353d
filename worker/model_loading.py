"""Loading a causal LM once and finding its parts: decoder layers, final norm, sizes.

Decoder layers are found structurally (the ``nn.ModuleList`` of ``num_hidden_layers``
blocks of one class inside the text decoder), so Llama, Qwen2/3, Mistral, Gemma, Phi,
GPT-2/NeoX-style and multimodal wrappers work without a table of attribute paths.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

FINAL_NORM_NAMES = ("norm", "ln_f", "final_layernorm", "final_layer_norm", "norm_f")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
          "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class ModelStructureError(RuntimeError):
    """The model's decoder layers could not be found."""


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
    if spec != "auto":
        if spec not in DTYPES:
            raise ValueError(f"dtype {spec!r} is not one of {sorted(DTYPES)} or auto")
        return DTYPES[spec]
    if device.type == "cpu":
        return torch.float32
    stored = getattr(config, "dtype", None)
    return stored if stored in (torch.bfloat16, torch.float16) else torch.bfloat16


def find_decoder_layers(model: nn.Module, num_layers: int) -> tuple[nn.Module, nn.ModuleList]:
    """Return ``(decoder, layers)``: the text decoder module and its list of blocks."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    decoder = decoder if isinstance(decoder, nn.Module) else getattr(model, "base_model", model)
    for scope in (decoder, model):
        candidates = [
            (name, module) for name, module in scope.named_modules()
            if isinstance(module, nn.ModuleList) and len(module) == num_layers
            and len({type(block) for block in module}) == 1
        ]
        if candidates:
            _, layers = min(candidates, key=lambda item: item[0].count("."))
            return decoder, layers
    raise ModelStructureError(
        f"{type(model).__name__}: no list of {num_layers} identical decoder blocks found; "
        "this architecture is not supported"
    )


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
             revision: str | None = None) -> LoadedModel:
    """Wrap an already-built model (eval mode, no grads) as a :class:`LoadedModel`."""
    config = model.config.get_text_config()
    num_layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer")
    decoder, layers = find_decoder_layers(model, num_layers)
    model.eval().requires_grad_(False)
    parameter = next(model.parameters())
    vocab_size = model.get_input_embeddings().weight.shape[0]
    return LoadedModel(
        model=model, decoder=decoder, layers=layers, final_norm=find_final_norm(decoder),
        lm_head=model.get_output_embeddings(),
        tokenizer=tokenizer, name=name, source=source, revision=revision, num_layers=num_layers,
        hidden_size=getattr(config, "hidden_size", None) or getattr(config, "n_embd"),
        vocab_size=vocab_size, device=parameter.device, dtype=parameter.dtype,
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
    )


def load_model(source: str, *, name: str | None = None, device: str = "auto", dtype: str = "auto",
               revision: str | None = None, trust_remote_code: bool = False,
               chat_template: str | None = None) -> LoadedModel:
    """Load model and tokenizer once with ``from_pretrained`` (local folder or hub id), or
    build a config-only shape with random weights (``shape:qwen3-8b``, see ``worker.shapes``).
    ``chat_template`` (Jinja text) replaces the tokenizer's own template."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from worker.shapes import SHAPE_PREFIX, build_random_model, is_shape, shape_config

    torch_device = resolve_device(device)
    if is_shape(source):
        if chat_template is not None:
            raise ValueError(f"{source} has no tokenizer, so a chat template cannot be used with it")
        shape = source.removeprefix(SHAPE_PREFIX)
        model = build_random_model(shape, torch_device, resolve_dtype(dtype, torch_device, shape_config(shape)))
        return describe(model, None, name=name or source, source=source)
    config = AutoConfig.from_pretrained(source, revision=revision, trust_remote_code=trust_remote_code)
    torch_dtype = resolve_dtype(dtype, torch_device, config)
    tokenizer = AutoTokenizer.from_pretrained(source, revision=revision, trust_remote_code=trust_remote_code)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    split = torch_device.type == "cuda" and torch_device.index is None and torch.cuda.device_count() > 1
    model = AutoModelForCausalLM.from_pretrained(
        source, revision=revision, trust_remote_code=trust_remote_code, dtype=torch_dtype,
        attn_implementation="sdpa", device_map="auto" if split else None,
    )
    if not split:  # several visible GPUs (--gpus-per-worker): device_map spread the layers
        model = model.to(torch_device)
    return describe(model, tokenizer, name=name or source, source=source, revision=revision)
