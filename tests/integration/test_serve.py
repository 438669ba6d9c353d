"""``layertap serve``: vLLM's hidden-state extraction routes answered by real workers.

A real ``layertap serve`` process on a free port, the session's Redis and tiny-qwen3 worker. The
HTTP surface is checked against vLLM's shapes (models list, completions and chat completions with
``kv_transfer_params`` and ``prompt_token_ids``, the chat render route, vLLM's error body); the
files it names hold plain transformers' states; the render route gives what transformers'
own chat template and tokenizer give. speculators' own prepare-data, generate-offline-data and
trainer (``--on-missing generate``) run against it unchanged, the trainer reading through
layertap's backend, which refuses wrong ``--target-layer-ids`` before the first step.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import uuid
from pathlib import Path

import datasets
import httpx2
import pytest
import torch
from safetensors.torch import load_file

from layertap.protocol.fileformat import MetaKey, metadata_of
from tests.support.chat_server import ServerProcess, free_port
from tests.support.processes import cli
from tests.support.reference import load, reference_states
from tests.support.speculators_env import speculators_argv, speculators_env

MODEL = "tiny-qwen3"  # the workers' name for it; requests may name it so too
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
    folder = str(tiny_models["qwen3"])  # the served name: what speculators train --verifier-name-or-path names
    server = ServerProcess(cli("serve", "--model", MODEL, "--run", run, "--port", str(port), "--tokenizer", folder,
                               "--served-model-name", folder),
                           port, logs / "serve.log",
                           env={"LAYERTAP_REDIS_URL": redis_server.url, "LAYERTAP_STORAGE_ROOT": str(storage_root)})
    server.start(timeout=120)
    server.run = run  # type: ignore[attr-defined]
    yield server
    server.kill()


def post(front, route: str, body: dict) -> httpx2.Response:
    return httpx2.post(f"{front.url}{route}", json=body, timeout=120)


def test_models_and_health(front, tiny_models):
    listed = httpx2.get(f"{front.url}/models", timeout=10).json()
    assert [entry["id"] for entry in listed["data"]] == [str(tiny_models["qwen3"])]
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


# -- speculators' own data generation and trainer, unchanged, through layertap serve ----------------

#: ShareGPT conversations: one or two exchanges each, so prepare-data fans out one row per assistant turn.
CONVERSATIONS = [[{"from": "human", "value": f"question {i}: what is {i} plus {i}?"},
                  {"from": "gpt", "value": f"it is {2 * i}. " * (1 + i % 3)},
                  *([{"from": "human", "value": "and twice that?"}, {"from": "gpt", "value": f"{4 * i}."}]
                    if i % 2 else [])] for i in range(6)]
#: Rows generate-offline-data writes; the trainer asks for the others on demand.
GENERATED = 4


def expected_rows(tokenizer) -> list[tuple[list[int], list[int]]]:
    """Per assistant turn, plain transformers' render of the chat through it and the loss mask after
    its generation prompt: what speculators' prepare-data derives from a vLLM render route."""
    rows = []
    for conversation in CONVERSATIONS:
        chat = [{"role": "user" if turn["from"] == "human" else "assistant", "content": turn["value"]}
                for turn in conversation]
        for end in range(1, len(chat), 2):
            ids = tokenizer(tokenizer.apply_chat_template(chat[:end + 1], tokenize=False), add_special_tokens=False)
            prompt = tokenizer(tokenizer.apply_chat_template(chat[:end], tokenize=False, add_generation_prompt=True),
                               add_special_tokens=False)
            boundary = len(prompt["input_ids"])
            rows.append((ids["input_ids"], [0] * boundary + [1] * (len(ids["input_ids"]) - boundary)))
    return sorted(rows)


