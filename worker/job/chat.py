"""Rendering chats with the chat template, and the loss mask of assistant turns.

The template is the tokenizer's: the model's own, or the worker's ``chat_template`` file,
which replaces it when the model is loaded. Tools go to the template as ``tools=`` and
each message's ``reasoning_content`` as a message field. A template that ignores given
tools, or the last assistant turn's reasoning, is a ``chat_template`` error: the record
would silently lose them.

The mask marks the tokens a draft model should learn to predict. Default rule: for each
trained assistant turn (all of them, or only the last with ``loss_on="last"``), everything
the template emits after that turn's generation prompt through the end of the turn
(reasoning, content, tool calls, end-of-turn tokens). Spans are found by rendering
prefixes: ``render(turns[:k], add_generation_prompt=True)`` ends where turn ``k`` starts
and ``render(turns[:k+1])`` ends where it stops; both must be prefixes of the whole chat.

Rendering every prefix costs time quadratic in the turns, so the spans are first read off
one streamed rendering of the whole chat (``ChatRenderer.streamed_reads``: the output
length when the template first reads each message, a fixed distance after where the
message's text starts, measured on the first turn by the prefix rule); they are used when
the streamed text is the chat's rendering and the prefix rule holds at the first, the
last and two middle assistant turns, else every prefix is rendered.

Templates that rewrite earlier turns (Qwen3 drops the reasoning of turns before the last
user message) break that for earlier turns only: ``loss_on="last"`` still works. With
``loss_on="all"`` such a template is used through its ``{% generation %}`` blocks when it
has them (the mask is then exactly what those blocks enclose, by transformers'
``return_assistant_tokens_mask``); without them the chat is a ``chat_template`` error.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any, Literal

from transformers.utils import chat_template_utils
from transformers.utils.chat_template_utils import _compile_jinja_template

from layertap.protocol.schema import ErrorType
from layertap.worker.job.errors import JobError

GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")


def _plain(data: Any) -> Any:
    """``data`` as plain template data, as the installed transformers makes it (its helper is
    private and newer than transformers 5.0: used only where present)."""
    helper = getattr(chat_template_utils, "_plain_template_data", None)
    return data if helper is None else helper(data)


def _as_transformers_renders(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as the installed transformers' ``apply_chat_template`` hands them to the
    template: plain data, with reasoning fields aliased where that version aliases them."""
    alias = getattr(chat_template_utils, "_alias_reasoning_fields", None)
    chat = _plain(messages)
    return chat if alias is None else alias(chat)


class TemplateRewritesTurns(Exception):
    """A turn's prefix rendering is not a prefix of the whole chat's rendering."""


#: Assistant turns at which streamed spans are checked against the prefix rule (first, last, middle).
CHECKED_TURNS = 4


class _WatchedMessage(dict):
    """A message that reports each read of its fields (``on_read(index)``)."""

    def __init__(self, data: dict[str, Any], index: int, on_read: Any):
        super().__init__(data)
        self._index, self._on_read = index, on_read

    def __getitem__(self, key: Any) -> Any:
        self._on_read(self._index)
        return super().__getitem__(key)

    def get(self, key: Any, default: Any = None) -> Any:
        self._on_read(self._index)
        return super().get(key, default)

    def __contains__(self, key: object) -> bool:
        self._on_read(self._index)
        return super().__contains__(key)


class _WatchedMessages(list):
    """The message list; iterating it (the template's loop) reports each message handed out."""

    def __init__(self, items: list[_WatchedMessage], on_yield: Any):
        super().__init__(items)
        self._on_yield = on_yield

    def __iter__(self) -> Iterator[Any]:
        for index, item in enumerate(list.__iter__(self)):
            self._on_yield(index)
            yield item


