"""A model split over layers into stages writes the same files, bit for bit, as the model on one
device (issue 28). On the CPU the stages share the device: the split's placement, accelerate's
hooks on every stage and the capture on each layer's stage all run, as they do over GPUs."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from layertap.worker.model.loading import load_model
from tests.support.extractors import batching_extractor

PROMPTS = [
    "hello the model is fast",
    "explain why the residual stream is a good place to read " * 9,
    "a",
    "what is the capital of a small city near a river? tell me about it. " * 4,
]
EARLY = [0, 2]  # the forward stops after layer 1 (stage 0 of 2): the second stage never runs
EVERY = [0, 1, 2, 3, 4]  # through the last layer's output, on the last stage
TRAINING = {"final_hidden_states": True, "topk": 3, "topk_on": "all"}  # the final norm and the head too


def tensors(results) -> list[dict[str, torch.Tensor]]:
    out = []
    for result in results:
        assert result.ok, result.error
        out.append(load_file(result.path))
    return out


def assert_same_files(split, whole) -> None:
    for ours, theirs in zip(split, whole, strict=True):
        assert sorted(ours) == sorted(theirs)
        for key in theirs:
            assert ours[key].dtype == theirs[key].dtype, key
            assert torch.equal(ours[key], theirs[key]), f"{key} differs between the split and the whole model"


def extract(loaded, out, runs):
    """Each run (layers, job fields) one batch of every prompt: the engine waits long enough for all
    of them (on the CPU a matmul's bits depend on how many rows it has, so both sides must batch alike)."""
    with batching_extractor(loaded, 1000, storage_root=out) as extractor:
        return [tensors(extractor.extract(PROMPTS, out / str(index), layers=layers, **fields))
                for index, (layers, fields) in enumerate(runs)]


@pytest.mark.parametrize("arch, batching, stages", [
    ("qwen3", "auto", 2),  # packed: one row, positions restarting, varlen attention per stage
    ("llama", "auto", 4),  # one layer per stage
    ("qwen3", "padded", 2),  # padded: a mask and the real tokens' rows picked on each stage
    ("gpt2", "auto", 3),
])
def test_split_files_equal_the_whole_models(arch, batching, stages, tiny_models, tmp_path):
    folder = str(tiny_models[arch])
    whole = load_model(folder, device="cpu", batching=batching)
    split = load_model(folder, device="cpu", batching=batching, stages=stages)
    assert split.split is not None and len(split.split.stages) == stages
    assert split.batching.name == whole.batching.name
    assert ([stage.plan.start for stage in split.split.stages[1:]]
            == [stage.plan.stop for stage in split.split.stages[:-1]])
    assert split.split.stages[-1].plan.stop == 4 and all(stage.plan.layers >= 1 for stage in split.split.stages)
    assert all(hasattr(layer, "_hf_hook") for layer in split.layers)  # accelerate moves each layer's inputs
    # stages sharing a device move nothing between them: no hook of the split's own on any layer
    assert [len(layer._forward_pre_hooks) for layer in split.layers] == \
        [len(layer._forward_pre_hooks) for layer in whole.layers]
    runs = [(EARLY, {}), (EVERY, TRAINING)]
    for ours, theirs in zip(extract(split, tmp_path / "split", runs), extract(whole, tmp_path / "whole", runs),
                            strict=True):
        assert_same_files(ours, theirs)


def test_a_compiled_split_layer_is_one_graph_as_the_whole_models(tiny_models):
    """accelerate's hooks inside a layer are compiler-disabled functions: left on, each breaks the
    compiled layer at every submodule (norms, rotary and residual adds stop fusing). The split
    keeps only the layer's own hook, outside its compiled forward: the same graph breaks (packed
    attention only) and the same graphs as the whole model."""
    from torch._dynamo.utils import counters

    from layertap.worker.model.modes import compile_decoder_layers

    def compiled_graphs(stages: int) -> tuple[int, int, list[str]]:
        """(graph breaks, graphs, the modules of layer 0 that carry an accelerate hook)"""
        torch._dynamo.reset()
        counters.clear()
        loaded = load_model(str(tiny_models["qwen3"]), device="cpu", stages=stages)
        compile_decoder_layers(loaded, backend="eager")  # dynamo's graphs, without code generation
        with torch.inference_mode():
            for length in (37, 53):
                loaded.model(input_ids=torch.arange(3, 3 + length)[None])
        hooked = [name for name, module in loaded.layers[0].named_modules() if hasattr(module, "_hf_hook")]
        return sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"], hooked

    *split, hooked = compiled_graphs(2)
    assert hooked == [""]
    assert split == list(compiled_graphs(0)[:2])


def test_device_map_places_every_weight_and_the_tail_on_the_last_stage(tiny_models):
    from transformers import AutoConfig

    from layertap.worker.model.split.plans import empty_model, split_plan

    config = AutoConfig.from_pretrained(tiny_models["llama"])
    model = empty_model(config, trust_remote_code=False)
    plans, placement = split_plan(model, ["cuda:0", "cuda:1"], token_budget=16, captured_layers=2,
                                  dtype=torch.bfloat16)
    assert [(p.start, p.stop) for p in plans] == [(0, 2), (2, 4)]
    for name, _ in [*model.named_parameters(), *model.named_buffers()]:
        prefix = name
        while prefix and prefix not in placement:
            prefix = prefix.rpartition(".")[0]
        assert prefix, f"{name} has no device"
    assert placement["model.layers.0"] == placement["model.layers.1"] == placement["model.embed_tokens"] == "cuda:0"
    assert placement["model.layers.2"] == placement["model.layers.3"] == placement["model.norm"] == "cuda:1"
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert placement["lm_head"] == ("cuda:0" if tied else "cuda:1")  # a tied head stays with its embedding


def test_a_split_worker_writes_the_files_of_a_whole_model(make_worker, private_client, tiny_models, tmp_path):
    """Through the real queue: a worker started with --split-stages 2 (a Celery worker, Redis, files)."""
    worker = make_worker("split@localhost", extra_args=["--split-stages", "2"],
                         env={"LAYERTAP_WORKER__BATCH_WAIT_MS": "1500"})  # one batch, as the Extractor's
    assert "split over 2 stages: stage 0: layers 0-" in worker.log_text()
    run = "split-worker"
    jobs = private_client.submit_many([{"prompt": p} for p in PROMPTS], model="tiny-qwen3", run=run, layers=EVERY,
                                      **TRAINING)
    results = private_client.wait(run, [job.job_id for job in jobs], timeout=120)
    whole = load_model(str(tiny_models["qwen3"]), device="cpu")
    assert_same_files(tensors([results[job.job_id] for job in jobs]),
                      extract(whole, tmp_path / "whole", [(EVERY, TRAINING)])[0])


def test_stages_on_the_cpu_share_it_and_one_stage_is_no_split(tiny_models, tmp_path):
    from layertap.worker import Extractor
    from layertap.worker.model.split.plans import split_devices

    assert split_devices(torch.device("cpu"), 3) == ["cpu", "cpu", "cpu"]
    assert split_devices(torch.device("cpu"), 0) == ["cpu"]
    assert split_devices(torch.device("cpu"), 1) == ["cpu"]
    with Extractor(str(tiny_models["qwen3"]), device="cpu", stages=2, storage_root=tmp_path) as extractor:
        assert [stage.device.type for stage in extractor.loaded.split.stages] == ["cpu", "cpu"]
    assert load_model(str(tiny_models["qwen3"]), device="cpu").split is None


def test_a_shape_split_over_gpus_is_made_stage_by_stage_with_working_weights():
    """``shape:`` models split over GPUs are built on the meta device and each weight made on its
    stage's device (never the whole model on one); here the map is all on the CPU."""
    from layertap.worker.model.shapes import build_random_model, fill_random, shape_config
    from layertap.worker.model.split.plans import empty_model, split_plan

    model = empty_model(shape_config("qwen3-tiny"), trust_remote_code=False)
    _, placement = split_plan(model, ["cpu", "cpu"], token_budget=16, captured_layers=2, dtype=torch.float32)
    fill_random(model, placement, torch.float32)
    assert not any(tensor.is_meta for tensor in [*model.parameters(), *model.buffers()])
    built = build_random_model("qwen3-tiny", torch.device("cpu"), torch.float32)
    for (name, ours), (_, theirs) in zip(model.named_buffers(), built.named_buffers(), strict=True):
        assert torch.equal(ours, theirs), name  # rotary tables as the model computes them
    assert torch.equal(model.model.norm.weight, torch.ones_like(model.model.norm.weight))
    with torch.inference_mode():
        logits = model(input_ids=torch.arange(3, 40)[None]).logits
    assert torch.isfinite(logits).all() and logits.std() > 0


def test_a_quantized_checkpoint_is_refused_a_split_and_loads_whole_by_default(tiny_models, tmp_path):
    from layertap.worker.model.batching import ModelRefused
    from tests.support.quantized import FORMATS, write_quantized

    folder = write_quantized(tiny_models["qwen3"], tmp_path / "quantized", next(iter(FORMATS)))
    with pytest.raises(ModelRefused, match="not split over stages yet"):
        load_model(str(folder), device="cpu", stages=2)
    assert load_model(str(folder), device="cpu").split is None
