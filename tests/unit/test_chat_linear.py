"""Chat rendering is linear in the turns, and tokenizing never stalls the other jobs.

The loss mask from one streamed rendering must equal the prefix rule applied to every
turn (the quadratic reference); a long chat renders with a bounded number of template
renderings; while one is being prepared, small jobs are prepared beside it.
"""

from __future__ import annotations

import threading

import pytest

from layertap.protocol.schema import ErrorType, Job
from layertap.settings import Limits
from layertap.worker.job.chat import (
    CHECKED_TURNS,
    ChatRenderer,
    _mask_spans,
    _streamed_spans,
    render_chat,
)
from layertap.worker.job.errors import JobError
from layertap.worker.job.tokenize import Preparer
from layertap.worker.model.loading import load_model
from tests.support.architectures import ARCHES


def chat(turns: int) -> list[dict]:
    messages = [{"role": "system", "content": "be brief"}]
    for i in range(turns // 2):
        messages += [{"role": "user", "content": f"question {i}: " + "why " * (i % 5 + 1)},
                     {"role": "assistant", "content": f"answer {i}\n" + "because " * (i % 7 + 1)}]
    return messages


def quadratic_reference(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """The prefix rule at every assistant turn: two renderings per turn."""
    renderer = ChatRenderer(tokenizer, messages, None)
    text = renderer.render(len(messages), generation_prompt=False)
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    return _mask_spans(tokenizer, text, [renderer.turn_span(i, text) for i in turns])


@pytest.mark.parametrize("arch", ARCHES)
def test_streamed_spans_equal_the_prefix_rule_at_every_turn(arch, tiny_models):
    tokenizer = load_model(str(tiny_models[arch]), device="cpu").tokenizer
    messages = chat(40)
    renderer = ChatRenderer(tokenizer, messages, None)
    text = renderer.render(len(messages), generation_prompt=False)
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    assert _streamed_spans(renderer, text, turns) == [renderer.turn_span(i, text) for i in turns]  # the fast path
    assert render_chat(tokenizer, messages) == quadratic_reference(tokenizer, messages)


def test_a_long_chat_takes_a_bounded_number_of_renderings(tiny_models):
    tokenizer = load_model(str(tiny_models["qwen3"]), device="cpu").tokenizer
    calls = []
    real = tokenizer.apply_chat_template
    tokenizer.apply_chat_template = lambda *args, **kwargs: (calls.append(1), real(*args, **kwargs))[1]
    try:
        ids, mask = render_chat(tokenizer, chat(600))
    finally:
        del tokenizer.apply_chat_template
    assert sum(mask) > 0
    assert len(calls) <= 2 * CHECKED_TURNS + 6, len(calls)  # the prefix rule everywhere would take ~600


def test_small_jobs_are_prepared_while_a_long_chat_is(tiny_models):
    loaded = load_model(str(tiny_models["qwen3"]), name="tiny-qwen3", device="cpu")
    preparer = Preparer(loaded, [1, 4], Limits())
    # 4,095 turns with the system prompt: rendered whole, then cut to the model's 32,768 positions
    long_chat = Job(model="tiny-qwen3", messages=chat(4094), truncate=True)
    done: list[int] = []
    worker = threading.Thread(target=lambda: done.append(preparer.prepare(long_chat).truncated_from))
    worker.start()
    threading.Event().wait(0.05)
    small = [len(preparer.prepare(Job(model="tiny-qwen3", prompt=f"small job {i}")).token_ids) for i in range(10)]
    assert all(small) and worker.is_alive() and not done  # ten small jobs went by, the chat still rendering
    worker.join(120)
    assert done and done[0] > 100_000


def test_a_prompt_that_cannot_fit_is_refused_unread(tiny_models):
    loaded = load_model(str(tiny_models["qwen3"]), name="tiny-qwen3", device="cpu")
    preparer = Preparer(loaded, [1, 4], Limits(max_tokens=1000))
    with pytest.raises(JobError) as refused:
        preparer.prepare(Job(model="tiny-qwen3", prompt="word " * 200_000))
    assert refused.value.error_type == ErrorType.too_long and "at least" in refused.value.message
