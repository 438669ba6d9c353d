"""The OpenAI/vLLM request and answer records ``layertap serve`` speaks (vLLM's field names and defaults).

Requests keep unknown fields and ignore them, as vLLM does; the fields read here are those that
decide what layertap would do (``layertap.producer.serve.jobs`` refuses the values it cannot
honour). Answers carry what vLLM's do: ``prompt_token_ids`` (``return_token_ids``; on the choice
of a completion, at the top of a chat completion) and ``kv_transfer_params``.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from layertap.protocol.schema import Result

#: ``kv_transfer_params`` key of a file's path (vLLM's ExampleHiddenStatesConnector's).
PATH_KEY = "hidden_states_path"
#: ``finish_reason`` of every answer: no token is generated, the length limit (1) ends it.
FINISH_REASON = "length"


class GenerationRequest(BaseModel):
    """What completions and chat completions share."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = None
    n: int = 1
    stream: bool | None = False
    return_token_ids: bool | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    truncation_side: Literal["left", "right"] | None = None
    kv_transfer_params: dict[str, Any] | None = None


class CompletionRequest(GenerationRequest):
    """``POST /v1/completions``."""

    prompt: list[int] | list[list[int]] | str | list[str]
    echo: bool | None = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True


class ChatRequest(GenerationRequest):
    """``POST /v1/chat/completions`` and ``POST /v1/chat/completions/render``."""

    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False


def models_answer(model: str, created: float) -> dict[str, Any]:
    """``GET /v1/models``: the one model served."""
    return {"object": "list", "data": [{"id": model, "object": "model", "created": int(created),
                                        "owned_by": "layertap", "root": model, "parent": None}]}


def _usage(result: Result) -> dict[str, int]:
    tokens = result.num_tokens or 0
    return {"prompt_tokens": tokens, "completion_tokens": 0, "total_tokens": tokens}


def completion_answer(request_id: str, model: str, result: Result, prompt_ids: list[int] | None) -> dict[str, Any]:
    """A completion's answer for the ok ``result`` of its job (``prompt_ids``: the file's, if asked)."""
    choice: dict[str, Any] = {"index": 0, "text": "", "logprobs": None, "finish_reason": FINISH_REASON,
                              "stop_reason": None}
    if prompt_ids is not None:
        choice.update(prompt_token_ids=prompt_ids, token_ids=[])
    return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [choice], "usage": _usage(result), "kv_transfer_params": {PATH_KEY: result.path}}


def chat_answer(request_id: str, model: str, result: Result, prompt_ids: list[int] | None) -> dict[str, Any]:
    """A chat completion's answer for the ok ``result`` of its job."""
    choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": FINISH_REASON, "stop_reason": None}
    answer: dict[str, Any] = {"id": request_id, "object": "chat.completion", "created": int(time.time()),
                              "model": model, "choices": [choice], "usage": _usage(result),
                              "kv_transfer_params": {PATH_KEY: result.path}}
    if prompt_ids is not None:
        choice["token_ids"] = []
        answer["prompt_token_ids"] = prompt_ids
    return answer


def render_answer(request_id: str, model: str, token_ids: list[int]) -> dict[str, Any]:
    """``POST /v1/chat/completions/render``: the rendered chat's token ids."""
    return {"request_id": request_id, "model": model, "token_ids": token_ids}
