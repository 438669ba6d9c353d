"""Bad inputs get clear, typed error results (or CLI errors), and the worker keeps serving."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from layertap.producer.protocol.schema import ErrorType
from tests.support.jobs import send_raw
from tests.support.processes import cli

CASES = [
    ("unknown model", {"model": "no-such-model", "prompt": "hi"}, ErrorType.unknown_model),
    ("empty prompt", {"model": "tiny-qwen3", "prompt": "   "}, ErrorType.empty_input),
    ("prompt and messages", {"model": "tiny-qwen3", "prompt": "hi",
                             "messages": [{"role": "user", "content": "hi"}]}, ErrorType.invalid_job),
    ("bad layer id", {"model": "tiny-qwen3", "prompt": "hi", "layers": [9]}, ErrorType.invalid_layers),
    ("too long, no truncation", {"model": "tiny-qwen3", "prompt": "word " * 200, "max_length": 8},
     ErrorType.too_long),
]


@pytest.mark.parametrize("name,payload,error_type", CASES, ids=[c[0] for c in CASES])
def test_bad_job_gets_typed_error_and_worker_goes_on(name, payload, error_type, workers, client, run_name):
    bad = {**payload, "run": run_name, "job_id": "bad-job"}
    send_raw(client, bad)
    good = client.submit({"prompt": "a good job after a bad one"}, model="tiny-qwen3", run=run_name)
    results = client.wait(run_name, ["bad-job", good.job_id], timeout=60)
    assert results["bad-job"].error_type == error_type
    assert results["bad-job"].error and len(results["bad-job"].error) > 10
    assert results[good.job_id].ok


def test_enqueue_file_with_malformed_line(workers, redis_server, tmp_path, run_name):
    path = tmp_path / "jobs.jsonl"
    path.write_text(json.dumps({"prompt": "fine"}) + "\n{not json\n" + json.dumps({"prompt": ""}) + "\n")
    env = {**os.environ, "LAYERTAP_REDIS_URL": redis_server.url}
    out = subprocess.run(cli("enqueue", "--model", "tiny-qwen3", "--run", run_name, "--file", str(path)),
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "line 2: not valid JSON" in out.stderr
    assert "Traceback" not in out.stderr
    assert len(out.stdout.split()) == 2  # lines 1 and 3 enqueued (line 3 fails at the worker: empty prompt)


def test_enqueue_refuses_model_nobody_serves(workers, redis_server, run_name):
    env = {**os.environ, "LAYERTAP_REDIS_URL": redis_server.url}
    out = subprocess.run(cli("enqueue", "--model", "tiny-typo", "--run", run_name, "--prompt", "hi"),
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert out.stderr.startswith("error: no live worker serves model 'tiny-typo'")


def test_cli_without_redis_is_one_line(tmp_path):
    env = {**os.environ, "LAYERTAP_REDIS_URL": "redis://127.0.0.1:1/0"}
    out = subprocess.run(cli("results", "--run", "x"), env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert out.stderr.startswith("error: cannot reach Redis") and "Traceback" not in out.stderr
