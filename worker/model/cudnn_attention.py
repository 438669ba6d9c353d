"""Variable-length causal attention through NVIDIA's cuDNN frontend (``nvidia-cudnn-frontend``, the
``cudnn`` extra): packed attention's GPU kernel where ``worker.attention_kernel`` is ``cudnn``.

The frontend builds and caches one cuDNN graph per shape key, which holds the number of
sequences and the longest query and key lengths but not the token count. Every batch packs
different prompts, so each call is padded to a bucket: sequences up to a power of two (at
least :data:`MIN_SEQUENCES`) with empty ones, longest lengths up to a power of two (at least
:data:`MIN_LENGTH`). A worker then builds a handful of graphs (50-800 ms each on an H100, once)
and serves every batch from them. The causal mask is aligned at each row's end (queries that are
a row's last tokens, over its cached prefix: ``prefix_keys``); with as many queries as keys that
is the usual mask. Measured exact against aten's flash kernel (bf16: relative error 5e-4 to 2e-3,
the same distance from a float32 reference) in ``benchmarks/attention_kernels.py``.

It serves only the queries :func:`takes` (the dtypes and head sizes ``tests/gpu/test_cudnn_attention.py``
covers, a longest row from :data:`MIN_LONGEST` up to the longest measured); packed attention calls
aten's flash kernel for the rest.
"""

from __future__ import annotations

import functools
import logging

import torch

from layertap.extras import MissingExtra, need

log = logging.getLogger(__name__)

#: The fewest sequences a call is padded to (the worker's default ``max_batch_jobs``).
MIN_SEQUENCES = 256
#: The shortest longest-length a call is padded to.
MIN_LENGTH = 2048
#: The head sizes and dtypes it serves (those its GPU test covers).
HEAD_SIZES = (64, 128)
DTYPES = (torch.bfloat16, torch.float16)
#: The longest row it serves (the longest measured, ``benchmarks/attention_kernels.py``); longer go to flash.
MAX_LENGTH = 16384
#: Calls whose rows are all shorter go to flash: their attention is a small part of a batch, and the
#: frontend's call costs the host more (on an H100, prompts of 16-128 tokens ran 4.9% slower through
#: the engine in-process with the frontend, forward alone equal; prompts of 128-2,047 ran 2.5% faster).
MIN_LONGEST = 512


def _bucket(value: int, least: int) -> int:
    """``value`` rounded up to a power of two, at least ``least``."""
    return max(least, 1 << max(0, value - 1).bit_length())


@functools.cache
def _sdpa():
    """The frontend's torch op (imported once; a missing extra raises with its install hint)."""
    need("cudnn", "worker.attention_kernel = cudnn", extra="cudnn")
    return need("cudnn.sdpa.fwd.torch_op", "worker.attention_kernel = cudnn", extra="cudnn").sdpa


def require() -> None:
    """Raise :class:`~layertap.extras.MissingExtra` unless the frontend imports."""
    _sdpa()


@functools.cache
def available() -> bool:
    """Whether the frontend imports here (one that is installed but fails to load is logged, once)."""
    try:
        _sdpa()
    except MissingExtra:
        return False
    except (OSError, RuntimeError) as exc:  # e.g. a cuDNN library that does not match torch's
        log.warning("the cuDNN frontend is installed but does not load (%s: %s); packed attention uses "
                    "aten's flash kernel", type(exc).__name__, exc)
        return False
    return True


def takes(query: torch.Tensor, longest_key: int) -> bool:
    """Whether it serves this query (``[T, heads, dim]``) over rows of at most ``longest_key`` keys:
    a dtype and head size of its tests, the longest row from :data:`MIN_LONGEST` to :data:`MAX_LENGTH`."""
    return query.dtype in DTYPES and query.shape[-1] in HEAD_SIZES and MIN_LONGEST <= longest_key <= MAX_LENGTH


def _padded(cumulative: torch.Tensor, sequences: int) -> torch.Tensor:
    """``cumulative`` (int32, ``n + 1``) with empty sequences after its last, to ``sequences + 1``."""
    return torch.cat([cumulative, cumulative[-1:].expand(sequences + 1 - cumulative.numel())])


def varlen(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cumulative_q: torch.Tensor,
           cumulative_k: torch.Tensor, longest_q: int, longest_k: int, scale: float | None) -> torch.Tensor:
    """Causal attention of ``query`` ``[Tq, heads, dim]`` over ``key``/``value`` ``[Tk, kv_heads, dim]``,
    sequence ``i`` being ``cumulative_q[i]:cumulative_q[i + 1]`` of the queries and
    ``cumulative_k[i]:cumulative_k[i + 1]`` of the keys, aligned at its end; returns ``[Tq, heads, dim]``."""
    sequences = _bucket(cumulative_q.numel() - 1, MIN_SEQUENCES)
    return _sdpa()(query, key, value, scale=scale, is_causal=True, causal_bottom_right=True,
                   cu_seqlens_q=_padded(cumulative_q, sequences), cu_seqlens_kv=_padded(cumulative_k, sequences),
                   max_seqlen_q=_bucket(longest_q, MIN_LENGTH), max_seqlen_kv=_bucket(longest_k, MIN_LENGTH))
