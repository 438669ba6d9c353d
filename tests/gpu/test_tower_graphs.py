"""A grid tower's CUDA graphs (``layertap.worker.model.vision.tower_graphs``) on a real GPU: every replay
gives an image, bit for bit, the features its eager one-image forward gives; a tower that waits on
the device is never graphed; files are the same bits with and without graphs.

CUDA graphs exist on NVIDIA GPUs only: on a machine without one this module is skipped (CI's).
Run it on a GPU machine with ``make test-gpu``; BENCHMARKS.md records where it last ran.
"""

from __future__ import annotations

import base64

import pytest
import torch

from layertap.producer.files.reader import load_hidden_states
from layertap.storage.registry import storage_for
from tests.integration.test_vlm import image_chat, png_bytes, reference_inputs
from tests.support.vlm import QWEN_FAMILIES, add_processor, build_tiny_vlm

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need an NVIDIA GPU: make test-gpu")

SIZES = [(40, 24), (90, 20)]


def loaded_tower(family: str, tmp_path):
    """A tiny ``family`` model on the GPU in bf16, as the worker loads it (its tower's attention
    the varlen flash op), and its grid tower."""
    from layertap.worker.model.loading import load_model

    model_dir = add_processor(family, build_tiny_vlm(family, tmp_path / "model"))
    loaded = load_model(str(model_dir), device="cuda", dtype="bfloat16")
    assert loaded.vision_attention is not None and loaded.grid_tower is not None
    return model_dir, loaded


def tower_outputs(loaded, calls, graphs) -> list[list[torch.Tensor]]:
    """Each call's tower output (its tensors, on the host), the tower one image at a time."""
    from layertap.worker.model.vision.attention import vision_attention
    from layertap.worker.model.vision.tower_graphs import tensors_of
    from layertap.worker.model.vision.towers import one_image_at_a_time

    outputs = []
    with (torch.inference_mode(), vision_attention(loaded.model, loaded.vision_attention),
          one_image_at_a_time(loaded.grid_tower, graphs)):
        for pixels, grid in calls:
            outputs.append([tensor.cpu() for tensor in tensors_of(loaded.grid_tower(pixels.cuda(), grid_thw=grid))])
    return outputs


def image_calls(family: str, model_dir, order: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Tower calls of one image each (``order``: indexes into :data:`SIZES`), then one of all of
    them: pixels in bf16, grids on the host (as the engine calls it)."""
    images = [reference_inputs(family, model_dir, size) for size in SIZES]
    calls = [(images[i]["pixel_values"].to(torch.bfloat16), images[i]["image_grid_thw"]) for i in order]
    calls.append((torch.cat([pixels for pixels, _ in calls]), torch.cat([grid for _, grid in calls])))
    return calls


@pytest.mark.parametrize("family", QWEN_FAMILIES)
def test_a_tower_graph_replays_each_image_s_eager_features_bit_for_bit(family, tmp_path):
    """Two sizes, each seen three times alone and then all in one call: the graphed tower gives
    every output bit for bit as the eager one; both sizes got a graph (captured at their second
    image, replayed after), and none failed its check."""
    from layertap.worker.model.vision.tower_graphs import TowerGraphs

    model_dir, loaded = loaded_tower(family, tmp_path)
    calls = image_calls(family, model_dir, [0, 1, 0, 1, 0, 1])
    graphs = TowerGraphs(8)
    graphed = tower_outputs(loaded, calls, graphs)
    eager = tower_outputs(loaded, calls, None)
    assert graphs.off is None and graphs.sizes == 2
    for index, (got, expected) in enumerate(zip(graphed, eager)):
        assert len(got) == len(expected) >= 1
        assert all(torch.equal(a, b) for a, b in zip(got, expected)), f"call {index}"


def test_only_the_first_sizes_up_to_the_limit_get_a_graph(tmp_path):
    """With a limit of one, the first size seen twice gets the graph; the other runs eagerly."""
    from layertap.worker.model.vision.tower_graphs import TowerGraphs

    model_dir, loaded = loaded_tower("qwen2.5-vl", tmp_path)
    calls = image_calls("qwen2.5-vl", model_dir, [0, 0, 1, 1, 1])
    graphs = TowerGraphs(1)
    graphed = tower_outputs(loaded, calls, graphs)
    assert graphs.sizes == 1 and graphs.off is None
    for got, expected in zip(graphed, tower_outputs(loaded, calls, None)):
        assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_a_tower_that_waits_on_the_device_is_never_graphed(tmp_path):
    """A tower block that reads a value back to the host (``.item()``: a sync, which a capture
    refuses) makes the first capture fail: no graph is made, every image runs eagerly with the
    same features, and later sizes are not tried."""
    from layertap.worker.model.vision.tower_graphs import TowerGraphs

    model_dir, loaded = loaded_tower("qwen2-vl", tmp_path)
    calls = image_calls("qwen2-vl", model_dir, [0, 0, 0, 1, 1])
    read = []
    handle = loaded.grid_tower.blocks[0].register_forward_pre_hook(
        lambda module, args, kwargs: read.append((args[0] if args else kwargs["hidden_states"]).sum().item()),
        with_kwargs=True)
    try:
        graphs = TowerGraphs(8)
        graphed = tower_outputs(loaded, calls, graphs)
        eager = tower_outputs(loaded, calls, None)
    finally:
        handle.remove()
    assert graphs.off is not None and "capturing" in graphs.off and graphs.sizes == 0
    for got, expected in zip(graphed, eager):
        assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_files_are_the_same_bits_with_tower_graphs_and_without(tmp_path):
    """Image chats of two sizes, three each, through the Extractor on the GPU in bf16, batched:
    the tower's graphs are made (the worker's default), and every file equals, bit for bit, the
    one the same jobs give with the graphs off."""
    from layertap.worker.extractor import Extractor

    family = "qwen2.5-vl"
    model_dir = add_processor(family, build_tiny_vlm(family, tmp_path / "model"))
    chats = []
    for index, size in enumerate(SIZES * 3):  # each chat its own text: six jobs, not two
        chat = image_chat({"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                                                                     + base64.b64encode(png_bytes(*size)).decode()}})
        chat["messages"][0]["content"][1]["text"] = f"hello model {index}"
        chats.append(chat)
    with Extractor(str(model_dir), layers=[0, 1, 2], device="cuda", dtype="bfloat16") as extractor:
        graphs = extractor.processor.loaded.tower_graphs
        assert graphs is not None, "a batched grid tower on a GPU in bf16 gets graphs"
        files = {}
        for name, use in (("graphed", graphs), ("eager", None)):
            extractor.processor.loaded.tower_graphs = use
            processor = extractor.processor.writing_to(storage_for(tmp_path / name))
            for round_ in range(2):  # the second round replays what the first captured (a run of its own)
                run = f"{name}-{round_}"
                results = processor.process_many([processor.parse(extractor.job(chat, run=run)) for chat in chats])
                assert all(result.ok for result in results), [result.error for result in results]
            files[name] = [load_hidden_states(result.path) for result in results]
        assert graphs.off is None and graphs.sizes == len(SIZES)
    for graphed, eager in zip(files["graphed"], files["eager"]):
        assert torch.equal(graphed["token_ids"], eager["token_ids"])
        assert torch.equal(graphed["hidden_states"], eager["hidden_states"])
