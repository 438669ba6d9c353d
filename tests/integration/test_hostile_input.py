"""Malformed and hostile messages: each gets a typed error result, the worker keeps serving,
and nothing is deserialised that is not JSON.

Messages are put on the worker's queue as given (skipping the client's validation), the
way anyone who can write to Redis could.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import re
import subprocess
import time
import uuid

import pytest
from pydantic import ValidationError

from layertap.protocol import keys
from layertap.protocol.schema import ErrorType, Job, JobTooLarge
from tests.support.processes import cli

E = ErrorType
OK_CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
#: 7 characters of content and 9 MB of tools: over the one byte limit (8 MiB), every field counted.
HUGE_TOOLS = {"model": "tiny-qwen3", "messages": OK_CHAT,
              "tools": [{"type": "function", "function": {"name": "f", "description": "x" * 9_000_000}}]}

# (case name, payload, expected error type). Dict payloads get a unique run and job id below
# unless the case is about those fields.
CASES = [
    ("a string, not an object", "prompt: hi", E.invalid_job),
    ("a list, not an object", ["tiny-qwen3", "hi"], E.invalid_job),
    ("a number", 42, E.invalid_job),
    ("null", None, E.invalid_job),
    ("missing model", {"prompt": "hi"}, E.invalid_job),
    ("model is a number", {"model": 7, "prompt": "hi"}, E.invalid_job),
    ("unknown model", {"model": "gpt-17", "prompt": "hi"}, E.unknown_model),
    ("prompt is a list", {"model": "tiny-qwen3", "prompt": [1, 2]}, E.invalid_job),
    ("empty prompt", {"model": "tiny-qwen3", "prompt": ""}, E.empty_input),
    ("whitespace prompt", {"model": "tiny-qwen3", "prompt": " \n\t "}, E.empty_input),
    ("prompt and token_ids", {"model": "tiny-qwen3", "prompt": "hi", "token_ids": [1]}, E.invalid_job),
    ("no input at all", {"model": "tiny-qwen3"}, E.invalid_job),
    ("extra field naming a path", {"model": "tiny-qwen3", "prompt": "hi", "path": "/etc/passwd"}, E.invalid_job),
    ("job id climbs out", {"model": "tiny-qwen3", "prompt": "hi", "job_id": "../../etc/x"}, E.invalid_job),
    ("job id with a slash", {"model": "tiny-qwen3", "prompt": "hi", "job_id": "a/b"}, E.invalid_job),
    ("job id with NUL", {"model": "tiny-qwen3", "prompt": "hi", "job_id": "a\x00b"}, E.invalid_job),
    ("job id of 300 chars", {"model": "tiny-qwen3", "prompt": "hi", "job_id": "j" * 300}, E.invalid_job),
    ("run escapes the root", {"model": "tiny-qwen3", "prompt": "hi", "run": "../../tmp"}, E.invalid_job),
    ("run is absolute", {"model": "tiny-qwen3", "prompt": "hi", "run": "/tmp/x"}, E.invalid_job),
    ("run is ..", {"model": "tiny-qwen3", "prompt": "hi", "run": ".."}, E.invalid_job),
    ("layer past the top", {"model": "tiny-qwen3", "prompt": "hi", "layers": [99]}, E.invalid_layers),
    ("layer below the bottom", {"model": "tiny-qwen3", "prompt": "hi", "layers": [-99]}, E.invalid_layers),
    ("layers empty", {"model": "tiny-qwen3", "prompt": "hi", "layers": []}, E.invalid_layers),
    ("layer repeated", {"model": "tiny-qwen3", "prompt": "hi", "layers": [1, 1]}, E.invalid_layers),
    ("layer not a number", {"model": "tiny-qwen3", "prompt": "hi", "layers": ["a"]}, E.invalid_job),
    ("token_ids empty", {"model": "tiny-qwen3", "token_ids": []}, E.empty_input),
    ("negative token id", {"model": "tiny-qwen3", "token_ids": [5, -1]}, E.bad_token_ids),
    ("token id past the vocabulary", {"model": "tiny-qwen3", "token_ids": [5, 10**9]}, E.bad_token_ids),
    ("token id not a number", {"model": "tiny-qwen3", "token_ids": ["a"]}, E.invalid_job),
    ("too many tokens", {"model": "tiny-qwen3", "token_ids": [5] * 140_000}, E.too_long),
    ("too long, no truncation", {"model": "tiny-qwen3", "prompt": "word " * 100, "max_length": 5}, E.too_long),
    ("max_length zero", {"model": "tiny-qwen3", "prompt": "hi", "max_length": 0}, E.invalid_job),
    ("max_length negative", {"model": "tiny-qwen3", "prompt": "hi", "max_length": -5}, E.invalid_job),
    ("empty chat", {"model": "tiny-qwen3", "messages": []}, E.empty_input),
    ("chat with no assistant turn", {"model": "tiny-qwen3", "messages": [{"role": "user", "content": "hi"}]},
     E.no_trainable_tokens),
    ("unknown role", {"model": "tiny-qwen3", "messages": [{"role": "root", "content": "x"}, *OK_CHAT]},
     E.invalid_job),
    ("message is a string", {"model": "tiny-qwen3", "messages": ["hi"]}, E.invalid_job),
    ("NUL in a message", {"model": "tiny-qwen3", "messages": [{"role": "user", "content": "a\x00"}, OK_CHAT[1]]},
     E.invalid_job),
    ("escape sequence in a prompt", {"model": "tiny-qwen3", "prompt": "\x1b[31mred"}, E.invalid_job),
    ("lone surrogate", {"model": "tiny-qwen3", "prompt": "bad \ud800 text"}, E.invalid_job),
    ("too many turns", {"model": "tiny-qwen3", "messages": OK_CHAT * 2100}, E.invalid_job),
    ("metadata not a string", {"model": "tiny-qwen3", "prompt": "hi", "metadata": {"a": 1}}, E.invalid_job),
    ("huge tools, tiny content", HUGE_TOOLS, E.invalid_job),
]


def send_raw(client, payload, *extra_args):
    client.celery.send_task(keys.EXTRACT_TASK, args=[payload, *extra_args], queue=keys.model_queue("tiny-qwen3"))


def next_result(client, stream_run: str, since: str, job_id: str | None, timeout: float = 60):
    """The first result on ``stream_run``'s stream after ``since`` (for ``job_id`` if given)."""
    deadline = time.monotonic() + timeout
    for result in client.results(stream_run, follow=True, since=since, block_ms=200, timeout=timeout):
        if job_id is None or result.job_id == job_id:
            return result
        if time.monotonic() > deadline:
            break
    raise AssertionError(f"no result on {stream_run} after {timeout}s")


