"""Chat jobs: the template renders the tokens, and loss_mask marks exactly the assistant turns.

The reference is built independently: each template's turns are tokenized piece by piece
(pieces split where the template puts special tokens or newlines) and the assistant
pieces are marked by hand.
"""

from __future__ import annotations

import pytest

from layertap.producer.files.reader import load_hidden_states
from tests.support.jobs import CHAT, chatml_reference, llama_reference
from tests.support.reference import load


@pytest.mark.parametrize("arch,reference", [("qwen3", chatml_reference), ("llama", llama_reference)])
def test_loss_mask_marks_assistant_turns(arch, reference, arch_workers, tiny_models, client, run_name):
    _, tokenizer = load(str(tiny_models[arch]))
    job = client.submit({"messages": CHAT}, model=f"tiny-{arch}", run=run_name)
    result = client.wait(run_name, [job.job_id], timeout=60)[job.job_id]
    assert result.ok, result.error
    files = load_hidden_states(result.path)
    expected_ids, expected_mask = reference(tokenizer, CHAT)
    assert files["token_ids"].tolist() == expected_ids
    assert files["loss_mask"].tolist() == expected_mask
    assert files["loss_mask"].shape == files["token_ids"].shape


def test_truncated_chat_keeps_mask_aligned(workers, tiny_models, client, run_name):
    _, tokenizer = load(str(tiny_models["qwen3"]))
    full_ids, full_mask = chatml_reference(tokenizer, CHAT)
    cut = len(full_ids) - 3
    job = client.submit({"messages": CHAT, "max_length": cut, "truncate": True}, model="tiny-qwen3", run=run_name)
    result = client.wait(run_name, [job.job_id], timeout=60)[job.job_id]
    assert result.ok, result.error
    files = load_hidden_states(result.path)
    assert files["token_ids"].tolist() == full_ids[:cut]
    assert files["loss_mask"].tolist() == full_mask[:cut]


def test_analysis_chat_without_an_assistant_turn(workers, tiny_models, client, run_name):
    """``loss_on="none"`` with ``generation_prompt``: a user-only chat (an interpretability probe)
    is extracted up to where the answer would start, nothing marked; without ``loss_on="none"``
    the same chat is refused as untrainable."""
    import torch

    from layertap.protocol.schema import ErrorType
    from tests.support.reference import reference_states

    _, tokenizer = load(str(tiny_models["qwen3"]))
    chat = CHAT[:2]  # system + user
    probe = client.submit({"messages": chat, "loss_on": "none", "generation_prompt": True, "layers": [0, 2]},
                          model="tiny-qwen3", run=run_name)
    refused = client.submit({"messages": chat}, model="tiny-qwen3", run=run_name)
    results = client.wait(run_name, [probe.job_id, refused.job_id], timeout=60)
    assert results[refused.job_id].error_type == ErrorType.no_trainable_tokens
    assert results[probe.job_id].ok, results[probe.job_id].error
    files = load_hidden_states(results[probe.job_id].path)
    expected_ids = list(tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                                      return_dict=True)["input_ids"])
    without_prompt = list(tokenizer.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"])
    assert len(expected_ids) > len(without_prompt)  # the generation prompt is really there
    assert files["token_ids"].tolist() == expected_ids
    assert files["loss_mask"].tolist() == [0] * len(expected_ids)
    expected = reference_states(str(tiny_models["qwen3"]), expected_ids, [0, 2])
    torch.testing.assert_close(files["hidden_states"].float(), expected, atol=1e-5, rtol=1e-5)