class ChatRenderer:
    """One chat's renderings with one tokenizer's template. Not thread-safe (the tokenizer is shared)."""

    def __init__(self, tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None):
        self.tokenizer = tokenizer
        self.messages = messages
        self.tools = tools
        try:
            self.template = tokenizer.get_chat_template(None, tools)
        except ValueError:
            raise JobError(ErrorType.chat_template, "this model's tokenizer has no chat template; send a prompt or "
                                                    "token_ids instead, or give the worker --chat-template") from None

    def render(self, count: int, *, generation_prompt: bool, tools: bool = True) -> str:
        """The text of the first ``count`` messages."""
        try:
            return self.tokenizer.apply_chat_template(
                self.messages[:count], tools=self.tools if tools else None, tokenize=False,
                add_generation_prompt=generation_prompt)
        except Exception as exc:  # jinja errors, raise_exception() in templates
            raise JobError(ErrorType.chat_template, f"the chat template could not render this chat: {exc}") from None

    def streamed_reads(self, text: str) -> list[int] | None:
        """``reads[i]``: the output length at the first read of message ``i`` after the
        template's loop reached it, from one streamed rendering of the whole chat. Message
        ``i``'s text starts a fixed number of characters earlier (what the loop body emits
        before it reads the message cannot depend on it). None when the stream is not
        ``text`` (a template this cannot follow)."""
        emitted, yielded, first_read = 0, set(), {}

        def on_read(index: int) -> None:
            if index in yielded and index not in first_read:
                first_read[index] = emitted

        chat = _as_transformers_renders(self.messages)
        watched = _WatchedMessages([_WatchedMessage(m, i, on_read) for i, m in enumerate(chat)], yielded.add)
        pieces = []
        try:
            for piece in self._generate(watched):
                pieces.append(piece)
                emitted += len(piece)
        except Exception:  # the real rendering already succeeded: this template is one the stream cannot follow
            return None
        if "".join(pieces) != text or len(first_read) != len(self.messages):
            return None
        return [first_read[i] for i in range(len(self.messages))]

    def _generate(self, messages: list[Any]) -> Iterator[str]:
        """The whole chat's rendering (no generation prompt) as the template streams it out."""
        return _compile_jinja_template(self.template).generate(
            messages=messages, tools=_plain(self.tools), documents=None, add_generation_prompt=False,
            **_plain(self.tokenizer.special_tokens_map))

    def stream(self) -> Iterator[str]:
        """The whole chat's text piece by piece as the template emits it, stopping quietly where the
        template fails (the full rendering reports that). For reading no further than needed: the
        pieces are the template's own output, not checked against ``apply_chat_template``'s."""
        try:
            yield from self._generate(_as_transformers_renders(self.messages))
        except Exception:  # jinja errors, raise_exception(): the real rendering raises them as chat_template errors
            return

    def turn_span(self, index: int, text: str) -> tuple[int, int]:
        """Character span of assistant turn ``index`` in ``text`` (the whole chat), by the prefix rule."""
        before = self.render(index, generation_prompt=True) if index else ""
        through = self.render(index + 1, generation_prompt=False)
        if not (through.startswith(before) and text.startswith(through)):
            raise TemplateRewritesTurns(f"the chat template does not render turn {index} as a prefix of the whole "
                                        "chat (it rewrites earlier turns)")
        return len(before), len(through)

    def generation_block_mask(self, generation_prompt: bool = False) -> tuple[list[int], list[int]]:
        """Token ids and the mask of the template's ``{% generation %}`` blocks."""
        try:
            encoded = self.tokenizer.apply_chat_template(self.messages, tools=self.tools, tokenize=True,
                                                         add_generation_prompt=generation_prompt,
                                                         return_dict=True, return_assistant_tokens_mask=True)
        except Exception as exc:
            raise JobError(ErrorType.chat_template, f"the chat template could not render this chat: {exc}") from None
        return list(encoded["input_ids"]), list(encoded["assistant_masks"])


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
                loss_on: Literal["all", "last", "none"] = "all", generation_prompt: bool = False,
                check_stream: Callable[[Iterator[str]], None] | None = None) -> tuple[list[int], list[int]]:
    """Token ids of the rendered chat and a 0/1 loss mask over them (1 = trained assistant tokens;
    all 0 with ``loss_on="none"``). With ``generation_prompt`` the text ends with the template's
    generation prompt, which is never trained on. ``check_stream`` gets the chat's text as the
    template streams it out, before the chat is rendered whole or tokenized (it reads as far as it
    needs and raises to stop there)."""
    renderer = ChatRenderer(tokenizer, messages, tools)
    if check_stream is not None:
        check_stream(renderer.stream())
    text = renderer.render(len(messages), generation_prompt=False)
    if tools and text == renderer.render(len(messages), generation_prompt=False, tools=False):
        raise JobError(ErrorType.chat_template, "the chat template ignores tools: this model's template does not "
                                                "render them (give the worker a template that does)")
    _check_reasoning_rendered(messages, text)
    whole = text
    if generation_prompt:
        whole = renderer.render(len(messages), generation_prompt=True)
        if not whole.startswith(text):
            raise JobError(ErrorType.chat_template, "the chat template's generation prompt rewrites the chat "
                                                    "before it, so the chat's tokens cannot be kept")
    turns = [index for index, message in enumerate(messages) if message["role"] == "assistant"]
    if loss_on == "none":
        turns = []
    elif loss_on == "last":
        turns = turns[-1:]
    try:
        spans = _streamed_spans(renderer, text, turns) or [renderer.turn_span(index, text) for index in turns]
    except TemplateRewritesTurns as exc:
        if loss_on == "all" and GENERATION_BLOCK.search(renderer.template):
            return renderer.generation_block_mask(generation_prompt)
        hint = ("; use loss_on='last', or a template with {% generation %} blocks" if loss_on == "all" else "")
        raise JobError(ErrorType.chat_template, f"{exc}, so its assistant tokens cannot be located{hint}") from None
    return _mask_spans(tokenizer, whole, spans)


