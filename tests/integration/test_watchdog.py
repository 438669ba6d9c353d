"""A worker whose engine hangs notices it and exits, so its jobs finish on a healthy worker.

The hang is real (``tests.blocking_model``): the model folder carries its own modeling code,
whose decoder blocks in its forward while a gate file exists, as a CUDA kernel that never
returns would. Nothing in the worker is patched.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

from layertap.protocol import keys
from layertap.worker.main import EXIT_STALLED
from tests.support.blocking import hang_env
from tests.support.jobs import ORPHAN_TIMEOUT, attempts, make_job, wait_for

HANG_TIMEOUT = 4.0
def test_hung_engine_exits_and_its_jobs_finish_on_a_healthy_worker(make_worker, private_client, blocking_model,
                                                                   tmp_path):
    gate = tmp_path / "hang-gate"
    env = hang_env(gate, HANG_TIMEOUT)
    hung = make_worker("hangs@localhost", model_dir=blocking_model, env=env)
    jobs = [make_job("hang", f"a job for the hung engine {i}") for i in range(4)]
    gate.touch()  # from now on the engine's forward blocks
    for job in jobs:
        private_client.submit(job)
    wait_for(lambda: all(attempts(private_client, job) == 1 for job in jobs), 30, "the hung worker to take the jobs")
    healthy = make_worker("healthy@localhost")  # gets the jobs once the hung worker's leases lapse
    taken = time.monotonic()
    assert hung.process.wait(timeout=HANG_TIMEOUT + 15) == EXIT_STALLED
    assert "worker stalled" in hung.log_text() and "no batch finished" in hung.log_text()
    assert hung.node not in private_client.workers()  # it deregistered: no heartbeat renewed for a hung worker
    results = private_client.wait("hang", [job.job_id for job in jobs], timeout=HANG_TIMEOUT + 4 * ORPHAN_TIMEOUT + 15)
    back = time.monotonic() - taken
    # Back through the watchdog and the lease lapse, not Celery's hour-long visibility timeout: the
    # wait's deadline above is minutes at most. The time is a figure, not a bound a busy machine could break.
    assert all(r.ok and r.worker == healthy.node and r.attempt == 2 for r in results.values())
    print(f"hung engine: {len(jobs)} jobs back on a healthy worker {back:.1f}s after they were taken "
          f"(hang bound {HANG_TIMEOUT:.0f}s, orphan_timeout {ORPHAN_TIMEOUT:.0f}s)")


def test_warm_shutdown_of_a_hung_engine_has_a_deadline(make_worker, private_client, blocking_model, tmp_path):
    gate = tmp_path / "hang-gate"
    env = {**hang_env(gate, 600), "LAYERTAP_WORKER__SHUTDOWN_TIMEOUT": "3"}
    hung = make_worker("stuck@localhost", model_dir=blocking_model, env=env)
    job = make_job("stuck", "a job that never finishes here")
    gate.touch()
    private_client.submit(job)
    wait_for(lambda: attempts(private_client, job) == 1, 30, "the job to start")
    hung.process.send_signal(signal.SIGTERM)
    assert hung.process.wait(timeout=20) == EXIT_STALLED  # not waiting on the engine forever
    assert "warm shutdown did not end" in hung.log_text()
    gate.unlink()
    make_worker("after@localhost")
    assert private_client.wait("stuck", [job.job_id], timeout=30)[job.job_id].ok
    assert private_client.redis.hlen(keys.PENDING_HASH) == 0


SUPERVISED_STUBBORN_CHILD = '''
import os, signal, sys, threading, time
from layertap.worker.ops.supervisor import Supervisor

supervisor = Supervisor(["--model", "unused"], ["0"], kill_after_s=1.0)
child = supervisor.children[0]
child.argv = [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
              "print('ready', flush=True); time.sleep(120)"]
threading.Timer(1.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
started = time.monotonic()
code = supervisor.run(poll_s=0.1)
print("supervisor", code, "child", child.process.returncode, "after", round(time.monotonic() - started, 1))
'''


def test_supervisor_escalates_sigterm_to_sigkill(tmp_path):
    """A child that does not stop after SIGTERM (a real process ignoring it) is SIGKILLed after the grace."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", SUPERVISED_STUBBORN_CHILD], capture_output=True, text=True,
                          timeout=60, cwd=Path(__file__).resolve().parents[2])
    line = [text for text in done.stdout.splitlines() if text.startswith("supervisor")][-1].split()
    assert line[3] == str(-signal.SIGKILL) and line[1] == "1", done.stdout + done.stderr
    assert float(line[5]) < 10
