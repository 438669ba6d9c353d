"""Choosing packed attention's GPU kernel: an unknown name is refused, the cuDNN frontend without
its extra says how to install it, ``auto`` (the default) is flash off Hopper or without the extra, and
the frontend takes only the dtypes and head sizes its GPU test covers and a longest row from 512 tokens
up to the longest measured (the kernels themselves: ``tests/gpu/test_cudnn_attention.py``)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from layertap.extras import MissingExtra
from layertap.settings import WorkerSettings
from layertap.worker.model import attention, cudnn_attention


def test_an_unknown_kernel_is_refused():
    with pytest.raises(ValueError, match="not one of auto, flash, cudnn"):
        attention.use_varlen_kernel("fa9")
    assert attention.attention_kernel() == "auto"


@pytest.mark.skipif(importlib.util.find_spec("cudnn") is not None, reason="the cudnn extra is installed here")
def test_cudnn_without_its_extra_names_the_extra():
    with pytest.raises(MissingExtra, match=r"pip install 'layertap\[cudnn\]'"):
        attention.use_varlen_kernel("cudnn")
    assert attention.attention_kernel() == "auto"
    assert attention.resolved_kernel(torch.device("cpu")) == "flash"


def test_the_default_is_auto_and_resolves_to_flash_without_a_hopper_card():
    assert WorkerSettings().attention_kernel == "auto" == attention.attention_kernel()
    assert attention.resolved_kernel(torch.device("cpu")) == "flash"


@pytest.mark.parametrize(("dtype", "head", "longest", "served"), [
    (torch.bfloat16, 128, 16384, True), (torch.float16, 64, 512, True), (torch.bfloat16, 128, 511, False),
    (torch.bfloat16, 256, 1000, False), (torch.bfloat16, 96, 1000, False), (torch.float32, 128, 1000, False),
    (torch.bfloat16, 128, 16385, False)])
def test_the_frontend_takes_only_its_tested_dtypes_heads_and_lengths(dtype, head, longest, served):
    assert cudnn_attention.takes(torch.empty(4, 2, head, dtype=dtype), longest) is served


@pytest.mark.parametrize(("value", "least", "bucket"), [(1, 256, 256), (256, 256, 256), (257, 256, 512),
                                                         (2047, 2048, 2048), (2049, 2048, 4096),
                                                         (70000, 2048, 131072)])
def test_calls_are_padded_to_few_graph_shapes(value, least, bucket):
    assert cudnn_attention._bucket(value, least) == bucket


@pytest.mark.skipif(importlib.util.find_spec("cudnn") is not None, reason="the cudnn extra is installed here")
def test_a_frontend_that_fails_to_load_leaves_flash_and_says_why(tmp_path, monkeypatch, caplog):
    """An installed frontend whose library does not load (here a package that raises as it imports)."""
    (tmp_path / "cudnn").mkdir()
    (tmp_path / "cudnn" / "__init__.py").write_text("raise OSError('libcudnn.so.9: cannot open shared object file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cudnn_attention.available.cache_clear()
    try:
        with caplog.at_level("WARNING"):
            assert not cudnn_attention.available()
    finally:
        cudnn_attention.available.cache_clear()
        cudnn_attention._sdpa.cache_clear()
    assert "libcudnn.so.9" in caplog.text and "aten's flash kernel" in caplog.text
