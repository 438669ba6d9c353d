"""Choosing packed attention's GPU kernel: an unknown name is refused, and the cuDNN frontend without
its extra says how to install it (the kernels themselves: ``tests/gpu/test_cudnn_attention.py``)."""

from __future__ import annotations

import importlib.util

import pytest

from layertap.extras import MissingExtra
from layertap.worker.model import attention, cudnn_attention


def test_an_unknown_kernel_is_refused():
    with pytest.raises(ValueError, match="not one of flash, cudnn"):
        attention.use_varlen_kernel("fa9")
    assert attention.attention_kernel() == "flash"


@pytest.mark.skipif(importlib.util.find_spec("cudnn") is not None, reason="the cudnn extra is installed here")
def test_cudnn_without_its_extra_names_the_extra():
    with pytest.raises(MissingExtra, match=r"pip install 'layertap\[cudnn\]'"):
        attention.use_varlen_kernel("cudnn")
    assert attention.attention_kernel() == "flash"


@pytest.mark.parametrize(("value", "least", "bucket"), [(1, 256, 256), (256, 256, 256), (257, 256, 512),
                                                         (2047, 2048, 2048), (2049, 2048, 4096),
                                                         (70000, 2048, 131072)])
def test_calls_are_padded_to_few_graph_shapes(value, least, bucket):
    assert cudnn_attention._bucket(value, least) == bucket
