"""Vision-language checkpoints (saved as ``...ForConditionalGeneration``) serve text and
token-id jobs exactly: batched the way the worker batches them, every language-model layer
of every prompt equals the plain model's own ``forward`` on that prompt alone (fp32, 1e-5).

Tiny random VLMs (``tests/support/vlm.py``), no hub. The weights-only folders have no
tokenizer and no processor: token-id jobs need neither.
"""

from __future__ import annotations

import pytest
import torch

from producer.files.reader import load_hidden_states
from tests.support.vlm import TEXT_VOCAB, VLM_FAMILIES, build_tiny_vlm, vlm_block_states
from worker.extractor import Extractor
from worker.model.loading import load_model
from worker.model.tiny_model import build_tokenizer

LENGTHS = (3, 21, 9, 14)
TOLERANCE = 1e-5


def worst_token_relative_error(got: torch.Tensor, reference: torch.Tensor) -> float:
    errors = (got.double() - reference.double()).norm(dim=-1) / reference.double().norm(dim=-1).clamp_min(1e-30)
    return float(errors.max())


@pytest.mark.parametrize("family", sorted(VLM_FAMILIES))
def test_token_id_jobs_on_a_vlm_checkpoint_equal_its_own_forward(family, tmp_path):
    model_dir = str(build_tiny_vlm(family, tmp_path / "model"))
    loaded = load_model(model_dir, name=family, device="cpu", dtype="float32")
    assert loaded.architecture.endswith("ForConditionalGeneration"), loaded.architecture
    assert loaded.tokenizer is None
    layer_ids = list(range(loaded.num_layers + 1))
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randint(3, TEXT_VOCAB, (n,), generator=generator).tolist() for n in LENGTHS]
    batches: list[int] = []
    with Extractor(loaded, layers=layer_ids, batch_wait_ms=300) as extractor:
        extractor.processor.engine.on_batch = lambda jobs, tokens: batches.append(jobs)
        results = extractor.extract(inputs, tmp_path / "files", run="vlm-text")
    assert max(batches) >= 2, f"no two prompts were batched together: {batches}"
    for ids, result in zip(inputs, results):
        assert result.ok, result.error
        states = load_hidden_states(result.path)
        assert states["token_ids"].tolist() == ids
        reference = vlm_block_states(model_dir, layer_ids, input_ids=torch.tensor([ids]))
        assert states["hidden_states"].shape == reference.shape
        error = worst_token_relative_error(states["hidden_states"], reference)
        assert error <= TOLERANCE, f"{family}, {len(ids)} tokens: worst relative error {error}"


def test_prompt_jobs_on_a_vlm_checkpoint_use_its_tokenizer(tmp_path):
    """With a tokenizer beside the weights (no image processor), chat jobs render and equal the reference."""
    model_dir = build_tiny_vlm("qwen2-vl", tmp_path / "model")
    tokenizer = build_tokenizer("qwen3", vocab_size=TEXT_VOCAB)
    tokenizer.save_pretrained(model_dir)
    chats = [[{"role": "user", "content": "hello model"}, {"role": "assistant", "content": "the draft layer"}],
             [{"role": "user", "content": "why"}, {"role": "assistant", "content": "one two three"}]]
    with Extractor(str(model_dir), layers=[0, 2], device="cpu", dtype="float32") as extractor:
        results = extractor.extract(chats, tmp_path / "files", run="vlm-chat")
    for chat, result in zip(chats, results):
        assert result.ok, result.error
        states = load_hidden_states(result.path)
        ids = tokenizer.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"]
        assert states["token_ids"].tolist() == ids
        reference = vlm_block_states(str(model_dir), [0, 2], input_ids=torch.tensor([ids]))
        assert worst_token_relative_error(states["hidden_states"], reference) <= TOLERANCE