def last_entry_id(client, run: str) -> str:
    entries = client.redis.xrevrange(keys.results_stream(run), count=1)
    return entries[0][0] if entries else "0"


def test_at_least_thirty_cases():
    assert len(CASES) >= 30


@pytest.mark.parametrize("name,payload,expected", CASES, ids=[c[0] for c in CASES])
def test_hostile_message_gets_typed_error_and_worker_serves_next(name, payload, expected, workers, client,
                                                                  run_name):
    sets_identity = isinstance(payload, dict) and ("run" in payload or "job_id" in payload)
    if isinstance(payload, dict) and not sets_identity:
        payload = {"run": run_name, "job_id": f"case-{uuid.uuid4().hex[:8]}", **payload}
    stream_run = run_name if isinstance(payload, dict) and not sets_identity else "default"
    since = last_entry_id(client, stream_run)
    job_id = payload.get("job_id") if isinstance(payload, dict) and stream_run == run_name else None
    send_raw(client, payload)
    result = next_result(client, stream_run, since, job_id)
    assert result.status.value == "error"
    assert result.error_type == expected, result.error
    assert result.error and "Traceback" not in result.error
    good = client.submit({"prompt": "still serving?"}, model="tiny-qwen3", run=run_name)
    assert client.wait(run_name, [good.job_id], timeout=60)[good.job_id].ok


def test_huge_tools_are_refused_by_the_client_before_validation(client, run_name):
    with pytest.raises(JobTooLarge, match="tools included"):
        client.submit(HUGE_TOOLS, run=run_name)
    assert client.redis.hlen(keys.run_submitted_hash(run_name)) == 0


