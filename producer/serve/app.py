"""The routes of ``layertap serve`` (FastAPI), each answering as vLLM's server does.

Every error, a malformed body and an unknown route included, has vLLM's error body; the routes
are listed in ``layertap.producer.serve``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from layertap.producer.serve.errors import ServeError
from layertap.producer.serve.front import Front
from layertap.producer.serve.jobs import chat_fields, completion_fields
from layertap.producer.serve.wire import (
    ChatRequest,
    CompletionRequest,
    chat_answer,
    completion_answer,
    models_answer,
    render_answer,
)


def error_response(error: ServeError) -> JSONResponse:
    """``error`` as vLLM's error body (``ServeError.body``), with its HTTP status."""
    return JSONResponse(error.body(), status_code=error.status)


def invalid_body(exc: RequestValidationError) -> ServeError:
    """A 400 naming the first fields the body got wrong."""
    errors = exc.errors()
    if any(error["type"] == "json_invalid" for error in errors):
        return ServeError(400, "invalid request: the body is not a JSON object")
    parts = []
    for error in errors[:3]:
        where = ".".join(str(part) for part in error["loc"] if part != "body")
        parts.append(f"{where}: {error['msg']}" if where else error["msg"])
    first = errors[0]["loc"] if errors else ()
    return ServeError(400, "invalid request: " + "; ".join(parts), str(first[1]) if len(first) > 1 else None)


def build_app(front: Front) -> FastAPI:
    """The app serving ``front``'s model; its lifespan opens and closes ``front``."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        front.open(asyncio.get_running_loop())
        try:
            yield
        finally:
            front.close()

    app = FastAPI(title="layertap serve", lifespan=lifespan, docs_url=None, redoc_url=None)
    started = time.time()
    model = front.config.name

    @app.exception_handler(ServeError)
    async def serve_error(_: Request, exc: ServeError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def request_invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(invalid_body(exc))

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        return error_response(ServeError(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> JSONResponse:  # a bug, or a file gone before it was read
        return error_response(ServeError(500, f"{type(exc).__name__}: {exc}"))

    @app.get("/health")
    async def health() -> Response:
        if await asyncio.to_thread(front.live):
            return Response(status_code=200)
        return error_response(ServeError(503, f"no live worker serves {front.config.model}"))

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return models_answer(model, started)

    async def extracted(request: Any, prefix: str, fields: Callable[[Any], dict[str, Any]],
                        answer: Callable[..., dict[str, Any]]) -> dict[str, Any]:
        """The answer to ``request``'s one job (``prefix``: its id's start, vLLM's for the route)."""
        front.check_model(request.model)
        result = await front.extract(prefix, fields(request))
        ids = await front.prompt_ids(result) if request.return_token_ids else None
        return answer(result.job_id, model, result, ids)

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest) -> dict[str, Any]:
        return await extracted(request, "cmpl", completion_fields, completion_answer)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatRequest) -> dict[str, Any]:
        return await extracted(request, "chatcmpl", chat_fields, chat_answer)

    @app.post("/v1/chat/completions/render")
    async def render(request: ChatRequest) -> dict[str, Any]:
        front.check_model(request.model)
        renderer = front.config.renderer
        if renderer is None:
            raise ServeError(501, "this layertap serve renders no chats: start it with --tokenizer MODEL_DIR "
                                  "(the worker's model folder)")
        token_ids = await asyncio.to_thread(renderer.render, request)
        return render_answer(f"render-{uuid.uuid4().hex}", model, token_ids)

    return app
