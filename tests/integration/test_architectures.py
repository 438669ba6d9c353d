"""The architecture sweep: every decoder-only causal-LM type of the installed transformers
(listed by code: ``tests.support.tiny_configs.decoder_only_types``), batched the way the worker
batches it, equals plain transformers run on each prompt alone, layer by layer, in the vLLM
convention; or it is refused for the reason written in ``tests.support.architectures``.

Tiny random float32 models (2 layers of each kind, hidden 32, vocabulary 128) are saved, loaded
back through ``from_pretrained`` by the worker's own loader, self-checked (falling back packed ->
padded -> one prompt per batch) and served by the in-process engine. Several prompts of different
lengths (3 to 41 tokens) go in together; the test asserts that a type falls back exactly where
``FALLBACKS`` says (and to the layout it says), that a batching layout put two prompts in one
forward, and that every layer ``0..L`` of every prompt is within 1e-5 (relative, worst token)
of the reference (residual streams of several copies compared whole).

CI runs :data:`CI_TYPES` (every type with a written expectation or named by issue 24, and every
eighth of the rest);
``LAYERTAP_FULL_SWEEP=1`` runs every type.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

from layertap.producer.files.dataset import HiddenStatesDataset
from layertap.producer.files.manifest import entry_from_file
from layertap.producer.files.reader import load_hidden_states
from layertap.protocol.fileformat import MetaKey, metadata_of
from layertap.worker.extractor import Extractor
from layertap.worker.model.batching import ModelRefused
from layertap.worker.model.loading import load_model
from tests.support.architectures import (
    FALLBACKS,
    NOT_BUILT,
    ONE_PER_BATCH,
    REFUSED,
    SELECTION_ENGAGED,
    SERVED_SINCE_ISSUE_24,
    SHIFTED_HIDDEN_STATES,
    build_tiny,
    check_layout,
    sweep_prompts,
)
from tests.support.extractors import batching_extractor
from tests.support.processes import cli
from tests.support.reference import block_input_states, reference_states
from tests.support.tiny_configs import build_tiny_type, decoder_only_types

TOLERANCE = 1e-5
TYPES = decoder_only_types()
WRITTEN = set(FALLBACKS) | set(ONE_PER_BATCH) | set(REFUSED) | set(NOT_BUILT)
ALWAYS = set(WRITTEN) | set(SERVED_SINCE_ISSUE_24) | set(SELECTION_ENGAGED)
CI_TYPES = [t for i, t in enumerate(TYPES) if t in ALWAYS or i % 8 == 0]
SWEPT = TYPES if os.environ.get("LAYERTAP_FULL_SWEEP") else CI_TYPES


def worst_token_relative_error(got: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """``[T, n_layers, ...]`` pair -> ``[n_layers]``: the largest ``|got_t - ref_t| / |ref_t|`` over tokens."""
    got, reference = got.double().flatten(2), reference.double().flatten(2)
    return ((got - reference).norm(dim=-1) / reference.norm(dim=-1).clamp_min(1e-30)).amax(0)


def test_the_written_expectations_name_only_types_transformers_has():
    assert ALWAYS <= set(TYPES), sorted(ALWAYS - set(TYPES))
    assert not set(FALLBACKS) & set(REFUSED) and not set(ONE_PER_BATCH) & (set(FALLBACKS) | set(REFUSED))


@pytest.mark.parametrize("model_type", SWEPT)
def test_batched_files_equal_each_prompt_alone(model_type, tmp_path, caplog):
    if model_type in NOT_BUILT:
        with pytest.raises(Exception):  # noqa: B017 (the type's own error; the written reason says which)
            build_tiny_type(model_type, tmp_path / "model")
        return
    model_dir = str(build_tiny_type(model_type, tmp_path / "model"))
    loaded = None
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
    batches: list[tuple[int, int]] = []
    with extractor:
        extractor.processor.engine.on_batch = lambda jobs, tokens: batches.append((jobs, tokens))
        inputs = sweep_prompts(loaded.vocab_size)
        results = extractor.extract(inputs, tmp_path / "files", run="sweep")
    if not loaded.batching.slow:
        assert max(jobs for jobs, _ in batches) >= 2, f"no two prompts were batched together: {batches}"
    for ids, result in zip(inputs, results):
        assert result.ok, result.error
        files = load_hidden_states(result.path)
        assert files["token_ids"].tolist() == ids
        meta = metadata_of(result.path)
        assert meta[MetaKey.BATCHING] == loaded.batching.name
        assert json.loads(meta[MetaKey.LAYERS]) == layer_ids
        copies = int(meta.get(MetaKey.RESIDUAL_COPIES, "1"))
        assert files["hidden_states"].shape[2:-1] == ((copies,) if copies > 1 else ())
        references = [block_input_states(model_dir, ids, layer_ids)]
        if model_type not in SHIFTED_HIDDEN_STATES and copies == 1:  # transformers' own list holds one copy
            references.append(reference_states(model_dir, ids, layer_ids))
        for reference in references:
            got = files["hidden_states"].flatten(2)  # a stream 2H wide is stored as 2 copies of H
            assert got.shape == reference.flatten(2).shape
            errors = worst_token_relative_error(got, reference)
            assert errors.max() <= TOLERANCE, f"{model_type}, {len(ids)} tokens: error per layer {errors.tolist()}"


def test_the_self_check_refuses_padded_deepseek_v4_without_the_structural_rule(tmp_path):
    """Issue 44's mutation: padded batching forced on DeepSeek-V4 (the structural rule that serves it
    one prompt per batch bypassed) is refused by the load-time self-check, whose probes run from 3
    tokens past several times its window, compression blocks and indexer top-k."""
    model_dir = str(build_tiny_type("deepseek_v4", tmp_path / "model"))
    loaded = load_model(model_dir, name="forced", device="cpu", dtype="float32", batching="padded")
    with pytest.raises(ModelRefused, match="cannot serve DeepseekV4ForCausalLM: padded batching changes the hidden "
                                           r"states on the load-time self-check \(batched vs alone: .*8 probes of "
                                           "3-64 tokens; span named: 8 "):
        Extractor(loaded)


def test_forced_packing_of_a_hybrid_is_refused_by_the_self_check(tmp_path):
    """Packing a gated-delta-net hybrid leaks state between prompts; forced, it has no fallback."""
    model_dir = str(build_tiny("qwen3-next", tmp_path / "model"))
    loaded = load_model(model_dir, name="forced", device="cpu", dtype="float32", batching="packed")
    with pytest.raises(ModelRefused, match="cannot serve Qwen3NextForCausalLM: packed batching changes the hidden"):
        Extractor(loaded)


@pytest.mark.parametrize("name", ["gpt-oss-sinks", "gemma2-softcap"])
def test_forced_packing_without_the_attention_feature_is_refused(name, tmp_path):
    """Packed attention does not do sinks or softcapping: asked for anyway, the model is refused, not served."""
    loaded = load_model(str(build_tiny(name, tmp_path / "model")), name=name, device="cpu", dtype="float32",
                        batching="packed")
    with pytest.raises(ModelRefused, match="not supported by packed attention"):
        Extractor(loaded)


def worker_start(model_dir: str, redis_url: str, *extra: str) -> subprocess.CompletedProcess:
    """``layertap worker`` on a model that cannot be served (a reachable Redis: a worker checks it
    before it loads its model): it must exit at start, with one line."""
    env = {**os.environ, "LAYERTAP_REDIS_URL": redis_url}
    return subprocess.run(cli("worker", "--model", model_dir, "--device", "cpu", *extra), env=env,
                          capture_output=True, text=True, timeout=450)


def test_worker_refuses_at_start_with_one_line(tmp_path, redis_server):
    model_dir = str(build_tiny("qwen3-next", tmp_path / "model"))
    done = worker_start(model_dir, redis_server.url, "--batching", "packed")
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert errors and errors[0].startswith("error: cannot serve Qwen3NextForCausalLM: "
                                           "packed batching changes"), done.stderr
    assert "Traceback" not in done.stderr


def test_a_model_without_a_causal_decoder_is_refused_in_one_line(tmp_path, redis_server):
    from transformers import T5Config, T5ForConditionalGeneration

    T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2)
                               ).save_pretrained(tmp_path / "t5")
    done = worker_start(str(tmp_path / "t5"), redis_server.url)
    assert done.returncode != 0
    assert ("error: cannot serve T5Config (t5): an encoder-decoder: its decoder cross-attends"
            in done.stderr), done.stderr
    assert "Traceback" not in done.stderr


def test_a_stream_of_several_copies_is_read_whole_by_the_datasets(tmp_path):
    """DeepSeek-V4's hyper-connections carry [B, T, copies, H]: files hold them whole, say so in
    the header, and the manifest, the dataset and its collate read them."""
    model_dir = str(build_tiny_type("deepseek_v4", tmp_path / "model"))
    loaded = load_model(model_dir, name="hc", device="cpu", dtype="float32")
    copies = loaded.model.config.hc_mult
    layer_ids = [0, loaded.num_layers]
    inputs = sweep_prompts(loaded.vocab_size)[:2]
    with Extractor(loaded, layers=layer_ids) as extractor:
        results = extractor.extract(inputs, tmp_path / "files", run="hc")
    assert all(result.ok for result in results), [result.error for result in results]
    assert metadata_of(results[0].path)[MetaKey.RESIDUAL_COPIES] == str(copies)
    dataset = HiddenStatesDataset([entry_from_file(r.job_id, r.path, verify=True) for r in results])
    items = [dataset[0], dataset[1]]
    for ids, item in zip(inputs, items):
        assert item["hidden_states"].shape == (len(ids), 2, copies, loaded.hidden_size)
        reference = block_input_states(model_dir, ids, layer_ids)
        assert worst_token_relative_error(item["hidden_states"], reference).max() <= TOLERANCE
    batch = HiddenStatesDataset.collate(items)
    assert batch["hidden_states"].shape == (2, max(map(len, inputs)), 2, copies, loaded.hidden_size)


def test_a_checkpoint_whose_weights_do_not_all_load_is_refused(tmp_path):
    """A weight the model's class names but its checkpoint lacks (renamed here; in the wild, a
    checkpoint saved under another class's names) would be initialized at random by
    transformers, which only logs it: the worker refuses the model instead of serving it."""
    from safetensors.torch import load_file, save_file

    model_dir = build_tiny_type("llama", tmp_path / "model")
    weights = load_file(model_dir / "model.safetensors")
    weights["model.final_norm.weight"] = weights.pop("model.norm.weight")
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelRefused, match="1 of its weights are not in its checkpoint as its class names them "
                                           r"\(model.norm.weight\)"):
        load_model(str(model_dir), name="renamed", device="cpu", dtype="float32")
