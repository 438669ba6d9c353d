"""Packed attention on the cuDNN frontend (``worker.attention_kernel = cudnn``, or ``auto`` on Hopper)
against aten's flash kernel on a real GPU, for each dtype and head size it serves: packed prompts, and
queries that are the last tokens of longer key rows (the prefix cache's case, the mask aligned at each
row's end), within bf16's rounding of each other; heads and rows it does not take go to flash.

Needs an NVIDIA GPU and ``nvidia-cudnn-frontend`` (``pip install 'layertap[cudnn]'``): skipped
elsewhere (CI). Run it on a GPU machine with ``make test-gpu``."""

from __future__ import annotations

import importlib.util
import itertools

import pytest
import torch

from layertap.worker.model import attention, cudnn_attention

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("cudnn") is None,
                                reason="needs an NVIDIA GPU and the cudnn extra: make test-gpu")


def bounds(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cuda")


def on_each_kernel(arguments: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """``attention._varlen(*arguments)`` with the kernel set to flash, then to cudnn."""
    try:
        attention.use_varlen_kernel("flash")
        expected = attention._varlen(*arguments)
        attention.use_varlen_kernel("cudnn")
        return expected, attention._varlen(*arguments)
    finally:
        attention.use_varlen_kernel("auto")


@pytest.mark.parametrize(("heads", "kv_heads", "head_size", "dtype"), [(32, 8, 128, torch.bfloat16),
                                                                      (16, 16, 64, torch.float16)],
                         ids=["gqa-128-bf16", "mha-64-fp16"])
@pytest.mark.parametrize(("queries", "keys"), [([700, 3, 2047, 129, 1], [700, 3, 2047, 129, 1]),
                                               ([30, 512, 1, 900], [1030, 2512, 17, 900])],
                         ids=["packed", "over-cached-prefixes"])
def test_cudnn_matches_flash(queries, keys, heads, kv_heads, head_size, dtype):
    generator = torch.Generator(device="cuda").manual_seed(sum(keys))
    q = torch.randn(sum(queries), heads, head_size, device="cuda", dtype=dtype, generator=generator)
    k, v = (torch.randn(sum(keys), kv_heads, head_size, device="cuda", dtype=dtype, generator=generator)
            for _ in "kv")
    assert cudnn_attention.takes(q, max(keys))
    arguments = (q, k, v, bounds(queries), bounds(keys), max(queries), max(keys), head_size ** -0.5)
    expected, got = on_each_kernel(arguments)
    assert got.shape == expected.shape and bool(got.isfinite().all())
    assert float((got.float() - expected.float()).norm() / expected.float().norm()) < 1e-2


@pytest.mark.parametrize(("head_size", "lengths"), [(256, [300, 5, 700]), (128, [10, 16385]), (128, [128, 16, 511])],
                         ids=["head-256", "row-over-16384", "rows-under-512"])
def test_auto_is_cudnn_on_hopper_and_what_it_does_not_take_goes_to_flash(head_size, lengths):
    hopper = torch.cuda.get_device_capability()[0] == 9
    assert attention.resolved_kernel(torch.device("cuda", torch.cuda.current_device())) == (
        "cudnn" if hopper else "flash")
    q = torch.randn(sum(lengths), 8, head_size, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    arguments = (q, k, v, bounds(lengths), bounds(lengths), max(lengths), max(lengths), head_size ** -0.5)
    expected, got = on_each_kernel(arguments)
    assert torch.equal(got, expected)  # the same kernel: flash
