"""Dequantizing e4m3 weights with block scales: the value of each element is its code times the
scale of the block it falls in, for whole and partial blocks, one matrix or a stack of experts.
The expected values are built element by element here."""

from __future__ import annotations

import pytest
import torch

from layertap.worker.model.quant.experts import dequantize_stack
from layertap.worker.model.quant.fp8 import dequantize_weight


def element_by_element(codes: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    rows, columns = codes.shape
    out = torch.empty(rows, columns)
    for r in range(rows):
        for c in range(columns):
            out[r, c] = codes[r, c].float() * scale[r // block[0], c // block[1]]
    return out


def random_quantized(shape: tuple[int, ...], block: tuple[int, int], seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    codes = (torch.randn(shape, generator=generator) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
    rows, columns = shape[-2:]
    scale_shape = (*shape[:-2], -(-rows // block[0]), -(-columns // block[1]))
    return codes, torch.rand(scale_shape, generator=generator) + 0.01


@pytest.mark.parametrize("shape,block", [((16, 24), (8, 8)), ((20, 12), (8, 8)), ((6, 10), (1, 10)),
                                         ((5, 7), (5, 7))])
def test_one_matrix(shape, block):
    codes, scale = random_quantized(shape, block)
    assert torch.equal(dequantize_weight(codes, scale, block, torch.float32), element_by_element(codes, scale, block))


@pytest.mark.parametrize("shape,block", [((3, 16, 24), (8, 8)), ((3, 12, 24), (8, 8)), ((2, 16, 20), (8, 8))])
def test_a_stack_of_experts(shape, block):
    codes, scale = random_quantized(shape, block)
    expected = torch.stack([element_by_element(codes[e], scale[e], block) for e in range(shape[0])])
    assert torch.equal(dequantize_stack(codes, scale, block, torch.float32), expected)


def test_the_fp8_path_takes_a_compiled_activation_quantizer_that_quantizes_right():
    """``compile_quantizer`` installs the compiled quantizer only after checking its values; an fp8
    Linear then computes with it within e4m3's error of the dequant path."""
    from layertap.worker.model.quant import fp8
    from layertap.worker.model.quant.scheme import QuantScheme

    layer = fp8.QuantLinear(256, 64, QuantScheme("compressed-tensors", "channel", "weight_scale"), bias=False)
    codes, scale = random_quantized((64, 256), (1, 256))
    layer.weight.copy_(codes)
    layer.scale.copy_(scale)
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(1))
    reference = layer(x)
    try:
        fp8.compile_quantizer(torch.device("cpu"), torch.float32)
        assert fp8._quantizer is not fp8.quantize_groups
        layer.use_path(fp8.ComputePath.fp8)
        got = layer(x)
    finally:
        fp8._quantizer = fp8.quantize_groups
    assert 0 < (got - reference).norm() / reference.norm() <= 2.0**-4
