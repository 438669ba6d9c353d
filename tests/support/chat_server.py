"""Real OpenAI-compatible endpoints for the ``layertap regenerate`` tests, as processes.

* :func:`transformers_serve`: ``transformers serve`` itself, on a tiny local model (CPU, offline).
* ``python -m tests.support.chat_server MODEL PORT LOG``: a small chat-completions server on the
  same model with plain ``transformers`` ``generate`` (greedy, or sampled with ``seed``), for what
  ``transformers serve`` does not offer: vLLM's ``return_token_ids`` (``prompt_token_ids`` and the
  choice's ``token_ids``) and a tool call when asked for one (``tool_choice: "required"``: the
  model's generated text becomes the arguments of a call to the first tool, as constrained
  decoding would force the shape), and OpenAI's ``logit_bias`` (``{token id: bias}``, so a test can
  have the model say a token it needs). Every answer is appended to LOG, so a test compares against
  what the server sent, not what the client kept.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class ServerProcess:
    """A server subprocess on ``port``; ``start`` waits until ``/v1/models`` answers."""

    argv: list[str]
    port: int
    log_path: Path
    process: subprocess.Popen | None = None
    env: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self, timeout: float = 180.0) -> ServerProcess:
        import httpx2

        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **self.env}
        with open(self.log_path.with_suffix(".out"), "ab") as out:
            self.process = subprocess.Popen(self.argv, env=env, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        # one client for every poll: each new one loads the CA bundle (25 ms of CPU; 16 s of a full run)
        with httpx2.Client(timeout=2) as poller:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(f"the server exited with {self.process.returncode}: "
                                       f"{self.log_path.with_suffix('.out').read_text()[-2000:]}")
                try:
                    if poller.get(f"{self.url}/models").status_code == 200:
                        return self
                except httpx2.TransportError:
                    pass
                time.sleep(0.2)
        raise RuntimeError(f"the server did not answer within {timeout:.0f}s")

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)

    def answers(self) -> list[dict[str, Any]]:
        """Every answer the server sent (the small server only)."""
        if not self.log_path.exists():
            return []
        return [json.loads(line) for line in self.log_path.read_text().splitlines() if line.strip()]


def transformers_serve(model_dir: Path, log_path: Path) -> ServerProcess:
    port = free_port()
    return ServerProcess([sys.executable, "-m", "transformers.cli.transformers", "serve", str(model_dir),
                          "--host", "127.0.0.1", "--port", str(port)], port, log_path)


def small_server(model_dir: Path, log_path: Path) -> ServerProcess:
    port = free_port()
    return ServerProcess([sys.executable, "-m", "tests.support.chat_server", str(model_dir), str(port),
                          str(log_path)], port, log_path)


def build_app(model_dir: str, log_path: str) -> Any:
    import torch
    from fastapi import FastAPI
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    lock = threading.Lock()
    app = FastAPI()

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_dir, "object": "model"}]}

    @app.post("/v1/chat/completions")
    def chat(body: dict[str, Any]) -> dict[str, Any]:
        tools = body.get("tools")
        text = tokenizer.apply_chat_template(body["messages"], tools=tools, add_generation_prompt=True,
                                             tokenize=False)
        prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        sample = (body.get("temperature") or 0) > 0
        bias = {(int(token),): float(value) for token, value in (body.get("logit_bias") or {}).items()}
        with lock, torch.no_grad():
            if body.get("seed") is not None:
                torch.manual_seed(body["seed"])
            output = model.generate(torch.tensor([prompt_ids]), max_new_tokens=body.get("max_tokens", 16),
                                    do_sample=sample, temperature=body.get("temperature") if sample else None,
                                    pad_token_id=tokenizer.pad_token_id, sequence_bias=bias or None)
        ids = output[0, len(prompt_ids):].tolist()
        content = tokenizer.decode(ids, skip_special_tokens=True)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        finish = "stop" if ids and ids[-1] == tokenizer.eos_token_id else "length"
        if tools and body.get("tool_choice") == "required":
            name = tools[0]["function"]["name"]
            message = {"role": "assistant", "content": None, "tool_calls": [
                {"id": f"call_{uuid.uuid4().hex[:12]}", "type": "function",
                 "function": {"name": name, "arguments": json.dumps({"text": content})}}]}
            finish = "tool_calls"
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish}
        answer: dict[str, Any] = {"id": uuid.uuid4().hex, "object": "chat.completion", "model": model_dir,
                                  "choices": [choice]}
        if body.get("return_token_ids"):
            answer["prompt_token_ids"], choice["token_ids"] = prompt_ids, ids
        with open(log_path, "a", encoding="utf-8") as log:
            log.write(json.dumps({"request": body, "answer": answer}) + "\n")
        return answer

    return app


if __name__ == "__main__":
    import uvicorn

    model_path, port_text, log_file = sys.argv[1:4]
    uvicorn.run(build_app(model_path, log_file), host="127.0.0.1", port=int(port_text), log_level="warning")
