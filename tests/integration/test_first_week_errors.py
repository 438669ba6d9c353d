"""Issue 40 ("The first week"), items 5 and 7: errors name what was given and come when they
should, and the small things a user reads, against real Redis, real workers and tiny real models.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from layertap.protocol import keys
from layertap.protocol.naming import job_path
from tests.support.processes import cli

MODEL = "tiny-qwen3"
UNREACHABLE = "redis://127.0.0.1:1/0"  # nothing listens on port 1


def layertap(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    environ = {key: value for key, value in os.environ.items() if not key.startswith("LAYERTAP_")}
    return subprocess.run(cli(*args), env={**environ, **(env or {})}, capture_output=True, text=True,
                          timeout=timeout)


def test_the_redis_error_names_the_url_given():
    done = layertap("results", "--run", "x", "--redis-url", UNREACHABLE)
    assert done.returncode == 1 and f"is it running at {UNREACHABLE}?" in done.stderr, done.stderr
    assert "localhost:6379" not in done.stderr


def test_a_worker_that_cannot_reach_redis_stops_before_loading_its_model(tiny_models):
    """Redis is asked first: after LAYERTAP_REDIS_WAIT_S (1 s here) the worker exits 1, naming the URL
    and the wait; it never loads the model."""
    done = layertap("worker", "--model", str(tiny_models["qwen3"]), "--device", "cpu", "--redis-url", UNREACHABLE,
                    env={"LAYERTAP_REDIS_WAIT_S": "1"}, timeout=90)
    assert done.returncode == 1, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: cannot reach Redis") and UNREACHABLE in last, last
    assert "gave up after 1s: LAYERTAP_REDIS_WAIT_S" in last
    assert "Redis is unreachable" in done.stderr  # each wait said so
    assert "weights fingerprint" not in done.stderr  # the model was not loaded


def test_an_empty_prompt_is_refused_before_it_is_sent(redis_server, client, run_name):
    """As a control character is: one error line, exit 1, nothing sent."""
    env = {"LAYERTAP_REDIS_URL": redis_server.url}
    for prompt in ("", "  \n"):
        done = layertap("enqueue", "--model", MODEL, "--run", run_name, "--no-check", "--prompt", prompt, env=env)
        assert done.returncode == 1 and done.stderr.strip() == (
            "error: prompt: empty (or only whitespace): nothing to extract"), done.stderr
    assert client.redis.hlen(keys.run_submitted_hash(run_name)) == 0


def test_watch_of_a_run_that_does_not_exist_exits_1_as_results_does(redis_server):
    env = {"LAYERTAP_REDIS_URL": redis_server.url}
    for command in ("watch", "results"):
        done = layertap(command, "--run", "nosuch", env=env, timeout=60)
        assert done.returncode == 1 and done.stderr.startswith("error: no run named 'nosuch'"), done.stderr


def test_the_extractor_names_its_folder_and_files_as_asked(tiny_models, tmp_path):
    from layertap.worker.extractor import Extractor

    out = tmp_path / "out"
    with Extractor(str(tiny_models["qwen3"]), name="tiny-qwen3", device="cpu", layers=[0, 2]) as extractor:
        results = extractor.extract(["a first prompt", "a second prompt"], out, run="notes",
                                    job_ids=["first", "second"])
    assert [Path(result.path) for result in results] == [job_path(out, "notes", "first").resolve(),
                                                        job_path(out, "notes", "second").resolve()]
    assert all(result.ok and Path(result.path).is_file() for result in results)
