"""Attention over packed sequences: many prompts in one row, none attending to another.

Registered with transformers' ``AttentionInterface`` under :data:`ATTENTION_NAME`.
The engine concatenates prompts into one row, restarts ``position_ids`` at each prompt
and declares the boundaries with :func:`packed_sequences` (a list of ints on the
engine thread, so no device sync and nothing for ``torch.compile`` to guard on). Each prompt then
gets causal SDPA on its own slice: the same kernel and the same numbers as running it
alone, with no padding and no quadratic mask. transformers builds no mask for an
implementation it has no mask function for, which is what we want.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

ATTENTION_NAME = "layertap_packed"
_state = threading.local()
#: On a GPU: flash first. cuDNN's SDPA builds a plan per new sequence length, and packed
#: prompts of mixed lengths make nearly every call a new length (measured on an H200:
#: 13.5k tokens/s with cuDNN chosen, ~30k with flash, on Qwen3-8B prompts of 128-2047).
CUDA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@contextlib.contextmanager
def packed_sequences(bounds: list[int]) -> Iterator[None]:
    """Within the block, forwards on this thread treat the row as sequences ``bounds[i]:bounds[i+1]``."""
    _state.bounds = bounds
    try:
        yield
    finally:
        _state.bounds = None


class UnsupportedAttention(RuntimeError):
    """The model needs an attention feature (e.g. logit softcapping) this path does not do."""


def _sliding_mask(length: int, window: int, device: torch.device) -> torch.Tensor:
    """Boolean [L, L] mask: causal and at most ``window`` tokens back (True = attend)."""
    index = torch.arange(length, device=device)
    distance = index[:, None] - index[None, :]
    return (distance >= 0) & (distance < window)


@torch.compiler.disable
def packed_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """``query``/``key``/``value`` are ``[1, heads, T, dim]``; returns ``[1, T, heads, dim]``."""
    if softcap is not None:
        raise UnsupportedAttention("attention logit softcapping is not supported by packed attention")
    bounds = getattr(_state, "bounds", None)
    total = query.shape[2]
    if bounds is None:
        bounds = [0, total]
    gqa = query.shape[1] != key.shape[1]
    output = query.new_empty(query.shape[0], total, query.shape[1], query.shape[3])
    backends = sdpa_kernel(CUDA_BACKENDS) if query.is_cuda else contextlib.nullcontext()
    with backends:
        _attend_each(query, key, value, output, bounds, scaling, sliding_window, gqa)
    return output, None


def _attend_each(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, output: torch.Tensor,
                 bounds: list[int], scaling: float | None, sliding_window: int | None, gqa: bool) -> None:
    """Causal SDPA on each packed sequence's slice, written into ``output`` ``[1, T, heads, dim]``."""
    for start, end in zip(bounds[:-1], bounds[1:]):
        length = end - start
        mask = None
        if sliding_window is not None and length > sliding_window:
            mask = _sliding_mask(length, sliding_window, query.device)
        part = F.scaled_dot_product_attention(
            query[:, :, start:end], key[:, :, start:end], value[:, :, start:end],
            attn_mask=mask, is_causal=mask is None, scale=scaling, enable_gqa=gqa,
        )
        output[:, start:end] = part.transpose(1, 2)


def register() -> None:
    """Make :data:`ATTENTION_NAME` known to transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, packed_attention)


def use_packed_attention(model: nn.Module) -> None:
    """Switch a loaded model to packed attention."""
    register()
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(ATTENTION_NAME)
    else:
        model.config._attn_implementation = ATTENTION_NAME
