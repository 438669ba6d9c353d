"""The vision-language sweep: every image-text-to-text type of the installed transformers
(listed by code: ``tests.support.tiny_configs.image_text_types``), saved tiny as its
``...ForConditionalGeneration`` (or whatever class transformers maps it to), serves token-id
jobs exactly: batched the way the worker batches them, every layer ``0..L`` of every prompt
within 1e-5 of the plain model's own ``forward`` on that prompt alone; or it is refused, or no
tiny model of it is built, for the reason written in ``tests.support.vlm_types``.

Image chats need a processor per family and are checked family by family in
``tests/integration/test_vlm.py``; this sweep covers what every VLM checkpoint serves without
one. CI runs :data:`CI_TYPES` (every type with a written expectation and every fourth of the
rest); ``LAYERTAP_FULL_SWEEP=1`` runs every type.
"""

from __future__ import annotations

import os

import pytest
import torch

from layertap.producer.files.reader import load_hidden_states
from layertap.worker.model.batching import ModelRefused
from layertap.worker.model.loading import load_model
from tests.support.architectures import check_layout
from tests.support.extractors import batching_extractor
from tests.support.tiny_configs import build_tiny_vlm_type, image_text_types
from tests.support.vlm import special_token_ids, text_reference_states
from tests.support.vlm_types import FALLBACKS, NOT_BUILT, ONE_PER_BATCH, REFUSED, TEXT_THROUGH_DECODER

LENGTHS = (3, 29, 12, 21, 7)
TOLERANCE = 1e-5
TYPES = image_text_types()
WRITTEN = set(FALLBACKS) | set(ONE_PER_BATCH) | set(NOT_BUILT) | set(REFUSED) | set(TEXT_THROUGH_DECODER)
CI_TYPES = [t for i, t in enumerate(TYPES) if t in WRITTEN or i % 4 == 0]
SWEPT = TYPES if os.environ.get("LAYERTAP_FULL_SWEEP") else CI_TYPES


def prompts(vocab_size: int, avoid: set[int], seed: int = 0) -> list[list[int]]:
    """Text-only prompts of :data:`LENGTHS` tokens: ids below the vocabulary, none a token the config names."""
    allowed = torch.tensor([i for i in range(3, min(vocab_size, 128)) if i not in avoid])
    generator = torch.Generator().manual_seed(seed)
    return [allowed[torch.randint(len(allowed), (n,), generator=generator)].tolist() for n in LENGTHS]


def test_the_written_expectations_name_only_types_transformers_has():
    assert WRITTEN <= set(TYPES), sorted(WRITTEN - set(TYPES))


@pytest.mark.parametrize("model_type", SWEPT)
def test_token_id_jobs_on_every_vlm_type_equal_its_own_forward(model_type, tmp_path, caplog):
    if model_type in NOT_BUILT:
        with pytest.raises(Exception):  # noqa: B017 (the type's own error; the written reason says which)
            build_tiny_vlm_type(model_type, tmp_path / "model")
        return
    model_dir = str(build_tiny_vlm_type(model_type, tmp_path / "model"))
    try:
        loaded = load_model(model_dir, name=model_type, device="cpu", dtype="float32")
        extractor = batching_extractor(loaded, 300, layers=list(range(loaded.num_layers + 1)))
    except ModelRefused as refused:
        assert model_type in REFUSED, f"{model_type} refused: {refused}"
        assert REFUSED[model_type][0] in str(refused), str(refused)
        return
    assert model_type not in REFUSED, f"{model_type} was served: {loaded.batching.describe()}"
    check_layout(model_type, loaded.batching, caplog.text, FALLBACKS, ONE_PER_BATCH)
    layer_ids = list(range(loaded.num_layers + 1))
    batches: list[int] = []
    inputs = prompts(loaded.vocab_size, special_token_ids(loaded.model.config))
    with extractor:
        extractor.processor.engine.on_batch = lambda jobs, tokens: batches.append(jobs)
        results = extractor.extract(inputs, tmp_path / "files", run="vlm-sweep")
    if not loaded.batching.slow:
        assert max(batches) >= 2, f"no two prompts were batched together: {batches}"
    for ids, result in zip(inputs, results):
        assert result.ok, result.error
        files = load_hidden_states(result.path)
        assert files["token_ids"].tolist() == ids
        reference = text_reference_states(model_dir, ids, layer_ids, model_type in TEXT_THROUGH_DECODER)
        got = files["hidden_states"].flatten(2)  # a stream of several copies is stored as copies of H
        reference = reference.flatten(2)
        assert got.shape == reference.shape
        errors = ((got.double() - reference.double()).norm(dim=-1)
                  / reference.double().norm(dim=-1).clamp_min(1e-30)).amax(0)
        assert errors.max() <= TOLERANCE, f"{model_type}, {len(ids)} tokens: error per layer {errors.tolist()}"
