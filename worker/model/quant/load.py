"""Stream a quantized checkpoint onto the device, shard by shard, without a host copy.

The model is built with its parameters on the ``meta`` device (buffers such as rotary
frequencies are computed for real, they are small), every Linear whose checkpoint weight
has a scale beside it becomes a :class:`QuantLinear`, and each safetensors shard is opened
straight onto the device (``safe_open(device=...)``): one tensor at a time passes through
host memory (the file's pages), never the model. Names are the checkpoint's own (what
``save_pretrained`` and the FP8 exporters write); a parameter the checkpoint lacks, or a
tensor the model has no place for, is an error that names it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from layertap.worker.model.quant.experts import EXPERT_KEY, Fp8Experts, fp8_experts
from layertap.worker.model.quant.fp8 import QuantLinear
from layertap.worker.model.quant.mxfp4 import keep_experts_quantized
from layertap.worker.model.quant.scheme import MXFP4_METHOD, QuantScheme, UnsupportedQuantization

log = logging.getLogger(__name__)
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
#: Checkpoint tensors a served model has no use for: static activation scales (activations are quantized
#: dynamically per token or group, or not at all on the dequant path) and old per-layer rotary buffers.
UNUSED_SUFFIXES = (".input_scale", ".activation_scale", ".k_scale", ".v_scale", "rotary_emb.inv_freq")


def checkpoint_shards(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder: each file its index names, once, sorted by name."""
    index = folder / INDEX_FILE
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / name for name in names]
    if (folder / SINGLE_FILE).exists():
        return [folder / SINGLE_FILE]
    raise UnsupportedQuantization(f"{folder}: no {SINGLE_FILE} or {INDEX_FILE}: a quantized checkpoint is read "
                                  "from safetensors files only")


def checkpoint_keys(shards: list[Path]) -> set[str]:
    """Every tensor name in ``shards``, from their headers (no tensor is read)."""
    keys: set[str] = set()
    for shard in shards:
        with safe_open(str(shard), framework="pt") as handle:
            keys.update(handle.keys())
    return keys


def quantized_linears(model: nn.Module, keys: set[str], scheme: QuantScheme) -> list[QuantLinear]:
    """Replace each Linear whose checkpoint weight has a ``scheme.scale_name`` beside it by a
    :class:`QuantLinear` (on ``meta``, to be filled from the checkpoint)."""
    replaced = []
    for key in sorted(keys):
        if not key.endswith("." + scheme.scale_name) or EXPERT_KEY.match(key):
            continue
        name = key.removesuffix("." + scheme.scale_name)
        try:
            module = model.get_submodule(name)
        except AttributeError:
            raise UnsupportedQuantization(f"the checkpoint has a quantized {name} that the model has no module "
                                          "for (quantized experts and renamed modules are not served)") from None
        if not isinstance(module, nn.Linear):
            raise UnsupportedQuantization(f"the checkpoint quantizes {name}, a {type(module).__name__}: only "
                                          "Linear layers are served quantized")
        layer = QuantLinear(module.in_features, module.out_features, scheme, bias=module.bias is not None,
                            device="meta")
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, layer)
        replaced.append(layer)
    if not replaced and not any(EXPERT_KEY.match(key) for key in keys):
        raise UnsupportedQuantization(f"the config declares {scheme.describe()} but no weight has a "
                                      f"{scheme.scale_name} beside it")
    return replaced


def device_name(device: torch.device) -> str:
    """``device`` as safetensors names it (a CUDA device with its index)."""
    if device.type == "cuda" and device.index is None:
        return f"cuda:{torch.cuda.current_device()}"
    return str(device)