#: Characters no name may hold (issue 45, item 4): controls, DEL, C1, line and paragraph separators, a format character.
UNPRINTABLE = ["\t", "\n", "\r", "\x7f", "\u0085", "\u2028", "\u2029", "\u200b"]


@pytest.mark.parametrize("char", UNPRINTABLE, ids=[f"U+{ord(c):04X}" for c in UNPRINTABLE])
def test_a_name_holding_a_control_or_separator_character_is_refused_everywhere(char, workers, client, run_name):
    """A model, run or job id holding ``char`` is refused by the schema, the Client (no queue key is
    made) and the worker (``invalid_job``, not a lookup of the model), each naming the character."""
    named = f"U+{ord(char):04X}"
    for field, value in [("model", f"tiny{char}qwen3"), ("run", f"r{char}un"), ("job_id", f"j{char}ob")]:
        with pytest.raises(ValidationError, match=re.escape(named)):
            Job(**{"model": "tiny-qwen3", "prompt": "hi", field: value})
    with pytest.raises(ValidationError, match=re.escape(named)):
        client.submit({"prompt": "hi"}, model=f"tiny-qwen3{char}", run=run_name)
    assert not client.redis.exists(keys.model_queue(f"tiny-qwen3{char}"))
    since = last_entry_id(client, run_name)
    send_raw(client, {"model": f"tiny-qwen3{char}", "prompt": "hi", "run": run_name, "job_id": "named"})
    result = next_result(client, run_name, since, "named")
    assert result.error_type == E.invalid_job and named in (result.error or "")


@pytest.mark.parametrize("flag", ["--name", "--node-name"])
def test_a_worker_name_holding_a_control_character_is_refused_at_start(flag, tiny_models):
    """Refused before the model loads or Redis is reached (the address given leads nowhere)."""
    env = {**os.environ, "LAYERTAP_REDIS_URL": "redis://127.0.0.1:1/0"}
    started = subprocess.run(cli("worker", "--model", str(tiny_models["qwen3"]), flag, "tiny\tqwen3@x",
                                 "--device", "cpu"), env=env, capture_output=True, text=True, timeout=60)
    assert started.returncode == 1 and "U+0009" in started.stderr and "Traceback" not in started.stderr


def test_two_positional_arguments_are_refused(workers, client, run_name):
    since = last_entry_id(client, "default")
    send_raw(client, {"model": "tiny-qwen3", "prompt": "hi"}, {"model": "tiny-qwen3", "prompt": "again"})
    assert next_result(client, "default", since, None).error_type == E.invalid_job


class _Exploit:
    """Unpickling this writes a file: proof that a message was deserialised with pickle."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def raw_message(body: bytes, content_type: str, queue: str) -> str:
    """A message in kombu's Redis format, as a hostile writer would LPUSH it."""
    return json.dumps({
        "body": base64.b64encode(body).decode(),
        "content-encoding": "binary" if "pickle" in content_type else "utf-8",
        "content-type": content_type,
        "headers": {"lang": "py", "task": keys.EXTRACT_TASK, "id": str(uuid.uuid4()), "retries": 0,
                    "argsrepr": "", "kwargsrepr": "", "origin": "hostile"},
        "properties": {"correlation_id": str(uuid.uuid4()), "reply_to": "", "delivery_mode": 2,
                       "delivery_info": {"exchange": "", "routing_key": queue}, "priority": 0,
                       "body_encoding": "base64", "delivery_tag": str(uuid.uuid4())},
    })


def test_pickled_and_non_json_messages_are_refused_unread(workers, client, run_name, tmp_path):
    queue = keys.model_queue("tiny-qwen3")
    marker = tmp_path / "unpickled"
    pickled = pickle.dumps([[{"model": "tiny-qwen3", "prompt": _Exploit(str(marker))}], {}, {}])
    client.redis.lpush(queue, raw_message(pickled, "application/x-python-serialize", queue))
    client.redis.lpush(queue, raw_message(b"{this is not json", "application/json", queue))
    good = client.submit({"prompt": "after the hostile messages"}, model="tiny-qwen3", run=run_name)
    assert client.wait(run_name, [good.job_id], timeout=60)[good.job_id].ok
    assert not marker.exists()
    assert client.redis.llen(queue) == 0  # consumed and dropped, not stuck at the head of the queue
