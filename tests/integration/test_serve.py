"""``layertap serve``: vLLM's hidden-state extraction routes answered by real workers.

A real ``layertap serve`` process on a free port, the session's Redis and tiny-qwen3 worker. The
HTTP surface is checked against vLLM's shapes (models list, completions and chat completions with
``kv_transfer_params`` and ``prompt_token_ids``, the chat render route, vLLM's error body); the
files it names hold plain transformers' states; the render route gives what transformers'
own chat template and tokenizer give.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import httpx2
import pytest
import torch
from safetensors.torch import load_file

from tests.support.chat_server import ServerProcess, free_port
from tests.support.processes import cli
from tests.support.reference import load, reference_states

MODEL = "tiny-qwen3"
#: The session worker's default layers for the 4-layer tiny model (EAGLE-3's, clamped: [2, 2, 1, 4]).
LAYERS = [1, 2, 4]
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is a residual stream?"},
        {"role": "assistant", "content": "the sum every layer adds to"}]


@pytest.fixture(scope="module")
def front(workers, redis_server, tiny_models, storage_root, tmp_path_factory):
    """``layertap serve`` for tiny-qwen3 in a run of its own, rendering chats with the model's tokenizer."""
    run = f"serve-{uuid.uuid4().hex[:8]}"
    port = free_port()
    logs = tmp_path_factory.mktemp("serve")
    server = ServerProcess(cli("serve", "--run", run, "--port", str(port), "--tokenizer", str(tiny_models["qwen3"])),
                           port, logs / "serve.log", env={"LAYERTAP_REDIS_URL": redis_server.url})
    server.start(timeout=120)
    server.run = run  # type: ignore[attr-defined]
    yield server
    server.kill()


def post(front, route: str, body: dict) -> httpx2.Response:
    return httpx2.post(f"{front.url}{route}", json=body, timeout=120)


def test_models_and_health(front):
    listed = httpx2.get(f"{front.url}/models", timeout=10).json()
    assert [entry["id"] for entry in listed["data"]] == [MODEL]
    assert listed["object"] == "list"
    assert httpx2.get(f"{front.url.removesuffix('/v1')}/health", timeout=10).status_code == 200


def test_completion_answers_with_the_workers_file(front, tiny_models, storage_root):
    _, tokenizer = load(str(tiny_models["qwen3"]))
    ids = tokenizer.apply_chat_template(CHAT, tokenize=True, return_dict=True)["input_ids"]
    answer = post(front, "/completions", {"model": MODEL, "prompt": ids, "max_tokens": 1,
                                          "extra": "ignored, as vLLM ignores unknown fields", "return_token_ids": True})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    choice = body["choices"][0]
    assert choice["prompt_token_ids"] == ids and choice["text"] == "" and choice["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] == len(ids)
    path = Path(body["kv_transfer_params"]["hidden_states_path"])
    assert path.name == f"{body['id']}.safetensors"  # vLLM's <request id>.safetensors
    assert path.is_relative_to(storage_root / front.run)  # the worker's path, in the run's folder
    assert Path(f"{path}.lock").exists()  # vLLM's readers open it first
    states = load_file(path)
    assert states["token_ids"].tolist() == ids
    torch.testing.assert_close(states["hidden_states"], reference_states(str(tiny_models["qwen3"]), ids, LAYERS),
                               atol=1e-5, rtol=1e-5)


def test_chat_completion_is_rendered_by_the_worker(front, tiny_models):
    _, tokenizer = load(str(tiny_models["qwen3"]))
    answer = post(front, "/chat/completions", {"messages": CHAT, "max_tokens": 1, "add_generation_prompt": False,
                                               "return_token_ids": True})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    expected = tokenizer.apply_chat_template(CHAT, tokenize=True, return_dict=True)["input_ids"]
    assert body["prompt_token_ids"] == expected  # at the top of a chat answer, as vLLM puts it
    assert body["object"] == "chat.completion" and body["choices"][0]["message"] == {"role": "assistant",
                                                                                        "content": ""}
    assert load_file(body["kv_transfer_params"]["hidden_states_path"])["token_ids"].tolist() == expected


def test_render_gives_the_templates_token_ids(front, tiny_models):
    _, tokenizer = load(str(tiny_models["qwen3"]))
    prompt = tokenizer.apply_chat_template(CHAT[:2], tokenize=False, add_generation_prompt=True)
    expected = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    answer = post(front, "/chat/completions/render", {"messages": CHAT[:2], "add_generation_prompt": True})
    assert answer.status_code == 200, answer.text
    assert answer.json()["token_ids"] == expected
    cut = post(front, "/chat/completions/render", {"messages": CHAT[:2], "add_generation_prompt": True,
                                                   "truncate_prompt_tokens": 5, "truncation_side": "right"})
    assert cut.json()["token_ids"] == expected[:5]


@pytest.mark.parametrize(("route", "body", "status", "words"), [
    ("/completions", {"max_tokens": 1}, 400, "prompt: Field required"),
    ("/completions", {"prompt": [5, 6], "max_tokens": 4}, 400, "generates no tokens"),
    ("/completions", {"prompt": [5, 6], "stream": True}, 400, "stream is not supported"),
    ("/completions", {"prompt": [[5, 6], [7]]}, 400, "send one prompt per request"),
    ("/completions", {"prompt": [5, 6], "kv_transfer_params": {"hidden_states_path": "/tmp/x.safetensors"}}, 400,
     "the worker chooses where a file goes"),
    ("/completions", {"prompt": [5, 6], "model": "other-model"}, 404, "The model `other-model` does not exist"),
    ("/chat/completions", {"messages": CHAT, "continue_final_message": True}, 400,
     "continue_final_message is not supported"),
    ("/chat/completions", {"messages": CHAT}, 400, "the chat must not end with one"),  # add_generation_prompt
])
def test_a_request_it_cannot_answer_is_refused_with_vllms_error_body(front, route, body, status, words):
    answer = post(front, route, body)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert words in error["message"]
    assert error["code"] == status and error["type"] == {400: "BadRequestError", 404: "NotFoundError"}[status]


def test_a_job_error_is_an_error_answer(front):
    answer = post(front, "/completions", {"prompt": [5, 10**6, 7], "max_tokens": 1})
    assert answer.status_code == 400, answer.text
    message = answer.json()["error"]["message"]
    assert f"of run {front.run} failed: bad_token_ids:" in message
    assert "1000000" in message  # the worker's own words name the id
