"""Packed attention on the CPU against plain torch SDPA run on each prompt alone."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from layertap.worker.model.attention import packed_attention, packed_sequences


def alone(query, key, value, bounds, gqa):
    """Each prompt's causal SDPA on its own, concatenated: ``[1, T, heads, dim]``."""
    parts = [F.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], is_causal=True,
                                            enable_gqa=gqa).transpose(1, 2) for a, b in zip(bounds[:-1], bounds[1:])]
    return torch.cat(parts, dim=1)


@pytest.mark.parametrize("lengths", [[7, 1, 33, 64, 12, 40, 2, 58], [300, 20, 5], [9]],
                         ids=["short", "long", "single"])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_packed_attention_equals_each_prompt_alone(lengths, kv_heads):
    torch.manual_seed(sum(lengths))
    total, heads, dim = sum(lengths), 4, 16
    bounds = [0, *itertools.accumulate(lengths)]
    # transformers' layout: [1, T, heads, dim] transposed to [1, heads, T, dim]
    query = torch.randn(1, total, heads, dim).transpose(1, 2)
    key = torch.randn(1, total, kv_heads, dim).transpose(1, 2)
    value = torch.randn(1, total, kv_heads, dim).transpose(1, 2)
    with packed_sequences(bounds):
        got, _ = packed_attention(None, query, key, value, None, scaling=dim ** -0.5)
    expected = alone(query, key, value, bounds, kv_heads != heads)
    assert got.shape == (1, total, heads, dim)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


def test_a_mask_the_model_made_itself_is_refused_not_ignored():
    """transformers builds no mask for packed attention, so a mask that reaches it is the model's
    own (Doge adds a per-key score bias through it): packed attention cannot apply it, and says so
    instead of attending without it."""
    from layertap.worker.model.attention import UnsupportedAttention

    query = key = value = torch.randn(1, 2, 6, 8)
    bias = torch.randn(1, 2, 6, 6)
    with packed_sequences([0, 2, 6]), pytest.raises(UnsupportedAttention, match="mask of its own"):
        packed_attention(None, query, key, value, bias, scaling=8 ** -0.5)
