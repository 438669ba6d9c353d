"""The job measures bundles and limits use: estimated tokens, JSON bytes, and whether one job's input
extends another's (a conversation's next per-turn row)."""

from __future__ import annotations

from layertap.protocol.schema import CHARS_PER_TOKEN, Job, json_size, oversize


def test_estimated_tokens_come_from_the_input():
    assert Job(model="m", token_ids=[1, 2, 3]).estimated_tokens() == 3
    assert Job(model="m", prompt="x" * 4000).estimated_tokens() == 4000 // CHARS_PER_TOKEN
    chat = [{"role": "user", "content": "a" * 40}, {"role": "assistant", "content": "b" * 20,
                                                    "reasoning_content": "c" * 20}]
    assert Job(model="m", messages=chat).estimated_tokens() == 80 // CHARS_PER_TOKEN
    assert Job(model="m", prompt="hi").estimated_tokens() == 1  # never zero
    assert Job(model="m", prompt="x" * 4000, max_length=64, truncate=True).estimated_tokens() == 64
    assert Job(model="m", prompt="x" * 4000, max_length=64).estimated_tokens() == 1000  # refused, not cut


def test_json_size_is_compact_ascii_escaped_json():
    data = {"model": "m", "prompt": "é ü"}
    assert json_size(data) == len('{"model":"m","prompt":"\\u00e9 \\u00fc"}')  # what the worker measures too


def test_oversize_is_exact_at_the_limit():
    job = Job(model="m", prompt="\U0001f600" * 100)  # each one a 12-character escape in json_size
    payload = job.model_dump(mode="json", exclude_none=True)
    size = json_size(payload)
    assert oversize(job, payload, size) is None
    assert oversize(job, payload, size - 1) == size
    assert oversize(job, payload, 10**9) is None


def test_a_later_turns_row_extends_the_rows_before_it():
    user, answer, more = ({"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                          {"role": "user", "content": "and?"})
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    assert Job(model="m", token_ids=[1, 2, 3]).extends(Job(model="m", token_ids=[1, 2]))
    assert not Job(model="m", token_ids=[1, 2]).extends(Job(model="m", token_ids=[1, 2, 3]))
    assert not Job(model="m", token_ids=[1, 3, 4]).extends(Job(model="m", token_ids=[1, 2]))
    assert Job(model="m", messages=[user, answer, more]).extends(Job(model="m", messages=[user, answer]))
    assert not Job(model="m", messages=[user, more]).extends(Job(model="m", messages=[user, answer]))
    assert not Job(model="m", messages=[user, answer, more], tools=tools).extends(Job(model="m", messages=[user]))
    assert Job(model="m", prompt="one. two.").extends(Job(model="m", prompt="one."))
    assert not Job(model="m", prompt="one. two.").extends(Job(model="m", token_ids=[1]))
    assert not Job(model="m", token_ids=[1, 2]).extends(Job(model="m", prompt="one."))
