"""Loading a causal LM once: ``from_pretrained`` (or a config-only shape), its parts found
(``parts``), its batching layout chosen, the capture hooks registered, and what it was loaded
from fingerprinted (``fingerprints``), as a :class:`LoadedModel`.

A vision-language checkpoint (one saved as ``...ForConditionalGeneration``: Qwen-VL, Gemma 3,
LLaVA, Llama 4, Qwen3.5...) loads as that class, vision tower included (its processor, towers
and image batching: ``layertap.worker.model.vision``), and its text decoder (the innermost
``get_decoder()``) is what the engine runs for text and token-id jobs. The batching path is
chosen here too (``layertap.worker.model.batching``), and the model switched to packed attention
only when packing is exact for it; otherwise it keeps the attention implementation transformers
gave it. A quantized checkpoint loads through ``layertap.worker.model.quant``, a split one over
its stages through ``layertap.worker.model.split.plans``.

Every change to the model happens at load (here) or through ``modes`` (the served layout,
transformers' own attention for a reference run, ``torch.compile``, a tower's CUDA graphs). The
engine only runs the model.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from layertap.protocol.fileformat import MetaKey
from layertap.worker.model.attention import set_attention
from layertap.worker.model.batching import ModelRefused, plan_batching
from layertap.worker.model.capture import LayerCapture, UncapturableStream, probe_stream
from layertap.worker.model.classes import auto_class
from layertap.worker.model.devices import resolve_device, resolve_dtype
from layertap.worker.model.fingerprints import parameters_fingerprint, tokenizer_fingerprint, weights_fingerprint
from layertap.worker.model.host_memory import LoadReport, peak_rss_bytes
from layertap.worker.model.layouts.base import BatchLayout
from layertap.worker.model.parts import (
    block_count,
    experts_implementation,
    find_decoder_layers,
    find_final_norm,
    weights_bytes,
)
from layertap.worker.model.quant.fp8 import choose_compute
from layertap.worker.model.quant.scheme import QuantScheme, UnsupportedQuantization, scheme_of
from layertap.worker.model.split.plans import empty_model, split_devices, split_plan, with_split
from layertap.worker.model.split.stages import ModelSplit, place
from layertap.worker.model.vision.aligned_mlp import align_tower_mlps
from layertap.worker.model.vision.attention import choose_vision_attention
from layertap.worker.model.vision.inputs import plan_image_batching, rope_index_module
from layertap.worker.model.vision.processors import load_processor
from layertap.worker.model.vision.tower_graphs import TowerGraphs
from layertap.worker.model.vision.towers import grid_tower

log = logging.getLogger(__name__)

#: Any of these in a model folder means it has a tokenizer (fast, slow or its config).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")
#: ``quant_compute`` of a checkpoint whose dense Linears run fp8 matmuls while its experts are dequantized.
FP8_DENSE_DEQUANT_EXPERTS = "fp8-dense-dequant-experts"


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
    batching: BatchLayout  # how jobs share a forward (``layertap.worker.model.layouts``; ``modes.use_layout``)
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
    # the grid tower's CUDA graphs by image size (``vision.tower_graphs``), GPU only
    tower_graphs: TowerGraphs | None = None
    compiled: bool = False  # decoder layers run torch.compile's code (``modes.compile_decoder_layers``)

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
        # use_kernels=False: transformers 5.25 swaps a CUDA model's norms, activations and RoPE for the
        # `kernels` library's by default, fetched from the hub at load (fails offline; code from the hub
        # would compute the files). The model runs its own code.
        options = dict(revision=revision, trust_remote_code=trust_remote_code, dtype=torch_dtype,
                       device_map=placement, output_loading_info=True, use_kernels=False)
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


def quantization_scheme(config: Any) -> QuantScheme | None:
    """The checkpoint's quantization (None: unquantized); a declared one that is not served is a refusal."""
    try:
        return scheme_of(config)
    except UnsupportedQuantization as exc:
        raise ModelRefused(f"{type(config).__name__} ({config.model_type})", str(exc)) from None


def load_quantized_checkpoint(source: str, config: Any, scheme: QuantScheme, device: torch.device,
                              dtype: torch.dtype) -> tuple[nn.Module, list, int]:
    """A quantized checkpoint folder streamed onto ``device`` (``layertap.worker.model.quant.load``); refusals
    name the cause."""
    from layertap.worker.model.quant.load import load_quantized

    folder = Path(source)
    if not folder.is_dir():
        raise ModelRefused(type(config).__name__, f"{scheme.describe()}: quantized checkpoints are read from a local "
                           "folder (download it first); nothing is fetched at run time")
    try:
        return load_quantized(folder, config, scheme, device, dtype)
    except UnsupportedQuantization as exc:
        raise ModelRefused(type(config).__name__, str(exc)) from None
