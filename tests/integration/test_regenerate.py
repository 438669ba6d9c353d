"""``layertap regenerate`` against real OpenAI-compatible servers on a tiny real model.

``transformers serve`` (greedy) checks the turns, resume after a killed server and after Ctrl-C;
references are plain ``transformers`` ``generate`` on each chat, turn by turn. The small server
of ``tests.support.chat_server`` (``transformers`` too) adds vLLM's ``return_token_ids`` and tool
calls, which ``transformers serve`` does not return for a tiny random model.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from layertap.protocol.fileformat import MetaKey, read_file_header
from tests.support.chat_server import small_server, transformers_serve
from tests.support.jobs import wait_for
from tests.support.processes import cli

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def reference(tiny_models):
    """The model's greedy reply to a chat, from plain transformers, without leading whitespace:
    ``transformers serve`` runs a Qwen3 model's reply through its response parser, which trims it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_models["qwen3"])
    model = AutoModelForCausalLM.from_pretrained(tiny_models["qwen3"], dtype=torch.float32).eval()

    def reply(messages: list[dict]) -> str:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).lstrip()

    return reply


@pytest.fixture(scope="module")
def serve(tiny_models, tmp_path_factory):
    server = transformers_serve(tiny_models["qwen3"], tmp_path_factory.mktemp("serve") / "serve.log").start()
    yield server
    server.kill()


@pytest.fixture(scope="module")
def small(tiny_models, tmp_path_factory):
    server = small_server(tiny_models["qwen3"], tmp_path_factory.mktemp("small") / "answers.jsonl").start()
    yield server
    server.kill()


def regenerate_argv(server, model: Path, chats: Path, out: Path, *extra: str) -> list[str]:
    return cli("regenerate", "--endpoint", server.url, "--model", str(model), "--file", str(chats),
               "--out", str(out), "--max-tokens", str(MAX_TOKENS), *extra)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def prompts(count: int) -> list[dict]:
    return [{"id": f"p{i}", "messages": [{"role": "user", "content": f"question number {i}"}]} for i in range(count)]


def check_against_reference(rows: list[dict], sources: list[dict], reference) -> None:
    """Every assistant turn is the model's reply to the output's own earlier turns; others are the source's."""
    by_id = {row["id"]: row for row in rows}
    for source in sources:
        row = by_id[source["id"]]
        users = [m for m in source["messages"] if m["role"] != "assistant"]
        assert [m for m in row["messages"] if m["role"] != "assistant"] == users
        for index, message in enumerate(row["messages"]):
            if message["role"] == "assistant":
                assert message["content"] == reference(row["messages"][:index])


def test_turns_are_the_servers_regenerated_turn_by_turn(serve, tiny_models, reference, tmp_path):
    sources = [{"id": "two-turns", "messages": [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": "a recorded answer"}, {"role": "user", "content": "and then?"},
        {"role": "assistant", "content": "another recorded answer"}]},
        {"id": "open", "messages": [{"role": "user", "content": "a prompt alone"}]}]
    out = tmp_path / "regen.jsonl"
    done = subprocess.run(regenerate_argv(serve, tiny_models["qwen3"], write_jsonl(tmp_path / "c.jsonl", sources), out),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = read_jsonl(out)
    assert sorted(row["id"] for row in rows) == ["open", "two-turns"]
    check_against_reference(rows, sources, reference)
    two = next(row for row in rows if row["id"] == "two-turns")
    assert [m["role"] for m in two["messages"]] == ["system", "user", "assistant", "user", "assistant"]
    assert "recorded" not in json.dumps([m["content"] for m in two["messages"]])
    regeneration = two["provenance"]["regeneration"]
    assert regeneration["source_id"] == "two-turns" and regeneration["sampling"] == {"max_tokens": MAX_TOKENS}
    assert "token_ids" not in two  # transformers serve returns none: enqueue renders the chat
    assert "warning: 2 row(s) of" in done.stderr and "carry no token ids" in done.stderr  # said, not silent


def run_until_rows(argv: list[str], out: Path, rows: int) -> subprocess.Popen:
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: out.exists() and len(read_jsonl(out)) >= rows, 300, f"{rows} row(s)")
    return process


