"""A model split over stages at load: the device of each stage, the stages' plan and device map
(``placement``, ``stages``), and the stages installed on the loaded model."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from layertap.protocol.layers import eagle3_layer_ids
from layertap.worker.model.classes import auto_class
from layertap.worker.model.parts import block_count, find_decoder_layers, find_final_norm
from layertap.worker.model.split.placement import stage_devices
from layertap.worker.model.split.stages import ModelSplit, plan_split

if TYPE_CHECKING:
    from layertap.worker.model.loading import LoadedModel

log = logging.getLogger(__name__)


def split_devices(device: torch.device, stages: int) -> list[str]:
    """The device of each stage, one entry when the model is not split. ``device`` ``cuda`` without
    an index means the visible GPUs (one worker over ``--gpus-per-worker`` of them); ``stages`` 0:
    one per visible GPU, fewer: the first that many GPUs, more: they share the devices in order
    (``--split-stages 2`` on one GPU, or on the CPU)."""
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
