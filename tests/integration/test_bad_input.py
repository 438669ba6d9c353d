"""Bad inputs get clear, typed error results (or CLI errors), and the worker keeps serving."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from layertap.producer.ingest.enqueue import BadRow, Enqueuer, Outcome, Planned
from layertap.protocol.fileformat import MetaKey, metadata_of
from layertap.protocol.schema import ErrorType, Job
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
    assert "line 3: prompt: empty (or only whitespace): nothing to extract" in out.stderr  # refused, not sent
    assert "Traceback" not in out.stderr
    assert len(out.stdout.split()) == 1  # line 1 enqueued


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


def test_enqueue_refuses_a_repeated_id_with_other_content_naming_the_row(workers, redis_server, client, tmp_path,
                                                                          run_name):
    """Issue 45, item 4: a row repeating an earlier row's id with other content is a bad row (exit 2,
    the row named), never a silent skip; the same row again stays a harmless skip. The job run is
    the first row's."""
    path = tmp_path / "rows.jsonl"
    rows = [{"id": "dup", "prompt": "the first content"}, {"id": "dup", "prompt": "the first content"},
            {"id": "dup", "prompt": "other content"}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    env = {**os.environ, "LAYERTAP_REDIS_URL": redis_server.url}
    out = subprocess.run(cli("enqueue", "--model", "tiny-qwen3", "--run", run_name, "--file", str(path)),
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert (f"error: {path} line 3: job_id 'dup' of run '{run_name}' was sent by an earlier row of this enqueue "
            "with other content") in out.stderr
    assert "1 job(s) sent, 0 already ok, 1 repeated row(s) skipped, 1 bad row(s)" in out.stderr
    assert out.stdout.split() == ["dup"]
    result = client.wait(run_name, ["dup"], timeout=60)["dup"]
    assert result.ok, result.error
    first = Job(model="tiny-qwen3", run=run_name, job_id="dup", prompt="the first content")
    assert metadata_of(result.path)[MetaKey.SPEC_HASH] == first.spec_hash()


def test_a_repeated_id_with_other_content_is_refused_batches_later(workers, client, run_name):
    """The repeat is told from what this enqueue sent, however many batches (and bundles) back."""
    first = Job(model="tiny-qwen3", run=run_name, job_id="far", prompt="the first content")
    fillers = [Job(model="tiny-qwen3", run=run_name, prompt=f"filler {i}").with_id() for i in range(3)]
    other = first.model_copy(update={"prompt": "other content"})
    jobs = [first, *fillers, first, fillers[0], other]
    enqueuer = Enqueuer(client, max_inflight=1000, batch_size=1)
    outcomes = list(enqueuer.run(Planned(f"row {i + 1}", job) for i, job in enumerate(jobs)))
    assert [outcome for outcome, _ in outcomes] == [Outcome.submitted] * 4 + [Outcome.repeated] * 2 + [Outcome.bad]
    bad = outcomes[-1][1]
    assert isinstance(bad, BadRow) and bad.where == "row 7" and "job_id 'far'" in bad.reason
    assert client.wait(run_name, ["far"], timeout=60)["far"].ok
