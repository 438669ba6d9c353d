"""The architecture sweep on a GPU in bfloat16: every decoder-only type of the installed transformers
(listed by code: ``tests.support.tiny_configs.decoder_only_types``), loaded by the worker's loader
onto the GPU, self-checked there and served by the in-process engine on the GPU's own paths (packed
attention's variable-length kernels, each model's CUDA code), writes files as close to plain
transformers run in float32 on each prompt alone as plain transformers' own bfloat16 run of that
prompt alone on the same GPU is.

The CPU sweep (``tests/integration/test_architectures.py``) holds float32 files to 1e-5 of the prompt
alone, but on the CPU packed attention runs each prompt's own SDPA call: the kernels a GPU worker
runs are checked there only by the load-time self-check, whose bfloat16 tolerance (0.1) sits above
the rounding noise of deep random stacks and so catches only gross faults. Here the tiny models
(2 layers) round far less than that, and each layer of each file must be within :data:`FACTOR`
times plain transformers' bf16 distance from float32 (plus :data:`FLOOR`, a quarter of bf16's
unit roundoff) of that truth: a prompt that sees another's tokens, wrong positions or a window
applied wrongly are several times further off.

Three parts: the CPU sweep's tiny models (heads of 8: aten's flash kernel); the same types with
heads of 64 and a prompt of 600 tokens among the batch (``WIDE_HEADS``), where packed attention takes
NVIDIA's cuDNN frontend (the default on Hopper cards with the ``cudnn`` extra); and the first with
the decoder layers compiled (``--compile``: Inductor's Triton kernels). In each, a row that begins
another row of its batch (served from it where the engine shares prefixes) and each prompt extended
in the next batch (over its cached prefix where the engine caches them).

Mixtures of experts route every token to every expert here (``tiny_configs.every_expert``): where a
router's top-k picks among near-equal logits, any bf16 rounding may pick the other expert (mixtral's
token 1 of the 12-token prompt: its 2nd and 3rd logits 2e-4 apart in float32; after the first layer
that token is 0.024 from float32 in the engine's bf16 run, 0.003 in plain transformers'), which no
bound on rounding holds. The CPU sweep holds top-k routing to 1e-5 of float32.

Needs an NVIDIA GPU (the second part also the ``cudnn`` extra): skipped elsewhere (CI). Run it on a
GPU machine with ``make test-gpu``.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from layertap.producer.files.reader import load_hidden_states
from layertap.worker.engine.prefix_cache import CHUNK
from layertap.worker.model import cudnn_attention
from layertap.worker.model.batching import ModelRefused
from layertap.worker.model.loading import load_model
from tests.support.architectures import NOT_BUILT, NOT_BUILT_WIDE, REFUSED, SWEEP_LENGTHS, sweep_prompts
from tests.support.extractors import batching_extractor
from tests.support.reference import block_input_states
from tests.support.tiny_configs import SMALL, WIDE_HEADS, build_tiny_type, decoder_only_types, every_expert

if not torch.cuda.is_available():  # before listing the types (seconds of every collecting process's CPU)
    pytest.skip("needs an NVIDIA GPU: make test-gpu", allow_module_level=True)

DEVICE = "cuda"
#: The prompts' lengths with wide heads: one over ``cudnn_attention.MIN_LONGEST``, so the frontend takes the batch.
WIDE_LENGTHS = (600, 41, 3, 17, 300, 9)
#: How many times plain transformers' own bf16 distance from float32 a file's may be, per layer.
FACTOR = 2.0
#: ... plus this much (relative): a quarter of bf16's unit roundoff, 2**-8.
FLOOR = 2.0 ** -10
#: What each prompt is extended by for the batch after it (as the next turn of a chat).
TAILS = (5, 11, 2, 7, 13, 3, 8, 6)
TYPES = [name for name in decoder_only_types() if name not in NOT_BUILT]


def relative_errors(got: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """``[T, n_layers, ...]`` pair -> ``[n_layers]``: ``‖got − reference‖ / ‖reference‖`` over the prompt's tokens."""
    got, reference = got.double().transpose(0, 1).flatten(1), reference.double().transpose(0, 1).flatten(1)
    return (got - reference).norm(dim=1) / reference.norm(dim=1).clamp_min(1e-30)


