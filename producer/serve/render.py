"""``POST /v1/chat/completions/render``: a chat's token ids, as vLLM's render route gives them.

The model's tokenizer and chat template are loaded here, without the model (transformers, no
torch needed): give the worker's model folder, and its chat template file where the worker
was given one (``LAYERTAP_WORKER__CHAT_TEMPLATE``). Rendering is vLLM's: the template's text
(``add_generation_prompt``, ``continue_final_message``, ``tools``, ``chat_template_kwargs``),
tokenized with ``add_special_tokens`` (default false), then cut to ``truncate_prompt_tokens``
(``right`` keeps the first tokens, ``left`` the last; unset: the tokenizer's side).
"""

from __future__ import annotations

import threading
from pathlib import Path

from layertap.producer.serve.errors import ServeError, refused
from layertap.producer.serve.jobs import check_chat_rendering
from layertap.producer.serve.wire import ChatRequest


class ChatRenderer:
    """The tokenizer and chat template of ``source`` (a model folder or hub id; ``chat_template``: a
    Jinja file used instead of its template)."""

    def __init__(self, source: str | Path, chat_template: str | Path | None = None):
        from transformers import AutoTokenizer

        self.source = str(source)
        self.tokenizer = AutoTokenizer.from_pretrained(self.source)
        if chat_template is not None:
            self.tokenizer.chat_template = Path(chat_template).read_text()
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"the tokenizer of {self.source} has no chat template: give --chat-template FILE")
        self._lock = threading.Lock()  # a fast tokenizer refuses concurrent calls ("Already borrowed")

    def render(self, request: ChatRequest) -> list[int]:
        """The chat's token ids; a chat the template cannot render is a 400 with the template's message."""
        check_chat_rendering(request)
        if request.add_generation_prompt and request.continue_final_message:
            raise refused("add_generation_prompt and continue_final_message cannot both be true",
                          "continue_final_message")
        with self._lock:
            return self._truncated(self._encode(request), request)

    def _encode(self, request: ChatRequest) -> list[int]:
        try:
            text = self.tokenizer.apply_chat_template(
                request.messages, tools=request.tools, tokenize=False,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message, **(request.chat_template_kwargs or {}))
        except Exception as exc:  # a template raises what it likes (raise_exception, TypeError, KeyError...)
            raise ServeError(400, f"the chat template could not render this chat: {exc}") from None
        return list(self.tokenizer.encode(text, add_special_tokens=request.add_special_tokens))

    def _truncated(self, token_ids: list[int], request: ChatRequest) -> list[int]:
        keep = request.truncate_prompt_tokens
        if keep is None or len(token_ids) <= keep:
            return token_ids
        if keep == -1:
            raise refused("truncate_prompt_tokens -1 (the model's length) is not known to the render route: "
                          "send a token count", "truncate_prompt_tokens")
        side = request.truncation_side or getattr(self.tokenizer, "truncation_side", "right")
        return token_ids[:keep] if side == "right" else token_ids[len(token_ids) - keep:]
