"""``--compile``'s decoder layers are self-checked through the code torch.compile generates
(``self_check.check_compiled``): the eager check runs none of it. Layers whose compiled code
changes the states run eagerly again and the files equal plain transformers run on each prompt
alone; layers whose compiled code keeps them are served compiled. The fault is a real one: a
torch.compile backend whose generated code computes something else (as a miscompile does).
Tiny random float32 qwen3 on the CPU."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch

from layertap.worker.engine.self_check import check_compiled
from tests.support.architectures import sweep_prompts
from tests.support.extractors import batching_extractor
from tests.support.tiny_configs import build_tiny_type
from tests.support.turns import worst_error

TOLERANCE = 1e-5
LENGTHS = (23, 5, 61, 40)


def backend(graphs: list[int], *, off_by: float) -> Callable[..., Any]:
    """A torch.compile backend that runs each graph dynamo traced, its floating outputs times
    ``1 + off_by`` (0: as traced, as backend ``eager`` does), and counts the graphs it compiled."""

    def compile_graph(graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        graphs.append(len(graph.graph.nodes))

        def run(*args: Any) -> Any:
            outputs = graph(*args)
            return type(outputs)(out * (1 + off_by) if isinstance(out, torch.Tensor) and out.is_floating_point()
                                 else out for out in outputs)
        return run
    return compile_graph


def files_against_plain_transformers(extractor: Any, model_dir: str, tmp_path) -> float:
    """The worst per-token relative error (``turns.worst_error``) of the files of :data:`LENGTHS`
    prompts sent at once, against plain transformers run on each alone."""
    layer_ids = list(range(extractor.loaded.num_layers + 1))
    inputs = sweep_prompts(extractor.loaded.vocab_size, LENGTHS)
    results = extractor.extract(inputs, tmp_path / "files", run="compiled", layers=layer_ids)
    assert all(result.ok for result in results), [result.error for result in results if not result.ok]
    return worst_error(model_dir, inputs, [result.path for result in results], layer_ids)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(build_tiny_type("qwen3", tmp_path_factory.mktemp("model")))


def test_compiled_layers_that_change_the_states_run_eagerly(model_dir, tmp_path, caplog):
    extractor = batching_extractor(model_dir, 300, device="cpu", dtype="float32")
    with extractor:
        engine, eager = extractor.processor.engine, extractor.processor.self_check
        graphs: list[int] = []
        with caplog.at_level(logging.WARNING):
            report = check_compiled(engine, eager, backend=backend(graphs, off_by=1e-3))
        assert graphs, "the layers were never compiled"
        assert report is eager and not extractor.loaded.compiled
        assert all("forward" not in layer.__dict__ for layer in extractor.loaded.layers)  # the class's own again
        assert "decoder layers run eagerly, not compiled: compiled, packed batching changes the hidden states" \
            in caplog.text
        compiled_so_far = len(graphs)
        assert files_against_plain_transformers(extractor, model_dir, tmp_path) <= TOLERANCE
        assert len(graphs) == compiled_so_far


def test_compiled_layers_that_keep_the_states_are_served_compiled(model_dir, tmp_path):
    extractor = batching_extractor(model_dir, 300, device="cpu", dtype="float32")
    with extractor:
        engine, eager = extractor.processor.engine, extractor.processor.self_check
        graphs: list[int] = []
        report = check_compiled(engine, eager, backend=backend(graphs, off_by=0.0))
        assert graphs, "the layers were never compiled"
        assert report is not eager and report.worst_relative_error <= report.tolerance
        assert extractor.loaded.compiled
        assert files_against_plain_transformers(extractor, model_dir, tmp_path) <= TOLERANCE
