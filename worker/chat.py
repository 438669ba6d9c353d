"""Rendering chats with the model's chat template, and the loss mask of assistant turns.

The mask marks the tokens a draft model should learn to predict: for each assistant
turn, everything the template emits after that turn's generation prompt up to the end
of the turn (content and end-of-turn tokens). Spans are found by rendering prefixes of
the conversation: ``render(turns[:k], add_generation_prompt=True)`` ends where turn
``k``'s content starts and ``render(turns[:k+1])`` ends where it stops. This needs a
template that renders a conversation's prefix as a prefix of the whole (true of ChatML,
Llama 3, Mistral and most others); a template that rewrites earlier turns (some drop
past reasoning) is reported as a ``chat_template`` error rather than guessed at.
"""

from __future__ import annotations

from typing import Any

from producer.schema import ErrorType
from worker.errors import JobError


def _render(tokenizer: Any, messages: list[dict[str, Any]], template: str | None, *, generation_prompt: bool) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                             chat_template=template)
    except Exception as exc:  # jinja errors, raise_exception() in templates, missing template
        raise JobError(ErrorType.chat_template, f"the chat template could not render this chat: {exc}") from None


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], template: str | None = None) -> tuple[list[int], list[int]]:
    """Token ids of the rendered chat and a 0/1 loss mask over them (1 = assistant turn)."""
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise JobError(ErrorType.chat_template, "this model's tokenizer has no chat template; send a prompt "
                                                "or token_ids instead, or configure a template")
    text = _render(tokenizer, messages, template, generation_prompt=False)
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:index], template, generation_prompt=True) if index else ""
        through = _render(tokenizer, messages[: index + 1], template, generation_prompt=False)
        if not (through.startswith(before) and text.startswith(through)):
            raise JobError(ErrorType.chat_template,
                           f"the chat template does not render turn {index} as a prefix of the whole chat "
                           "(it rewrites earlier turns), so assistant tokens cannot be located")
        spans.append((len(before), len(through)))
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    token_ids = list(encoded["input_ids"])
    mask = [0] * len(token_ids)
    span_index = 0
    for position, (char_start, char_end) in enumerate(encoded["offset_mapping"]):
        while span_index < len(spans) and char_start >= spans[span_index][1]:
            span_index += 1
        if span_index < len(spans) and spans[span_index][0] <= char_start < spans[span_index][1] and char_end > char_start:
            mask[position] = 1
    return token_ids, mask
