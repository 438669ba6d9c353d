"""Attention for vision towers that cut their patches into sequences by ``cu_seqlens``
(Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5): one variable-length flash call per layer.

Registered with transformers' ``AttentionInterface`` under :data:`VISION_ATTENTION_NAME`,
and set on the vision sub-config only. These towers test their implementation's name with
``is_flash_attention_requested`` (a substring test for ``"flash"``): on a flash name they
hand the attention function every image's (Qwen2.5-VL: every window's) boundaries as
``cu_seq_lens_q``/``max_length_q``; on any other name they split q/k/v per sequence and call
the function once per image or window (Qwen2.5-VL's windowed layers: about 60 calls per
1,000-token image per layer, thousands of small kernels per batch). Two ways to attend,
both bidirectional within a sequence and blind across sequences:

* on a GPU that runs flash attention (bf16/fp16, compute capability 8.0+): one
  non-causal variable-length flash call (aten's ``_flash_attention_forward``, as
  ``layertap.worker.model.attention`` does for text), the boundaries as given, wrapped as the
  custom op ``layertap::vision_varlen_flash`` so that a compiled tower block
  (``compile_decoder_layers``) holds it in its graph instead of breaking around it (a break
  costs two more compiled regions to enter per block and image: host time that outran the
  GPU on an H200);
* otherwise exactly what transformers does under ``"sdpa"``: the same split, the same
  ``sdpa_attention_forward`` call per sequence, the same concatenation (the same numbers).

:func:`choose_vision_attention` picks it at load time for towers on a GPU in bf16/fp16 whose
own implementation is ``"sdpa"``; :func:`vision_attention` applies it around a forward with
images (the whole-model attention switches of ``layertap.worker.model.loading`` reset sub-configs).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from layertap.worker.model.attention import FLASH_DTYPES, flash_takes, runs_flash
from layertap.worker.model.vision.towers import vision_module

#: Contains "flash": what makes the towers pass ``cu_seq_lens_q`` (see the module docstring).
VISION_ATTENTION_NAME = "layertap_vision_varlen_flash"
#: The only implementation it stands in for (its fallback).
REPLACED = "sdpa"


@torch.library.custom_op("layertap::vision_varlen_flash", mutates_args=())
def vision_varlen_flash(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
                        max_seqlen: int, scale: float) -> torch.Tensor:
    """Non-causal flash attention within each sequence ``cu_seqlens`` bounds: ``[T, heads, dim]``
    in and out (the last dim contiguous)."""
    return torch.ops.aten._flash_attention_forward(query, key, value, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                                   0.0, False, False, scale=scale)[0]


@vision_varlen_flash.register_fake
def _vision_varlen_flash_shape(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
                               max_seqlen: int, scale: float) -> torch.Tensor:
    return query.new_empty(query.shape)


@torch.compiler.disable
def _per_sequence_sdpa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       cu_seq_lens_q: torch.Tensor, **options: Any) -> torch.Tensor:
    """What the tower does under ``"sdpa"``: SDPA on each sequence alone, concatenated."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    lengths = (cu_seq_lens_q[1:] - cu_seq_lens_q[:-1]).tolist()
    splits = [torch.split(tensor, lengths, dim=2) for tensor in (query, key, value)]
    outputs = [ALL_ATTENTION_FUNCTIONS[REPLACED](module, q, k, v, **options)[0] for q, k, v in zip(*splits)]
    return torch.cat(outputs, dim=1)


@torch.compiler.disable
def _whole_sdpa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                **options: Any) -> tuple[torch.Tensor, Any]:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[REPLACED](module, query, key, value, **options)


def vision_varlen_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    max_length_q: int | None = None,
    max_length_k: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``query``/``key``/``value`` ``[1, heads, T, dim]`` holding the sequences that
    ``cu_seq_lens_q`` bounds (int32 ``[n + 1]``); returns ``[1, T, heads, dim]``. Traceable by
    ``torch.compile`` on the flash path (``max_length_q`` a Python int, as the towers pass it;
    the card's capability checked once, by :func:`choose_vision_attention`)."""
    options = dict(attention_mask=attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs)
    if cu_seq_lens_q is None:  # an attention that names no sequences: plain SDPA over all of it
        return _whole_sdpa(module, query, key, value, **options)
    if (flash_takes(query) and attention_mask is None and not is_causal and not dropout
            and cu_seq_lens_k is cu_seq_lens_q and query.shape == key.shape == value.shape
            and max_length_q is not None and cu_seq_lens_q.dtype == torch.int32):
        # [1, H, T, D] -> [T, H, D]: views of what the tower transposed from [T, H, D].
        q, k, v = (tensor[0].transpose(0, 1) for tensor in (query, key, value))
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return vision_varlen_flash(q, k, v, cu_seq_lens_q, int(max_length_q), float(scale))[None], None
    return _per_sequence_sdpa(module, query, key, value, cu_seq_lens_q, **options), None


def register() -> None:
    """Make :data:`VISION_ATTENTION_NAME` known to transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(VISION_ATTENTION_NAME, vision_varlen_attention)


def vision_config(model: nn.Module) -> Any | None:
    """The config of ``model``'s vision tower where its attention takes ``cu_seqlens`` (the
    towers this module serves), else None."""
    module = vision_module(model, "cu_seqlens")
    return None if module is None else module.config


def choose_vision_attention(model: nn.Module, device: torch.device, dtype: torch.dtype) -> str | None:
    """:data:`VISION_ATTENTION_NAME` for ``model``'s vision tower where it pays (a tower that
    takes ``cu_seqlens``, on a GPU of compute capability 8.0+, in bf16/fp16, whose
    implementation is ``"sdpa"``), else
    None (the tower keeps transformers' choice). Call before any whole-model switch."""
    config = vision_config(model)
    if config is None or device.type != "cuda" or dtype not in FLASH_DTYPES:
        return None
    if torch.cuda.is_available() and not runs_flash(device):
        return None  # a card older than Ampere
    if getattr(config, "_attn_implementation", None) != REPLACED:
        return None
    register()
    return VISION_ATTENTION_NAME


@contextlib.contextmanager
def vision_attention(model: nn.Module, name: str | None) -> Iterator[None]:
    """Within the block ``model``'s vision tower runs ``name`` (from :func:`choose_vision_attention`;
    nothing changes for None); after it, what it ran before."""
    config = getattr(model.config, "vision_config", None) if name is not None else None
    if config is None:
        yield
        return
    before = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = before