def speculators(*args: str, ok: bool = True, **env: str) -> subprocess.CompletedProcess:
    done = subprocess.run(speculators_argv(*args), env=speculators_env(HF_HUB_OFFLINE="1", **env),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 or not ok, f"speculators {args[0]}: {done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


#: The backend's log (``tests/support/speculators_cpu.py``): a row of the folder, and a generated sample.
HANDED_OVER = re.compile(r"row (\d+): job (\S+) handed over")
GENERATED_HANDED_OVER = re.compile(r"generated: (\S+) handed over")


def test_speculators_generates_and_trains_through_serve(front, tiny_models, client, storage_root, tmp_path):
    model_dir = str(tiny_models["qwen3"])
    _, tokenizer = load(model_dir)
    before = set(client.latest(front.run))
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"id": f"c{i}", "conversations": c}) + "\n"
                             for i, c in enumerate(CONVERSATIONS)))
    data, ckpt = tmp_path / "data", tmp_path / "ckpt"
    base = front.url.removesuffix("/v1")
    speculators("prepare-data", "--model", model_dir, "--data", str(chats), "--render-endpoint", base,
                "--output", str(data), "--seq-length", "256", "--num-preprocessing-workers", "1")
    rows = datasets.load_from_disk(str(data)).with_format(None)
    assert sorted(zip(rows["input_ids"], rows["loss_mask"])) == expected_rows(tokenizer)

    speculators("generate-offline-data", "--endpoint", front.url, "--preprocessed-data", str(data),
                "--max-samples", str(GENERATED), "--concurrency", "2", "--validate-outputs", "--fail-on-error")
    moved = []  # the jobs of the files speculators moved here from the worker's, its lock file taken and removed
    for index in range(GENERATED):
        path = data / "hidden_states" / f"hs_{index}.safetensors"
        states = load_file(path)
        assert states["token_ids"].tolist() == rows[index]["input_ids"]
        assert states["hidden_states"].shape[1] == len(LAYERS)
        moved.append(metadata_of(path)[MetaKey.JOB_ID])

    # speculators' trainer through layertap's backend: its data folder's files and serve's answers checked
    train = ("train", "--verifier-name-or-path", model_dir, "--data-path", str(data), "--speculator-type", "eagle3",
             "--draft-attn-impl", "sdpa", "--loss-implementation", "eager", "--epochs", "1", "--total-seq-len", "256",
             "--num-workers", "0", "--hidden-states-dtype", "float32", "--logger", "", "--on-missing", "generate",
             "--vllm-endpoint", front.url, "--hidden-states-backend", "layertap", "--layertap-delete-after", "true")
    where = {"LAYERTAP_STORAGE_ROOT": str(storage_root), "TRAINER_LOG": str(tmp_path / "backend.log"),
             "COLUMNS": "300"}  # the traceback unwrapped
    wrong = speculators(*train, "--target-layer-ids", "1", "3", "--save-path", str(tmp_path / "wrong"), ok=False,
                        **where)
    assert wrong.returncode != 0
    assert ("LayerIdError: target layer ids differ: --target-layer-ids names [1, 3] but the data's auxiliary "
            "layers are [1, 2]") in wrong.stdout + wrong.stderr, wrong.stderr[-3000:]
    assert not (tmp_path / "wrong" / "0").exists()  # stopped before a step: no checkpoint, and no job sent
    assert set(client.latest(front.run)) == set(before) | set(moved)

    speculators(*train, "--target-layer-ids", "1", "2", "--save-path", str(ckpt), **where)
    results = {job_id: result for job_id, result in client.latest(front.run).items() if job_id not in before}
    assert all(result.ok for result in results.values())
    assert {tuple(result.layers) for result in results.values()} == {tuple(LAYERS)}
    config = json.loads((ckpt / "0" / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == LAYERS[:-1]  # the checkpoint's ids: the files' but L
    # every row once: GENERATED by generate-offline-data (files moved into the data folder), each handed over
    # from there; the rest asked for by the trainer, train and validation split alike, each answer handed over
    # (checked against its row by speculators) and then removed by the backend (--layertap-delete-after)
    log = (tmp_path / "backend.log").read_text()
    handed = sorted((int(row), job) for row, job in HANDED_OVER.findall(log))
    assert handed == list(enumerate(moved))
    asked = {job_id: result for job_id, result in results.items() if job_id not in moved}
    assert sorted(GENERATED_HANDED_OVER.findall(log)) == sorted(result.path for result in asked.values())
    assert len(results) == len(rows)
    assert sorted(result.num_tokens for result in results.values()) == sorted(rows["seq_len"])
    assert not any(Path(result.path).exists() for result in results.values())
    assert sorted(path.name for path in (data / "hidden_states").iterdir()) == sorted(
        f"hs_{index}.safetensors" for index in range(GENERATED))

    # the layer check before training, on the folder generate-offline-data wrote through layertap serve
    agreed = subprocess.run(cli("check-draft", "--config", str(ckpt / "0"), "--data", str(data)),
                            capture_output=True, text=True)
    assert agreed.returncode == 0, agreed.stderr
    assert "target layer ids [1, 2] are the data's auxiliary layers (layers [1, 2, 4], L = 4)" in agreed.stdout


def test_serve_needs_a_served_model(private_redis):
    done = subprocess.run(cli("serve", "--port", str(free_port())), capture_output=True, text=True, timeout=120,
                          env={**os.environ, "LAYERTAP_REDIS_URL": private_redis.url})
    assert done.returncode == 1
    assert "error: no live worker: start one (`layertap worker --model ...`), or name the model" in done.stderr


def test_a_file_outside_its_storage_roots_is_not_answered(workers, redis_server, tmp_path):
    """A front whose storage roots are not the workers' (a result names a file it does not own) answers
    an error, never a path it cannot vouch for."""
    port = free_port()
    server = ServerProcess(cli("serve", "--model", MODEL, "--run", f"serve-{uuid.uuid4().hex[:8]}", "--port",
                               str(port)), port,
                           tmp_path / "serve.log", env={"LAYERTAP_REDIS_URL": redis_server.url,
                                                        "LAYERTAP_STORAGE_ROOT": str(tmp_path / "elsewhere")})
    server.start(timeout=120)
    try:
        answer = post(server, "/completions", {"prompt": [5, 6, 7], "max_tokens": 1})
    finally:
        server.kill()
    assert answer.status_code == 500, answer.text
    assert "which is not the job's own file in run" in answer.json()["error"]["message"]
    assert str(tmp_path / "elsewhere") in answer.json()["error"]["message"]
