"""Chat jobs: the template renders the tokens, and loss_mask marks exactly the assistant turns.

The reference is built independently: each template's turns are tokenized piece by piece
(pieces split where the template puts special tokens or newlines) and the assistant
pieces are marked by hand.
"""

from __future__ import annotations

import pytest

from producer.reader import load_hidden_states
from tests.reference import load

CHAT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What does a draft model predict?"},
    {"role": "assistant", "content": "the next tokens of the large model."},
    {"role": "user", "content": "Name two colours."},
    {"role": "assistant", "content": "Red and blue."},
]


def chatml_reference(tokenizer, messages):
    ids, mask = [], []
    for m in messages:
        if m["role"] == "assistant":
            pieces = [("<|im_start|>assistant\n", 0), (f"{m['content']}<|im_end|>\n", 1)]
        else:
            pieces = [(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n", 0)]
        for text, flag in pieces:
            piece = tokenizer(text, add_special_tokens=False)["input_ids"]
            ids += piece
            mask += [flag] * len(piece)
    return ids, mask


def llama_reference(tokenizer, messages):
    ids = tokenizer("<|begin_of_text|>", add_special_tokens=False)["input_ids"]
    mask = [0] * len(ids)
    for m in messages:
        header = tokenizer(f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n", add_special_tokens=False)["input_ids"]
        body = tokenizer(f"{m['content']}<|eot_id|>", add_special_tokens=False)["input_ids"]
        ids += header + body
        mask += [0] * len(header) + [1 if m["role"] == "assistant" else 0] * len(body)
    return ids, mask


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