def sweep_one(model_type: str, model_dir: str, tmp_path: Path, lengths: tuple[int, ...],
              record_property: Any, compile_layers: bool = False) -> None:
    """Serve ``model_dir`` on the GPU in bf16 (``compile_layers``: its decoder layers compiled, as
    ``--compile``); send ``lengths`` prompts at once, with a row that begins the second of them (served
    from it where the engine shares prefixes), then each prompt extended as the next batch (computed
    over its cached prefix where the engine caches them); hold every file to the bound."""
    try:
        loaded = load_model(model_dir, name=model_type, device=DEVICE, dtype="bfloat16")
        extractor = batching_extractor(loaded, 300, layers=list(range(loaded.num_layers + 1)),
                                       compile_layers=compile_layers)
    except ModelRefused as refused:  # loudly: no file is written. Where the CPU sweep serves the type,
        if model_type not in REFUSED:  # only because transformers itself cannot run it in bf16 here
            with pytest.raises(Exception) as raised:  # noqa: B017 (transformers' own error, named in the refusal)
                block_input_states(model_dir, max(sweep_prompts(128, lengths), key=len), [0], dtype=torch.bfloat16,
                                   device=DEVICE)
            assert f"{type(raised.value).__name__}: {raised.value}" in str(refused), str(refused)
        record_property("batching", "refused")
        return
    assert model_type not in REFUSED, f"{model_type} was served: {loaded.batching.describe()}"
    layer_ids = list(range(loaded.num_layers + 1))
    batches: list[int] = []
    prompts = sweep_prompts(loaded.vocab_size, lengths)
    first = [*prompts, prompts[1][:lengths[1] // 2]]
    later = [ids + tail for ids, tail in zip(prompts, sweep_prompts(loaded.vocab_size, TAILS[:len(lengths)], seed=1))]
    with extractor:
        engine = extractor.processor.engine
        engine.on_batch = lambda jobs, tokens: batches.append(jobs)
        shared = engine.stats.shared_tokens
        results = extractor.extract(first, tmp_path / "files", run="gpu-sweep")
        shared, cached = engine.stats.shared_tokens - shared, engine.stats.cached_tokens
        results += extractor.extract(later, tmp_path / "files", run="gpu-sweep-later")
        cached = engine.stats.cached_tokens - cached
        sharing, caching = engine.prefix_sharing, engine.prefix_cache is not None
    if not loaded.batching.slow:
        assert max(batches) >= 2, f"no two prompts were batched together: {batches}"
    if sharing:  # never with one prompt per batch (``self_check.check_prefix_sharing``)
        assert shared == len(first[-1]), f"{shared} tokens served from a longer row, not the {len(first[-1])} asked"
    if caching:  # each prompt of a whole block or more (``prefix_cache.CHUNK``), whole
        expected = sum(n for n in lengths if n >= CHUNK)
        assert cached == expected, f"{cached} tokens taken from the cache, not the {expected} of the prompts"
    measured = []  # (tokens, the file's error per layer, plain transformers' bf16 error per layer)
    for ids, result in zip(first + later, results, strict=True):
        assert result.ok, result.error
        got = load_hidden_states(result.path)["hidden_states"]
        truth = block_input_states(model_dir, ids, layer_ids)
        plain = block_input_states(model_dir, ids, layer_ids, dtype=torch.bfloat16, device=DEVICE).cpu()
        # the model's dtype (its first parameter's: bf16, or float32 where that is kept so, as ergo's embedding)
        assert got.dtype == loaded.dtype
        assert got.flatten(2).shape == truth.flatten(2).shape
        measured.append((len(ids), relative_errors(got, truth), relative_errors(plain, truth)))
    record_property("batching", loaded.batching.name)
    record_property("compiled", loaded.compiled)
    record_property("shared_tokens", shared if sharing else None)
    record_property("cached_tokens", cached if caching else None)
    record_property("errors", json.dumps([(n, ours.tolist(), theirs.tolist()) for n, ours, theirs in measured]))
    for tokens, ours, theirs in measured:
        assert bool((ours <= FACTOR * theirs + FLOOR).all()), (
            f"{model_type} ({loaded.batching.name}{', compiled' if loaded.compiled else ''}), {tokens} tokens: from "
            f"float32 per layer, the file {[round(x, 5) for x in ours.tolist()]}, plain transformers bf16 "
            f"{[round(x, 5) for x in theirs.tolist()]}")


@pytest.mark.parametrize("model_type", TYPES)
def test_bf16_files_are_as_close_to_float32_as_plain_transformers_bf16(model_type, tmp_path, record_property):
    model_dir = str(build_tiny_type(model_type, tmp_path / "model", sizes=every_expert(SMALL)))
    sweep_one(model_type, model_dir, tmp_path, SWEEP_LENGTHS, record_property)


@pytest.mark.skipif(importlib.util.find_spec("cudnn") is None, reason="needs the cudnn extra: make test-gpu")
@pytest.mark.parametrize("model_type", TYPES)
def test_bf16_files_through_the_cudnn_frontend_are_as_close_as_plain_transformers_bf16(model_type, tmp_path,
                                                                                       record_property, monkeypatch):
    try:
        model_dir = str(build_tiny_type(model_type, tmp_path / "model", sizes=every_expert(WIDE_HEADS)))
    except Exception as exc:  # noqa: BLE001 (transformers' strict dataclasses raise their own error types)
        assert model_type in NOT_BUILT_WIDE, f"{model_type} does not build with wide heads: {exc}"
        return
    calls, varlen = [], cudnn_attention.varlen

    def counted(*args: Any) -> torch.Tensor:  # the frontend's own call, counted
        calls.append(None)
        return varlen(*args)

    monkeypatch.setattr(cudnn_attention, "varlen", counted)
    sweep_one(model_type, model_dir, tmp_path, WIDE_LENGTHS, record_property)
    record_property("cudnn_calls", len(calls))


@pytest.mark.parametrize("model_type", TYPES)
def test_compiled_bf16_files_are_as_close_to_float32_as_plain_transformers_bf16(model_type, tmp_path,
                                                                              record_property, caplog):
    """As ``--compile`` serves them: the decoder layers run the code torch.compile's Inductor generates
    (Triton kernels), checked at load through it (``self_check.check_compiled``; where it fails, eagerly)."""
    model_dir = str(build_tiny_type(model_type, tmp_path / "model", sizes=every_expert(SMALL)))
    sweep_one(model_type, model_dir, tmp_path, SWEEP_LENGTHS, record_property, compile_layers=True)
    record_property("eager_because", [r.message for r in caplog.records if "run eagerly, not compiled" in r.message])
