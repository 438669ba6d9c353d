"""Mixture-of-experts models run transformers' grouped expert kernel (``grouped_mm``: one grouped
matmul per projection over the tokens routed to each expert, so an expert no token chose costs
nothing) and stay exact: batched files equal plain transformers run on each prompt alone with its
reference experts loop (``experts_implementation="eager"``), float32, 1e-5 relative per token."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from layertap.producer.files.reader import load_hidden_states
from layertap.worker.model.loading import load_model
from tests.support.architectures import build_tiny
from tests.support.extractors import batching_extractor

PROMPTS = ([5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [40, 41, 42], [100, 7, 30, 9, 25, 17, 18, 19, 20])
TOLERANCE = 1e-5


def eager_experts_states(model_dir: str, ids: list[int], layers: list[int]) -> torch.Tensor:
    """``[T, len(layers), H]`` from plain transformers with the eager experts loop, one prompt alone."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 experts_implementation="eager").eval()
    blocks = model.model.layers
    caught: dict[int, torch.Tensor] = {}

    def entering(index: int):
        def hook(module, args, kwargs):
            caught[index] = (args[0] if args else kwargs["hidden_states"])[0]
        return hook

    def leaving(module, args, output):
        caught[len(blocks)] = (output[0] if isinstance(output, tuple) else output)[0]

    hooks = [block.register_forward_pre_hook(entering(i), with_kwargs=True) for i, block in enumerate(blocks)]
    hooks.append(blocks[-1].register_forward_hook(leaving))
    with torch.no_grad():
        model(torch.tensor([ids]), use_cache=False)
    for hook in hooks:
        hook.remove()
    return torch.stack([caught[i] for i in layers], dim=1)


@pytest.mark.parametrize("name", ["qwen3-moe", "gpt-oss-sinks"])
def test_grouped_experts_equal_the_eager_loop(name, tmp_path):
    model_dir = str(build_tiny(name, tmp_path / "model"))
    loaded = load_model(model_dir, name=name, device="cpu", dtype="float32")
    assert loaded.experts == "grouped_mm"
    layers = list(range(loaded.num_layers + 1))
    with batching_extractor(loaded, 300, layers=layers) as extractor:
        results = extractor.extract([list(p) for p in PROMPTS], tmp_path / "files", run="experts")
    for ids, result in zip(PROMPTS, results):
        assert result.ok, result.error
        got = load_hidden_states(result.path)["hidden_states"].double()
        reference = eager_experts_states(model_dir, list(ids), layers).double()
        errors = ((got - reference).norm(dim=-1) / reference.norm(dim=-1)).amax(0)
        assert errors.max() <= TOLERANCE, f"{name}: relative error per layer {errors.tolist()}"
