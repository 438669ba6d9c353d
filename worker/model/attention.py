"""Attention over packed sequences: many prompts in one row, none attending to another.

Registered with transformers' ``AttentionInterface`` under :data:`ATTENTION_NAME`.
The engine concatenates prompts into one row, restarts ``position_ids`` at each prompt
and declares the boundaries with :func:`packed_sequences` (a list of ints on the
engine thread, so no device sync and nothing for ``torch.compile`` to guard on).
transformers builds no mask for an implementation it has no mask function for, which is
what we want. Two ways to attend, both exact (no padding, no quadratic mask, no prompt
sees another):

* on a GPU that runs flash attention (bf16/fp16, compute capability 8.0+), one
  variable-length causal call per layer over the whole row, with the boundaries as
  cumulative lengths: aten's ``_flash_attention_forward`` (which ``torch.nn.attention.varlen``
  wraps in newer torch; called directly because it takes grouped KV heads in every torch this
  project supports), or NVIDIA's cuDNN frontend (:func:`use_varlen_kernel`, ``cudnn_attention``; by
  default on Hopper cards where the ``cudnn`` extra is installed);
* otherwise causal SDPA on each prompt's own slice: the same kernel and the same numbers
  as running it alone.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from layertap.worker.model import cudnn_attention

ATTENTION_NAME = "layertap_packed"
_state = threading.local()
#: On a GPU: flash first. cuDNN's SDPA builds a plan per new sequence length, and packed
#: prompts of mixed lengths make nearly every call a new length (measured on an H200:
#: 13.5k tokens/s with cuDNN chosen, ~30k with flash, on Qwen3-8B prompts of 128-2047).
CUDA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class WholeRowKeys(Protocol):
    """Each layer's keys and values over the packed rows' whole lengths, where the forward computes
    only each row's last tokens (``layertap.worker.engine.prefix_keys``): row ``i``'s queries are its
    last tokens, its keys ``key_bounds[i]:key_bounds[i + 1]``."""

    key_bounds: list[int]
    longest_key: int

    def extend(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


@contextlib.contextmanager
def packed_sequences(bounds: list[int], keys: WholeRowKeys | None = None) -> Iterator[None]:
    """Within the block, forwards on this thread treat the row as sequences ``bounds[i]:bounds[i+1]``
    (each the last tokens of a longer row whose keys ``keys`` holds, where given)."""
    _state.bounds, _state.keys, _state.cumulative = bounds, keys, {}
    try:
        yield
    finally:
        _state.bounds = _state.keys = _state.cumulative = None


def _cumulative_lengths(bounds: list[int], device: torch.device) -> torch.Tensor:
    """``bounds`` as int32 on ``device``; inside :func:`packed_sequences` copied once per
    forward (every layer reuses it)."""
    cached = getattr(_state, "cumulative", None)
    if cached is not None and (id(bounds), device) in cached:
        return cached[id(bounds), device]
    tensor = torch.tensor(bounds, dtype=torch.int32).pin_memory().to(device, non_blocking=True)
    if cached is not None:  # the forward's own bounds: alive until the block ends
        cached[id(bounds), device] = tensor
    return tensor


#: The variable-length kernels packed attention can call on a GPU (``worker.attention_kernel``):
#: aten's flash attention (FlashAttention 2, in torch), NVIDIA's cuDNN frontend (``cudnn_attention``),
#: or ``auto``: the frontend on compute capability 9.x (Hopper, where it was measured faster) where its
#: extra is installed, else flash. The frontend serves only the queries it ``takes``; flash the rest.
VARLEN_KERNELS = ("auto", "flash", "cudnn")
_varlen_kernel = {"name": "auto"}


def use_varlen_kernel(name: str) -> None:
    """Make packed attention call ``name`` (of :data:`VARLEN_KERNELS`) on a GPU, for every model of
    this process; ``cudnn`` raises :class:`~layertap.extras.MissingExtra` where its extra is missing."""
    if name not in VARLEN_KERNELS:
        raise ValueError(f"attention kernel {name!r} is not one of {', '.join(VARLEN_KERNELS)}")
    if name == "cudnn":
        cudnn_attention.require()
    _varlen_kernel["name"] = name


def attention_kernel() -> str:
    """The kernel packed attention calls on a GPU, as set (:func:`use_varlen_kernel`; may be ``auto``)."""
    return _varlen_kernel["name"]


@functools.lru_cache(maxsize=None)
def _auto_kernel(device: torch.device) -> str:
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9 and cudnn_attention.available():
        return "cudnn"
    return "flash"


def resolved_kernel(device: torch.device) -> str:
    """The kernel packed attention calls on ``device`` for queries the frontend takes (``auto`` resolved)."""
    name = _varlen_kernel["name"]
    return _auto_kernel(device) if name == "auto" else name


def _varlen(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cumulative_q: torch.Tensor,
            cumulative_k: torch.Tensor, longest_q: int, longest_k: int, scale: float | None) -> torch.Tensor:
    """Causal variable-length attention (``[T, heads, dim]`` each; the mask aligned at each sequence's
    end) on the chosen kernel; returns ``[Tq, heads, dim]``."""
    if resolved_kernel(query.device) == "cudnn" and cudnn_attention.takes(query, longest_k):
        return cudnn_attention.varlen(query, key, value, cumulative_q, cumulative_k, longest_q, longest_k, scale)
    return torch.ops.aten._flash_attention_forward(query, key, value, cumulative_q, cumulative_k, longest_q, longest_k,
                                                   0.0, True, False, scale=scale)[0]


#: The dtypes the flash kernel takes.
FLASH_DTYPES = (torch.float16, torch.bfloat16)


@functools.lru_cache(maxsize=None)
def runs_flash(device: torch.device) -> bool:
    """Whether the GPU ``device`` runs the flash kernel (compute capability 8.0+)."""
    return torch.cuda.get_device_capability(device) >= (8, 0)


def flash_takes(query: torch.Tensor) -> bool:
    """Whether the flash kernel takes this query's device type, dtype and head size (not its
    card: :func:`runs_flash`). Plain tensor properties: ``torch.compile`` traces it."""
    return (query.is_cuda and query.dtype in FLASH_DTYPES
            and query.shape[-1] % 8 == 0 and query.shape[-1] <= 256)


def varlen_flash_usable(query: torch.Tensor) -> bool:
    """Whether the variable-length flash kernel takes this query (device, dtype, head size)."""
    return flash_takes(query) and runs_flash(query.device)


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
    if kwargs.get("s_aux") is not None:
        raise UnsupportedAttention("attention sinks are not supported by packed attention")
    if attention_mask is not None:  # transformers builds none for this implementation: the model made its own
        raise UnsupportedAttention("the model hands its attention a mask of its own (a score bias, such as Doge's "
                                   "dynamic mask), which packed attention does not apply")
    bounds = getattr(_state, "bounds", None)
    total = query.shape[2]
    if bounds is None:
        bounds = [0, total]
    keys = getattr(_state, "keys", None)
    if keys is not None:
        return _attend_whole_rows(module, query, key, value, bounds, keys, scaling, sliding_window), None
    if varlen_flash_usable(query) and value.shape[-1] == query.shape[-1]:  # MLA's value heads may be narrower
        longest = max(end - start for start, end in zip(bounds[:-1], bounds[1:]))
        if sliding_window is None or longest <= sliding_window:  # else per-prompt windowed masks
            return _attend_varlen(query, key, value, bounds, longest, scaling), None
    gqa = query.shape[1] != key.shape[1]
    output = query.new_empty(query.shape[0], total, query.shape[1], value.shape[3])
    backends = sdpa_kernel(CUDA_BACKENDS) if query.is_cuda else contextlib.nullcontext()
    with backends:
        _attend_each(query, key, value, output, bounds, scaling, sliding_window, gqa)
    return output, None


def _attend_varlen(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bounds: list[int], longest: int,
                   scaling: float | None) -> torch.Tensor:
    """One causal flash call over the packed row; returns ``[1, T, heads, dim]``. Grouped KV
    heads are passed as they are (flash maps each query head to its KV head)."""
    cumulative = _cumulative_lengths(bounds, query.device)
    # [1, H, T, D] -> [T, H, D]: a view (transformers made these by transposing [1, T, H, D]).
    q, k, v = (tensor[0].transpose(0, 1) for tensor in (query, key, value))
    return _varlen(q, k, v, cumulative, cumulative, longest, longest, scaling)[None]


def _attend_whole_rows(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       bounds: list[int], keys: WholeRowKeys, scaling: float | None,
                       sliding_window: int | None) -> torch.Tensor:
    """Each row's queries (its last tokens) over its keys and values from its first token on
    (causal, aligned at the row's end); returns ``[1, T, heads, dim]``."""
    if sliding_window is not None and keys.longest_key > sliding_window:
        raise UnsupportedAttention("sliding-window attention over cached prefixes is not supported")
    whole_key, whole_value = keys.extend(module.layer_idx, key[0].transpose(0, 1), value[0].transpose(0, 1))
    if varlen_flash_usable(query) and value.shape[-1] == query.shape[-1]:
        longest = max(end - start for start, end in zip(bounds[:-1], bounds[1:]))
        return _varlen(query[0].transpose(0, 1), whole_key, whole_value, _cumulative_lengths(bounds, query.device),
                       _cumulative_lengths(keys.key_bounds, query.device), longest, keys.longest_key, scaling)[None]
    output = query.new_empty(1, query.shape[2], query.shape[1], whole_value.shape[-1])
    backends = sdpa_kernel(CUDA_BACKENDS) if query.is_cuda else contextlib.nullcontext()
    with backends:  # [T, H, D] -> [1, H, T, D]: views
        _attend_each(query, whole_key.transpose(0, 1)[None], whole_value.transpose(0, 1)[None], output, bounds,
                     scaling, None, query.shape[1] != whole_key.shape[1], keys.key_bounds)
    return output


def _attend_each(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, output: torch.Tensor,
                 bounds: list[int], scaling: float | None, sliding_window: int | None, gqa: bool,
                 key_bounds: list[int] | None = None) -> None:
    """Causal SDPA on each packed sequence's slice, written into ``output`` ``[1, T, heads, dim]``;
    with ``key_bounds``, sequence ``i``'s queries are the last of its keys ``key_bounds[i]:key_bounds[i + 1]``
    (the mask aligned at its end)."""
    key_bounds = key_bounds or bounds
    for (start, end), (key_start, key_end) in zip(zip(bounds[:-1], bounds[1:]), zip(key_bounds[:-1], key_bounds[1:])):
        queries, known = end - start, key_end - key_start
        mask = None
        if queries != known:  # query j is the sequence's token known - queries + j
            mask = torch.ones(queries, known, dtype=torch.bool, device=query.device).tril(known - queries)
        elif sliding_window is not None and known > sliding_window:
            mask = _sliding_mask(known, sliding_window, query.device)
        part = F.scaled_dot_product_attention(
            query[:, :, start:end], key[:, :, key_start:key_end], value[:, :, key_start:key_end],
            attn_mask=mask, is_causal=mask is None, scale=scaling, enable_gqa=gqa,
        )
        output[:, start:end] = part.transpose(1, 2)


def register() -> None:
    """Make :data:`ATTENTION_NAME` known to transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, packed_attention)


def set_attention(model: nn.Module, name: str) -> None:
    """Switch a loaded model's attention implementation (``ATTENTION_NAME`` or one of transformers')."""
    if name == ATTENTION_NAME:
        register()
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:
        model.config._attn_implementation = name

