"""Chat jobs: the template renders the tokens, and loss_mask marks exactly the assistant turns.

The reference is built independently: each template's turns are tokenized piece by piece
(pieces split where the template puts special tokens or newlines) and the assistant
pieces are marked by hand.
"""

from __future__ import annotations

import pytest

from producer.files.reader import load_hidden_states
from tests.support.jobs import CHAT, chatml_reference, llama_reference
from tests.support.reference import load


@pytest.mark.parametrize("arch,reference", [("qwen3", chatml_reference), ("llama", llama_reference)])
def test_loss_mask_marks_assistant_turns(arch, reference, workers, tiny_models, client, run_name):
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
