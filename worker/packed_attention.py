"""Attention over packed sequences: many prompts in one row, none attending to another.

Registered with transformers' ``AttentionInterface`` under :data:`ATTENTION_NAME`.
The engine concatenates prompts into one row, restarts ``position_ids`` at each prompt
and passes the boundaries as the ``layertap_seq_bounds`` keyword (a list of ints, so
no device sync), which transformers forwards to every attention call. Each prompt then
gets causal SDPA on its own slice: the same kernel and the same numbers as running it
alone, with no padding and no quadratic mask. transformers builds no mask for an
implementation it has no mask function for, which is what we want.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

ATTENTION_NAME = "layertap_packed"
BOUNDS_KWARG = "layertap_seq_bounds"


class UnsupportedAttention(RuntimeError):
    """The model needs an attention feature (e.g. logit softcapping) this path does not do."""


def _sliding_mask(length: int, window: int, device: torch.device) -> torch.Tensor:
    """Boolean [L, L] mask: causal and at most ``window`` tokens back (True = attend)."""
    index = torch.arange(length, device=device)
    distance = index[:, None] - index[None, :]
    return (distance >= 0) & (distance < window)


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
    bounds = kwargs.get(BOUNDS_KWARG)
    total = query.shape[2]
    if bounds is None:
        bounds = [0, total]
    gqa = query.shape[1] != key.shape[1]
    output = query.new_empty(query.shape[0], total, query.shape[1], query.shape[3])
    for start, end in zip(bounds[:-1], bounds[1:]):  # type: ignore[call-overload]
        length = end - start
        mask = None
        if sliding_window is not None and length > sliding_window:
            mask = _sliding_mask(length, sliding_window, query.device)
        part = F.scaled_dot_product_attention(
            query[:, :, start:end], key[:, :, start:end], value[:, :, start:end],
            attn_mask=mask, is_causal=mask is None, scale=scaling, enable_gqa=gqa,
        )
        output[:, start:end] = part.transpose(1, 2)
    return output, None


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
