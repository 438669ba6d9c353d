"""Per-turn rows share their prefixes (issue 47, item 1): a bundle of rows in which each row is a
conversation through one more turn computes only its conversations' longest rows, and every file
equals plain transformers run on that row alone; a model whose states at a prefix depend on the row's
length (DeepSeek-V4's indexer) shares nothing. Tiny random float32 models, the worker's own processor."""

from __future__ import annotations

import random

import pytest

from layertap.protocol.schema import Job
from layertap.storage.registry import storage_for
from layertap.worker.extractor import Extractor
from layertap.worker.model.loading import load_model
from tests.support.extractors import batching_extractor
from tests.support.tiny_configs import build_tiny_type
from tests.support.turns import conversations, worst_error

TOLERANCE = 1e-5
TURNS = (13, 29, 44, 60)  # a row per assistant turn: the conversation through it


@pytest.mark.parametrize(("model_type", "order"), [("qwen3", "turns"), ("qwen3", "shuffled"), ("qwen3_next", "turns")])
def test_a_bundle_of_per_turn_rows_computes_each_conversation_once(model_type, order, tmp_path):
    model_dir = str(build_tiny_type(model_type, tmp_path / "model"))
    loaded = load_model(model_dir, name=model_type, device="cpu", dtype="float32")
    layers = list(range(loaded.num_layers + 1))
    rows = [row for family in conversations(4, TURNS) for row in family]
    if order == "shuffled":
        random.Random(0).shuffle(rows)
    with batching_extractor(loaded, 300, layers=layers) as extractor:
        engine = extractor.processor.engine
        assert engine.prefix_sharing, "the load-time prefix check passed"
        computed, shared = engine.stats.tokens, engine.stats.shared_tokens
        bundle = [Job(model=model_type, run="turns", token_ids=ids, layers=layers) for ids in rows]
        results = extractor.processor.writing_to(storage_for(str(tmp_path / "files"))).process_many(bundle)
        computed, shared = engine.stats.tokens - computed, engine.stats.shared_tokens - shared
    assert all(result.ok for result in results), [result.error for result in results if not result.ok]
    assert computed == 4 * max(TURNS) and shared == sum(map(len, rows)) - computed
    assert worst_error(model_dir, rows, [result.path for result in results], layers) <= TOLERANCE


def test_a_model_whose_prefix_states_depend_on_the_row_shares_nothing(tmp_path, caplog):
    model_dir = str(build_tiny_type("deepseek_v4", tmp_path / "model"))
    loaded = load_model(model_dir, name="v4", device="cpu", dtype="float32")
    layers = [0, loaded.num_layers]
    rows = conversations(1, TURNS)[0]
    with Extractor(loaded, layers=layers) as extractor:
        assert not extractor.processor.engine.prefix_sharing
        results = extractor.extract(rows, tmp_path / "files", run="turns")
        assert extractor.processor.engine.stats.shared_tokens == 0
    assert "rows that begin with another row are computed on their own: a row's states differ" in caplog.text
    assert worst_error(model_dir, rows, [result.path for result in results], layers) <= TOLERANCE


def test_a_model_served_one_prompt_per_batch_shares_nothing(tmp_path, caplog):
    """Its states depend on the forward that computes them, so a longer row's forward (another width,
    other roundings) may pick other keys than the row's own: no row is served from another, though
    the float32 prefix check passes."""
    model_dir = str(build_tiny_type("qwen3", tmp_path / "model"))
    rows = conversations(1, TURNS)[0]
    with batching_extractor(model_dir, 300, layers=[0, 2], device="cpu", dtype="float32",
                            batching="single") as extractor:
        assert extractor.loaded.batching.slow and not extractor.processor.engine.prefix_sharing
        results = extractor.extract(rows, tmp_path / "files", run="turns")
        assert extractor.processor.engine.stats.shared_tokens == 0
    assert "rows that begin with another row are computed on their own: it is served one prompt per batch" \
        in caplog.text
    assert worst_error(model_dir, rows, [result.path for result in results], [0, 2]) <= TOLERANCE
