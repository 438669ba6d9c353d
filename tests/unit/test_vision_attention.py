"""The vision towers' varlen attention (``layertap.worker.model.vision.attention``): where it is chosen,
and that off a flash-capable GPU it is plain transformers' ``"sdpa"`` tower, number for number."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from layertap.worker.model.vision.attention import (
    VISION_ATTENTION_NAME,
    choose_vision_attention,
    register,
    vision_attention,
    vision_varlen_attention,
)
from tests.support.vlm import GLM_FAMILIES, QWEN_FAMILIES, build_tiny_vlm

CUDA = torch.device("cuda")
#: Images of several sizes (in 14-pixel patches): Qwen2.5-VL's tiny tower cuts each into
#: windows of 4x4 patches, the last ones of a side partial.
GRIDS = [[1, 8, 12], [1, 4, 4], [1, 6, 10]]


def load(family: str, folder, **options):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(build_tiny_vlm(family, folder), dtype=torch.float32,
                                                       **options).eval()


def tower_outputs(model) -> list[torch.Tensor]:
    config = model.config.vision_config
    grid = torch.tensor(GRIDS)
    width = config.in_channels * config.temporal_patch_size * config.patch_size ** 2
    pixels = torch.randn(int(grid.prod(dim=1).sum()), width, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        output = model.model.visual(pixels, grid_thw=grid)
    return [tensor for tensor in output.values() if isinstance(tensor, torch.Tensor)]


@pytest.mark.parametrize("family", [*QWEN_FAMILIES, *GLM_FAMILIES])
def test_off_gpu_the_tower_is_plain_transformers(family: str, tmp_path) -> None:
    from transformers.utils.generic import is_flash_attention_requested

    model = load(family, tmp_path / "model")
    assert model.config.vision_config._attn_implementation == "sdpa"
    expected = tower_outputs(model)
    register()
    with vision_attention(model, VISION_ATTENTION_NAME):
        # the tower takes its flash branch: every image's (window's) bounds reach the function
        assert is_flash_attention_requested(model.model.visual.config)
        got = tower_outputs(model)
    assert model.config.vision_config._attn_implementation == "sdpa"
    assert len(got) == len(expected) >= 2
    for tensor, reference in zip(got, expected):
        assert torch.equal(tensor, reference)


def test_each_sequence_attends_to_itself_alone() -> None:
    generator = torch.Generator().manual_seed(1)
    query, key, value = (torch.randn(1, 3, 20, 8, generator=generator) for _ in range(3))
    bounds = [0, 5, 12, 20]
    cumulative = torch.tensor(bounds, dtype=torch.int32)
    output, _ = vision_varlen_attention(torch.nn.Module(), query, key, value, None, scaling=0.3, is_causal=False,
                                        cu_seq_lens_q=cumulative, cu_seq_lens_k=cumulative, max_length_q=8,
                                        max_length_k=8)
    assert output.shape == (1, 20, 3, 8)
    for start, end in zip(bounds[:-1], bounds[1:]):
        alone = F.scaled_dot_product_attention(query[:, :, start:end], key[:, :, start:end], value[:, :, start:end],
                                               scale=0.3)
        assert torch.equal(output[:, start:end], alone.transpose(1, 2))
    whole, _ = vision_varlen_attention(torch.nn.Module(), query, key, value, None, scaling=0.3, is_causal=False)
    assert torch.equal(whole, F.scaled_dot_product_attention(query, key, value, scale=0.3).transpose(1, 2))


@pytest.mark.parametrize("family", [*QWEN_FAMILIES, *GLM_FAMILIES])
def test_chosen_for_cu_seqlens_towers_on_a_gpu_in_half_precision(family: str, tmp_path) -> None:
    model = load(family, tmp_path / "model")
    assert choose_vision_attention(model, CUDA, torch.bfloat16) == VISION_ATTENTION_NAME
    assert choose_vision_attention(model, CUDA, torch.float16) == VISION_ATTENTION_NAME
    assert choose_vision_attention(model, CUDA, torch.float32) is None
    assert choose_vision_attention(model, torch.device("cpu"), torch.bfloat16) is None


def test_not_chosen_where_the_tower_runs_another_attention(tmp_path) -> None:
    eager = load("qwen2.5-vl", tmp_path / "eager", attn_implementation="eager")
    assert choose_vision_attention(eager, CUDA, torch.bfloat16) is None


@pytest.mark.parametrize("family", ["gemma3", "llava"])
def test_not_chosen_for_towers_without_sequence_bounds(family: str, tmp_path) -> None:
    assert choose_vision_attention(load(family, tmp_path / "model"), CUDA, torch.bfloat16) is None