def _streamed_spans(renderer: ChatRenderer, text: str, turns: list[int]) -> list[tuple[int, int]] | None:
    """Each turn's span from one streamed rendering, if it agrees with the prefix rule at the
    checked turns (raises :class:`TemplateRewritesTurns` where the rule fails); else None.
    With fewer turns than are checked, rendering every prefix costs no more: None."""
    if len(turns) < CHECKED_TURNS:
        return None
    reads, suffix = renderer.streamed_reads(text), _generation_prompt(renderer)
    if reads is None or suffix is None:
        return None
    lead = reads[turns[0] + 1] - renderer.turn_span(turns[0], text)[1]  # what the loop emits before a read
    starts = [read - lead for read in reads] + [len(text)]
    spans = [(starts[index] + len(suffix) if index else 0, starts[index + 1]) for index in turns]
    picks = {0, len(turns) - 1, *(len(turns) * part // (CHECKED_TURNS - 1) for part in range(1, CHECKED_TURNS - 1))}
    if any(renderer.turn_span(turns[pick], text) != spans[pick] for pick in sorted(picks)):
        return None
    return spans


def _generation_prompt(renderer: ChatRenderer) -> str | None:
    """What the template adds for ``add_generation_prompt`` after the first message, if it only appends."""
    plain = renderer.render(1, generation_prompt=False)
    prompted = renderer.render(1, generation_prompt=True)
    return prompted[len(plain):] if prompted.startswith(plain) else None


def _check_reasoning_rendered(messages: list[dict[str, Any]], text: str) -> None:
    """The last assistant turn's reasoning must be in the text (templates may drop earlier turns' reasoning)."""
    last = next((m for m in reversed(messages) if m["role"] == "assistant"), None)
    reasoning = (last or {}).get("reasoning_content")
    if reasoning and reasoning.strip() not in text:
        raise JobError(ErrorType.chat_template, "the chat template does not render reasoning_content: the last "
                                                "assistant turn's reasoning is missing from the rendered chat")


def _mask_spans(tokenizer: Any, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """Tokenize ``text``; mark each token that starts inside a span (spans ascending, disjoint)."""
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    token_ids = list(encoded["input_ids"])
    mask = [0] * len(token_ids)
    span_index = 0
    for position, (char_start, char_end) in enumerate(encoded["offset_mapping"]):
        while span_index < len(spans) and char_start >= spans[span_index][1]:
            span_index += 1
        if (span_index < len(spans) and spans[span_index][0] <= char_start < spans[span_index][1]
                and char_end > char_start):
            mask[position] = 1
    return token_ids, mask
