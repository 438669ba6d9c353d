"""Packed attention on the cuDNN frontend (``worker.attention_kernel = cudnn``) against aten's flash
kernel on a real GPU: packed prompts, and queries that are the last tokens of longer key rows (the
prefix cache's case, the mask aligned at each row's end), within bf16's rounding of each other.

Needs an NVIDIA GPU and ``nvidia-cudnn-frontend`` (``pip install 'layertap[cudnn]'``): skipped
elsewhere (CI). Run it on a GPU machine with ``make test-gpu``."""

from __future__ import annotations

import importlib.util
import itertools

import pytest
import torch

from layertap.worker.model import attention

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("cudnn") is None,
                                reason="needs an NVIDIA GPU and the cudnn extra: make test-gpu")


def bounds(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cuda")


@pytest.mark.parametrize(("queries", "keys"), [([700, 3, 2047, 129, 1], [700, 3, 2047, 129, 1]),
                                               ([30, 512, 1, 900], [1030, 2512, 17, 900])],
                         ids=["packed", "over-cached-prefixes"])
def test_cudnn_matches_flash(queries, keys):
    generator = torch.Generator(device="cuda").manual_seed(sum(keys))
    q = torch.randn(sum(queries), 32, 128, device="cuda", dtype=torch.bfloat16, generator=generator)
    k, v = (torch.randn(sum(keys), 8, 128, device="cuda", dtype=torch.bfloat16, generator=generator) for _ in "kv")
    arguments = (q, k, v, bounds(queries), bounds(keys), max(queries), max(keys), 128 ** -0.5)
    try:
        attention.use_varlen_kernel("flash")
        expected = attention._varlen(*arguments)
        attention.use_varlen_kernel("cudnn")
        got = attention._varlen(*arguments)
    finally:
        attention.use_varlen_kernel("flash")
    assert got.shape == expected.shape and bool(got.isfinite().all())
    assert float((got.float() - expected.float()).norm() / expected.float().norm()) < 1e-2
