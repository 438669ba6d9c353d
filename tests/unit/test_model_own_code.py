"""A model the worker loads runs its own code. transformers 5.25 turned ``use_kernels`` on by default:
on a CUDA device ``from_pretrained`` then swaps norms, activations and RoPE for the ``kernels``
library's layers, fetched from the Hugging Face hub at load (offline the load fails; online, code
from the hub computes the files). The loader turns it off; on the CPU nothing is swapped either way,
so this asserts the flag transformers acts on (at load, and again on ``train()``/``eval()``)."""

from __future__ import annotations

from layertap.worker.model.loading import load_model
from tests.support.architectures import build_tiny
from tests.support.reference import load


def test_the_worker_loads_no_hub_kernels(tiny_models, tmp_path):
    for folder in (tiny_models["qwen3"], build_tiny("qwen3-next", tmp_path / "hybrid")):  # a hybrid: fla's too
        loaded = load_model(str(folder), name=folder.name, device="cpu", dtype="float32")
        assert loaded.model.use_kernels is False, folder.name


def test_the_tests_reference_is_the_model_s_own_code_too(tiny_models):
    model, _ = load(str(tiny_models["qwen3"]))
    assert model.use_kernels is False
