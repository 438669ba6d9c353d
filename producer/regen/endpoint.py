"""One chat completion from an OpenAI-compatible endpoint (vLLM, SGLang, ``transformers serve``),
tried again with exponential backoff on transient failures.

Retried: HTTP 408, 409, 425, 429 and 5xx, and transport errors (refused or dropped
connections, timeouts: a server restarting). Any other status is an :class:`EndpointError`
at once (the request itself is wrong). Token ids are taken when the server returns them
(vLLM's ``return_token_ids``: ``prompt_token_ids`` on the response, ``token_ids`` on the choice);
a server that refuses the field (HTTP 400/422 naming it: ``transformers serve``, OpenAI) is asked
again without it, and from then on never with it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import httpx2 as httpx

from layertap.transport.backoff import Backoff

RETRY_STATUSES = frozenset({408, 409, 425, 429})
TOKEN_IDS_FIELD = "return_token_ids"


class EndpointError(RuntimeError):
    """A completion that failed for good; the message says why."""


@dataclass(frozen=True)
class Reply:
    """The assistant message of one completion and, when the server sent them, its token ids."""

    message: dict[str, Any]
    finish_reason: str | None
    model: str | None
    prompt_token_ids: list[int] | None
    token_ids: list[int] | None


def retryable_status(status: int) -> bool:
    """An HTTP status worth trying again: 408, 409, 425, 429 or any 5xx."""
    return status in RETRY_STATUSES or status >= 500


def assistant_message(raw: dict[str, Any]) -> dict[str, Any]:
    """The reply's message as a chat turn: content, reasoning (``reasoning_content`` or vLLM's
    newer ``reasoning``) and tool calls, nothing else."""
    message: dict[str, Any] = {"role": "assistant", "content": raw.get("content")}
    reasoning = raw.get("reasoning_content") or raw.get("reasoning")
    if reasoning:
        message["reasoning_content"] = reasoning
    if raw.get("tool_calls"):
        message["tool_calls"] = [{key: call[key] for key in ("id", "type", "function") if key in call}
                                 for call in raw["tool_calls"]]
    return message


def parse_reply(body: Any) -> Reply:
    """A :class:`Reply` from a chat completion body; raises :class:`EndpointError` if it is not one."""
    try:
        choice = body["choices"][0]
        return Reply(assistant_message(choice["message"]), choice.get("finish_reason"), body.get("model"),
                     body.get("prompt_token_ids"), choice.get("token_ids"))
    except (KeyError, IndexError, TypeError) as exc:
        raise EndpointError(f"the endpoint's answer is not a chat completion ({type(exc).__name__}: {exc})") from None


class ChatEndpoint:
    """POSTs to ``<base_url>/chat/completions`` with ``sampling`` merged into every request.
    Use as an async context manager; one instance is shared by all concurrent conversations."""

    def __init__(self, base_url: str, model: str, sampling: dict[str, Any], *, retries: int = 8,
                 backoff: Backoff = Backoff(0.5, 30.0), timeout_s: float = 600.0, api_key: str | None = None,
                 max_connections: int = 64):
        self.model, self.sampling = model, sampling
        self.retries, self.backoff = retries, backoff
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.AsyncClient(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout_s,
                                        limits=httpx.Limits(max_connections=max_connections))
        self.retried = 0  # requests sent again, over the endpoint's life
        self.token_ids_refused = False  # the server refused return_token_ids once: never sent again

    async def __aenter__(self) -> ChatEndpoint:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.client.aclose()

    async def complete(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                       seed: int | None = None) -> Reply:
        """The model's next assistant turn after ``messages``."""
        body: dict[str, Any] = {**self.sampling, "model": self.model, "messages": messages}
        if tools:
            body["tools"] = tools
        if seed is not None:
            body["seed"] = seed
        for attempt in range(self.retries + 1):
            last = attempt == self.retries
            if self.token_ids_refused:
                body.pop(TOKEN_IDS_FIELD, None)
            try:
                response = await self.client.post("/chat/completions", json=body)
            except httpx.TransportError as exc:
                if last:
                    raise EndpointError(f"no answer after {attempt + 1} tries: {type(exc).__name__}: {exc}") from None
            else:
                if response.status_code == 200:
                    return parse_reply(response.json())
                if self._refuses_token_ids(body, response):
                    continue
                if not retryable_status(response.status_code) or last:
                    raise EndpointError(f"HTTP {response.status_code} after {attempt + 1} tries: "
                                        f"{response.text[:300]}")
            self.retried += 1
            await asyncio.sleep(self.backoff.delay(attempt))
        raise EndpointError(f"no answer after {self.retries + 1} tries")

    def _refuses_token_ids(self, body: dict[str, Any], response: Any) -> bool:
        """True (and remember it) when the server refused the request for ``return_token_ids``."""
        if TOKEN_IDS_FIELD in body and response.status_code in (400, 422) and TOKEN_IDS_FIELD in response.text:
            self.token_ids_refused = True
            return True
        return False
