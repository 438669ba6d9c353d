"""``layertap serve``: answer the requests clients send to ``vllm serve`` with hidden-state
extraction (speculators' data generation) with jobs for layertap's workers
(``layertap.producer.serve``). Needs the ``serve`` extra (FastAPI, uvicorn; transformers for the
render route's tokenizer, without torch)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer

from layertap.producer.cli.common import CliError, err_console, load_settings
from layertap.protocol.naming import is_hub_id


def pick_model(model: str | None, workers: dict[str, dict[str, Any]]) -> str:
    """``--model``, or the one model the live workers serve."""
    served = sorted({info["model"] for info in workers.values()})
    if model is not None:
        return model
    if len(served) == 1:
        return served[0]
    if not served:
        raise CliError("no live worker: start one (`layertap worker --model ...`), or name the model it will "
                       "serve with --model")
    raise CliError(f"live workers serve several models ({', '.join(served)}): choose one with --model")


def workers_tokenizer(worker_model: str | None, workers: dict[str, dict[str, Any]], model: str) -> str | None:
    """Where the workers' tokenizer is: setting ``worker.model``, else a live worker's source, when it
    is a local folder or a hub id; None without one."""
    candidates = [worker_model, *(info.get("source") for info in workers.values() if info.get("model") == model)]
    return next((c for c in candidates if isinstance(c, str) and (Path(c).is_dir() or is_hub_id(c))), None)


def open_renderer(tokenizer: str | None, chat_template: str | Path | None, default: str | None) -> Any:
    """The render route's :class:`~layertap.producer.serve.render.ChatRenderer`: of ``--tokenizer`` (a
    failure is the command's error), else of ``default`` (a failure only turns the route off, said in
    a warning); None without either."""
    from layertap.extras import need

    source = tokenizer or default
    if source is None:
        return None
    try:
        need("transformers", "the render route of `layertap serve`", extra="serve")
        from layertap.producer.serve.render import ChatRenderer

        return ChatRenderer(source, chat_template)
    except (OSError, ValueError, RuntimeError) as exc:
        if tokenizer is not None:
            raise
        err_console.print(f"warning: no chat render: the workers' tokenizer ({source}) did not load ({exc}); "
                          "give --tokenizer", markup=False, highlight=False)
        return None


def serve(
    model: Optional[str] = typer.Option(None, "--model", help="Model name the jobs go to (the name live workers "
                                        "serve; default: the one model they serve). /v1/models lists it."),
    served_model_name: Optional[str] = typer.Option(None, "--served-model-name", help="The model's name for "
                                                    "clients (/v1/models, requests, answers), as vllm serve's flag; "
                                                    "e.g. the --verifier-name-or-path speculators train compares it "
                                                    "with (default: --model)."),
    run: str = typer.Option("serve", "--run", help="Run every request's job goes to."),
    layers: Optional[str] = typer.Option(None, "--layers", help="Layer ids of every job, e.g. 2,18,33,36 (vLLM "
                                         "ids; default: the workers' own, EAGLE-3's [2, L//2, L-3, L])."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
    port: int = typer.Option(8000, "--port", help="Port to listen on (vllm serve's default)."),
    tokenizer: Optional[str] = typer.Option(None, "--tokenizer", help="Model folder or hub id whose tokenizer and "
                                            "chat template answer /v1/chat/completions/render (default: the "
                                            "workers' model, a local folder or hub id)."),
    chat_template: Optional[Path] = typer.Option(None, "--chat-template", help="Jinja chat template file used "
                                                 "instead of the tokenizer's (default: setting "
                                                 "worker.chat_template, as the workers read it)."),
    timeout: float = typer.Option(600.0, "--timeout", min=1.0, help="Seconds a request waits for its job's "
                                  "result before a 504."),
    redis_url: Optional[str] = typer.Option(None, help="Redis URL."),
) -> None:
    """Answer vLLM's hidden-state extraction requests (models, completions, chat completions, chat
    render) with layertap jobs; each answer's kv_transfer_params.hidden_states_path is the job's file."""
    from layertap.extras import need

    uvicorn = need("uvicorn", "`layertap serve`", extra="serve")
    need("fastapi", "`layertap serve`", extra="serve")
    from layertap.producer.client.client import Client
    from layertap.producer.client.fleet import served_depths
    from layertap.producer.serve.app import build_app
    from layertap.producer.serve.front import Front, ServeConfig
    from layertap.protocol.layers import parse_layer_list, resolve_layer_ids

    settings = load_settings(redis_url=redis_url)
    with Client(settings) as probe:
        workers = probe.workers()
    name = pick_model(model, workers)
    layer_ids = parse_layer_list(layers) if layers is not None else None
    depth = served_depths(workers).get(name)
    if layer_ids is not None and depth is not None:
        resolve_layer_ids(layer_ids, depth)  # a LayerIdError (a ValueError) is the command's one-line error
    renderer = open_renderer(tokenizer, chat_template or settings.worker.chat_template,
                             workers_tokenizer(settings.worker.model, workers, name))
    config = ServeConfig(name, run, layer_ids, timeout, renderer, served_model_name)
    shown_layers = layer_ids if layer_ids is not None else "the workers' default"
    render = f"from {renderer.source}" if renderer else "off (no --tokenizer)"
    err_console.print(f"layertap serve: model {config.name} (workers' {name}), run {run}, layers {shown_layers}, "
                      f"chat render {render}; http://{host}:{port}/v1", markup=False, highlight=False)
    uvicorn.run(build_app(Front(settings, config)), host=host, port=port, log_level="warning")


def register(app: typer.Typer) -> None:
    """Add ``serve`` to the ``layertap`` app."""
    app.command(name="serve")(serve)
