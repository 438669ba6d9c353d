"""A request becomes one job's fields, or is refused (a 400 naming the field and why).

* a completion's prompt of token ids is a ``token_ids`` job (the file holds exactly those ids), a
  text prompt a ``prompt`` job (tokenized with special tokens, as vLLM's default
  ``add_special_tokens`` does);
* a chat is a ``messages`` job with its ``tools`` and ``add_generation_prompt`` (the job's
  ``generation_prompt``), rendered by the worker's template; its loss mask is left to the client
  (``loss_on: none``), as vLLM gives none;
* ``truncate_prompt_tokens`` N with ``truncation_side`` ``right`` keeps the first N tokens
  (``max_length`` N, ``truncate``); -1 keeps what fits the worker's limit;
* what the jobs cannot do is refused, never dropped: generating tokens (``max_tokens`` over 1),
  streaming, ``n`` over 1, log-probabilities, ``echo``, a batch of prompts, left truncation, a
  request's own chat template or template arguments, a closed-final-turn override
  (``continue_final_message``), and ``kv_transfer_params`` choosing a path or output tokens.
"""

from __future__ import annotations

from typing import Any

from layertap.producer.serve.errors import refused
from layertap.producer.serve.wire import PATH_KEY, ChatRequest, CompletionRequest, GenerationRequest


def check_generation(request: GenerationRequest, max_tokens: int | None) -> None:
    """Refuse what no layertap job answers, whatever the route."""
    if max_tokens is not None and max_tokens > 1:
        raise refused(f"max_tokens is {max_tokens}: layertap serve extracts the prompt's hidden states and "
                      "generates no tokens; ask for max_tokens 1 (as speculators does)", "max_tokens")
    if request.stream:
        raise refused("stream is not supported: the answer comes once the job's file is written", "stream")
    if request.n != 1:
        raise refused(f"n is {request.n}: one request is one job, with n 1", "n")
    params = request.kv_transfer_params or {}
    if PATH_KEY in params:
        raise refused(f"kv_transfer_params.{PATH_KEY} is refused: the worker chooses where a file goes "
                      "(paths never come from requests)", "kv_transfer_params")
    if params.get("include_output_tokens"):
        raise refused("kv_transfer_params.include_output_tokens is refused: no output token is generated",
                      "kv_transfer_params")


def truncation(request: GenerationRequest) -> dict[str, Any]:
    """The job's ``max_length``/``truncate`` for the request's ``truncate_prompt_tokens``."""
    keep = request.truncate_prompt_tokens
    if keep is None:
        return {}
    if request.truncation_side != "right":
        raise refused(f"truncation_side is {request.truncation_side or 'unset (the tokenizer side)'}: layertap "
                      "keeps a prompt's first tokens; send truncation_side 'right'", "truncation_side")
    return {"truncate": True} if keep == -1 else {"truncate": True, "max_length": keep}


def completion_fields(request: CompletionRequest) -> dict[str, Any]:
    """The job fields of ``POST /v1/completions`` (without model, run, id and layers)."""
    check_generation(request, request.max_tokens)
    for name in ("echo", "suffix", "logprobs", "prompt_logprobs"):
        if getattr(request, name):
            raise refused(f"{name} is not supported: layertap serve answers with the prompt's states only", name)
    prompt = request.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
        if len(prompt) != 1:
            raise refused(f"prompt holds {len(prompt)} prompts: send one prompt per request (one request is one "
                          "job)", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not request.add_special_tokens:
            raise refused("add_special_tokens false is not supported for a text prompt: the worker tokenizes "
                          "with special tokens; send token ids instead", "add_special_tokens")
        return {"prompt": prompt, **truncation(request)}
    return {"token_ids": prompt, **truncation(request)}


def check_chat_rendering(request: ChatRequest) -> None:
    """Refuse a chat template sent with the request (vLLM refuses one unless told to trust it)."""
    if request.chat_template is not None:
        raise refused("chat_template is refused: chats are rendered with the model's template (a worker's "
                      "LAYERTAP_WORKER__CHAT_TEMPLATE)", "chat_template")


def chat_fields(request: ChatRequest) -> dict[str, Any]:
    """The job fields of ``POST /v1/chat/completions`` (without model, run, id and layers)."""
    check_generation(request, request.max_completion_tokens or request.max_tokens)
    check_chat_rendering(request)
    if request.logprobs:
        raise refused("logprobs is not supported: layertap serve answers with the prompt's states only", "logprobs")
    if request.chat_template_kwargs:
        raise refused("chat_template_kwargs is not supported by layertap's chat jobs: render the chat with "
                      "/v1/chat/completions/render and send its token ids to /v1/completions",
                      "chat_template_kwargs")
    if request.continue_final_message:
        raise refused("continue_final_message is not supported by layertap's chat jobs (the last turn is "
                      "rendered closed): render with /v1/chat/completions/render and send its token ids to "
                      "/v1/completions", "continue_final_message")
    if request.add_special_tokens:
        raise refused("add_special_tokens true is not supported for a chat: the template's text is tokenized "
                      "without added special tokens", "add_special_tokens")
    fields: dict[str, Any] = {"messages": request.messages, "loss_on": "none",
                              "generation_prompt": request.add_generation_prompt, **truncation(request)}
    if request.tools is not None:
        fields["tools"] = request.tools
    return fields