def test_a_killed_server_and_a_ctrl_c_lose_nothing_and_repeat_nothing(serve, tiny_models, reference, tmp_path):
    sources = prompts(24)  # rows enough that a Ctrl-C sent after the second comes before the last on a busy machine
    chats, out = write_jsonl(tmp_path / "c.jsonl", sources), tmp_path / "regen.jsonl"
    argv = regenerate_argv(serve, tiny_models["qwen3"], chats, out, "--concurrency", "1", "--retries", "400",
                           "--backoff-max", "0.5")
    first = run_until_rows(argv, out, 2)
    first.send_signal(signal.SIGINT)
    first.communicate(timeout=120)
    interrupted = len(read_jsonl(out))
    assert interrupted < len(sources), "the Ctrl-C came after the last row"

    second = run_until_rows(argv, out, interrupted + 2)
    serve.kill()
    time.sleep(1)
    serve.start()
    _, err = second.communicate(timeout=300)
    assert second.returncode == 0, err
    assert int(re.search(r"; (\d+) request\(s\) retried", err).group(1)) > 0  # the server was down mid-run
    rows = read_jsonl(out)
    assert sorted(row["id"] for row in rows) == sorted(s["id"] for s in sources)  # each once
    check_against_reference(rows, sources, reference)
    assert (tmp_path / "regen.errors.jsonl").read_text() == ""