def _place(model: nn.Module, key: str, tensor: torch.Tensor, dtype: torch.dtype) -> bool:
    """Put ``tensor`` where ``key`` names; False when the model has no such parameter or buffer."""
    owner_name, _, attr = key.rpartition(".")
    try:
        owner = model.get_submodule(owner_name) if owner_name else model
    except AttributeError:
        return False
    if attr in owner._parameters:
        current = owner._parameters[attr]
        value = tensor if tensor.dtype == torch.float8_e4m3fn else tensor.to(dtype)
        if current is not None and tuple(current.shape) != tuple(value.shape):
            raise UnsupportedQuantization(f"{key}: checkpoint shape {tuple(value.shape)}, model {tuple(current.shape)}")
        owner._parameters[attr] = nn.Parameter(value, requires_grad=False)
        return True
    if attr in owner._buffers and owner._buffers[attr] is not None:
        current = owner._buffers[attr]
        if tuple(current.shape) != tuple(tensor.shape):
            raise UnsupportedQuantization(f"{key}: checkpoint shape {tuple(tensor.shape)}, "
                                          f"model {tuple(current.shape)}")
        owner._buffers[attr] = tensor.to(current.dtype)
        return True
    return False


def load_quantized(folder: Path, config: Any, scheme: QuantScheme, device: torch.device,
                   dtype: torch.dtype) -> tuple[nn.Module, list[QuantLinear], int]:
    """The causal LM of ``folder`` on ``device``: quantized Linears stay e4m3 with their scales
    (returned), FP8 experts stay e4m3 (``layertap.worker.model.quant.experts``), MXFP4 experts stay 4-bit
    (``layertap.worker.model.quant.mxfp4``), every other weight in ``dtype``. Returns the model, its
    :class:`QuantLinear` layers and how many experts modules stay quantized (always dequantized per
    forward). ``config`` is the checkpoint's config, its ``quantization_config`` already parsed into
    ``scheme`` (it is removed so transformers does not take the checkpoint over)."""
    from transformers import AutoModelForCausalLM

    shards = checkpoint_shards(folder)
    keys = checkpoint_keys(shards)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    from accelerate import init_empty_weights

    with init_empty_weights():  # parameters on meta (no memory, no initialisation); buffers real
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    experts: dict[str, Fp8Experts] = {}
    mxfp4_experts = 0
    try:
        if scheme.method == MXFP4_METHOD:
            mxfp4_experts = len(keep_experts_quantized(model, keys, dtype))
            layers: list[QuantLinear] = []
        else:
            layers = quantized_linears(model, keys, scheme)
            experts = fp8_experts(model, keys, scheme, device, dtype)
        unexpected = []
        for shard in shards:
            with safe_open(str(shard), framework="pt", device=device_name(device)) as handle:
                for key in handle.keys():
                    tensor = handle.get_tensor(key)
                    expert = EXPERT_KEY.match(key)
                    if expert and expert["module"] in experts:
                        experts[expert["module"]].place(int(expert["index"]), expert["proj"], expert["tensor"], tensor)
                    elif not _place(model, key, tensor, dtype) and not key.endswith(UNUSED_SUFFIXES):
                        unexpected.append(key)
    except ValueError as exc:
        raise UnsupportedQuantization(str(exc)) from None
    incomplete = [name for name, stack in experts.items() if stack.missing()]
    if incomplete:
        raise UnsupportedQuantization(f"the checkpoint lacks expert weights of {incomplete[:3]}")
    if unexpected:
        raise UnsupportedQuantization(f"{len(unexpected)} checkpoint tensors have no place in "
                                      f"{type(model).__name__}, e.g. {unexpected[:3]}")
    model.tie_weights()
    missing = [name for name, tensor in [*model.named_parameters(), *model.named_buffers()]
               if tensor.device.type == "meta"]
    if missing:
        raise UnsupportedQuantization(f"the checkpoint lacks {len(missing)} weights of {type(model).__name__}, "
                                      f"e.g. {missing[:3]}")
    model.to(device)  # the buffers built on the host (rotary frequencies); weights are there already
    return model.eval(), layers, len(experts) + mxfp4_experts
