"""Resume and back-pressure: an enqueue killed halfway (SIGKILL) and run again leaves every row
with exactly one ok result; nothing that was ok before is sent again, and only jobs in flight at
the kill may have run twice; jobs in flight never exceed --max-inflight."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections import Counter

from layertap.protocol import keys
from tests.support.processes import cli

ROWS = 60
MAX_INFLIGHT = 3


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_enqueue_killed_halfway_then_resumed(workers, redis_server, client, run_name, tmp_path):
    ids = [f"row-{i:02d}" for i in range(ROWS)]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": job_id, "text": f"prompt {job_id} about layers"}) + "\n"
                            for job_id in ids))
    env = {**os.environ, "LAYERTAP_REDIS_URL": redis_server.url}
    command = cli("enqueue", "--model", "tiny-qwen3", "--run", run_name, "--file", str(path),
                  "--max-inflight", str(MAX_INFLIGHT))
    status_hash, submitted_hash = keys.run_status_hash(run_name), keys.run_submitted_hash(run_name)

    first = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_until(lambda: client.redis.hlen(status_hash) >= ROWS // 3 or first.poll() is not None, 120, "progress")
    assert first.poll() is None, "the first enqueue finished before it could be killed"
    first.send_signal(signal.SIGKILL)
    first.wait()
    submitted, finished = set(client.redis.hkeys(submitted_hash)), client.redis.hgetall(status_hash)
    in_flight_at_kill = submitted - set(finished)
    assert len(in_flight_at_kill) <= MAX_INFLIGHT  # back-pressure held up to the kill
    assert len(submitted) < ROWS
    ok_before = {job_id for job_id, status in finished.items() if status == "ok"}

    second = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr
    sent_again = set(second.stdout.split())
    assert not sent_again & ok_before  # resume skipped what was done
    wait_until(lambda: client.redis.hlen(status_hash) == ROWS, 120, "every row to finish")

    assert client.redis.hgetall(status_hash) == {job_id: "ok" for job_id in ids}
    per_job = Counter(result.job_id for result in client.results(run_name))
    assert set(per_job) == set(ids)
    ran_twice = {job_id for job_id, count in per_job.items() if count > 1}
    assert ran_twice <= in_flight_at_kill
    assert all(result.ok for result in client.latest(run_name).values())

    third = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert third.returncode == 0 and third.stdout == ""
    assert f"0 job(s) sent, {ROWS} already ok" in third.stderr