def test_tool_calls_take_the_recorded_results_and_a_divergence_is_cut(small, tiny_models, tmp_path):
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    source = {"id": "tools", "tools": tools, "messages": [
        {"role": "user", "content": "look it up"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "old-1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "old-1", "content": "RESULT ONE"},
        {"role": "assistant", "content": "it says one"},
        {"role": "user", "content": "thanks"}, {"role": "assistant", "content": "bye"}]}
    out = tmp_path / "regen.jsonl"
    done = subprocess.run(regenerate_argv(small, tiny_models["qwen3"], write_jsonl(tmp_path / "c.jsonl", [source]),
                                          out, "--extra-body", '{"tool_choice": "required"}'),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    [row] = read_jsonl(out)
    first, result, second = row["messages"][1:]
    assert first["tool_calls"][0]["function"]["name"] == "lookup"
    assert first["tool_calls"][0]["id"] != "old-1"
    assert result == {"role": "tool", "tool_call_id": first["tool_calls"][0]["id"], "content": "RESULT ONE"}
    assert second["tool_calls"]  # the model called a tool where the source answered: cut here
    assert row["provenance"]["regeneration"]["cut"] == ("cut after assistant turn 3: the source made 0 tool "
                                                        "call(s), the model 1")
    sent = [a["answer"]["choices"][0]["message"] for a in small.answers()
            if a["request"]["messages"][0]["content"] == "look it up"]
    assert sent[-2:] == [first, second]


def test_enqueue_writes_one_file_per_conversation_with_the_servers_token_ids(small, tiny_models, workers, redis_server,
                                                                            run_name, tmp_path):
    sources = [{"id": "multi", "messages": [{"role": "user", "content": "first"}, {"role": "assistant", "content": "x"},
                                            {"role": "user", "content": "second"}]},
               {"id": "single", "messages": [{"role": "user", "content": "only one"}]}]
    out, run = tmp_path / "regen.jsonl", run_name
    done = subprocess.run(regenerate_argv(small, tiny_models["qwen3"], write_jsonl(tmp_path / "c.jsonl", sources), out,
                                          "--n", "2", "--temperature", "1.0", "--seed", "7", "--enqueue", run,
                                          "--worker-model", "tiny-qwen3", "--redis-url", redis_server.url),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = {row["id"]: row for row in read_jsonl(out)}
    assert sorted(rows) == ["multi", "multi-s1", "single", "single-s1"]

    from layertap.producer.client.client import Client
    from layertap.settings import Settings

    with Client(Settings(redis_url=redis_server.url)) as client:
        wait_for(lambda: len({r.job_id for r in client.results(run) if r.ok}) == len(rows), 300, "the files")
        results = [r for r in client.results(run) if r.ok]
    files = {r.job_id: Path(r.path) for r in results}
    assert sorted(files) == sorted(rows) and len(set(files.values())) == len(rows)
    answers = small.answers()
    for row_id, path in files.items():
        row = rows[row_id]
        last = next(a for a in reversed(answers) if a["request"]["messages"] == row["messages"][:-1]
                    and a["request"]["seed"] == row["provenance"]["regeneration"]["seed"])["answer"]
        expected = last["prompt_token_ids"] + last["choices"][0]["token_ids"]
        header = read_file_header(path)
        assert header.array("token_ids").tolist() == expected
        mask = header.array("loss_mask").tolist()
        assert mask[len(last["prompt_token_ids"]):] == [1] * len(last["choices"][0]["token_ids"])
        provenance = json.loads(header.metadata[MetaKey.PROVENANCE])["regeneration"]
        assert provenance["source_id"] == row_id.removesuffix("-s1")
        assert provenance["sampling"] == {"max_tokens": MAX_TOKENS, "temperature": 1.0}
    assert rows["multi"]["messages"][1] != rows["multi-s1"]["messages"][1]  # two samples, two seeds

    listed = subprocess.run(cli("enqueue", "--model", "tiny-qwen3", "--file", str(out), "--dry-run"),
                            capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0 and sorted(listed.stdout.split()) == sorted(rows)


def test_a_conversation_the_server_refuses_writes_one_error_row_and_no_output(serve, tiny_models, tmp_path):
    out = tmp_path / "regen.jsonl"
    chats = write_jsonl(tmp_path / "c.jsonl", prompts(2))
    argv = regenerate_argv(serve, tiny_models["qwen3"], chats, out, "--extra-body", '{"no_such_field": 1}')
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)  # refused: an unknown field (422)
    assert done.returncode == 2, done.stderr
    assert out.read_text() == ""
    errors = read_jsonl(tmp_path / "regen.errors.jsonl")
    assert sorted(e["id"] for e in errors) == ["p0", "p1"] and all("HTTP 4" in e["reason"] for e in errors)


def test_a_reply_with_a_control_character_is_kept_and_a_row_enqueue_refuses_is_named(small, tiny_models,
                                                                                     redis_server, run_name, tmp_path):
    """Issue 40, item 4. The model says ESC (logit_bias); its replies are kept as given. Without the
    sampled token ids enqueue would tokenize the text, which may hold no control character: each
    row is refused by the run, named with its reason (stderr and the errors file), and the last line
    says where the rows are. With the token ids the job is those ids: both rows go into the run."""
    from transformers import AutoTokenizer

    from layertap.producer.client.client import Client
    from layertap.protocol import keys
    from layertap.settings import Settings

    (escape,) = AutoTokenizer.from_pretrained(tiny_models["qwen3"]).encode("\x1b", add_special_tokens=False)
    chats = write_jsonl(tmp_path / "c.jsonl", prompts(2))
    bias = ["--extra-body", json.dumps({"logit_bias": {str(escape): 100}}), "--enqueue", run_name,
            "--worker-model", "tiny-qwen3", "--redis-url", redis_server.url]
    text_out, ids_out = tmp_path / "text.jsonl", tmp_path / "ids.jsonl"
    text = subprocess.run(regenerate_argv(small, tiny_models["qwen3"], chats, text_out, "--no-token-ids", *bias),
                          capture_output=True, text=True, timeout=300)
    assert text.returncode == 2, text.stderr
    assert [row["messages"][-1]["content"] for row in read_jsonl(text_out)] == ["\x1b" * MAX_TOKENS] * 2  # kept
    errors = read_jsonl(tmp_path / "text.errors.jsonl")
    assert sorted(e["id"] for e in errors) == ["p0", "p1"]
    assert all(e["reason"] == f"not enqueued into run {run_name}: messages turn 1: message text contains the "
               "control character '\\x1b'" for e in errors), errors
    assert "error: row p0: messages turn 1: message text contains the control character" in text.stderr
    last = text.stderr.strip().splitlines()[-1]
    assert last == (f"error: 2 row(s) written to {text_out} were not enqueued into run {run_name}: they stay in "
                    f"{text_out}, listed above and in {tmp_path / 'text.errors.jsonl'} with the reason")
    assert "--format" not in text.stderr and "0 conversation(s) failed" not in text.stderr
    with Client(Settings(redis_url=redis_server.url)) as client:
        assert client.redis.hlen(keys.run_submitted_hash(run_name)) == 0

    ids = subprocess.run(regenerate_argv(small, tiny_models["qwen3"], chats, ids_out, *bias),
                         capture_output=True, text=True, timeout=300)
    assert ids.returncode == 0, ids.stderr
    assert all("token_ids" in row for row in read_jsonl(ids_out))
    with Client(Settings(redis_url=redis_server.url)) as client:
        assert client.redis.hlen(keys.run_submitted_hash(run_name)) == 2
