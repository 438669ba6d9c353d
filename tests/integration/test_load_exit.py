"""A supervised worker that dies while loading its model is explained, in the supervisor's log
and in ``layertap status``: its last phase, and whether the kernel's out-of-memory killer sent
the SIGKILL (the cgroup's ``oom_kill`` count). A real SIGKILL is sent while the worker loads
a model whose construction waits at a gate (its own modeling code, ``trust_remote_code``)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
from pathlib import Path

import psutil

from layertap.worker.ops.phase import PHASE_FILE_ENV
from layertap.worker.ops.supervisor import exit_reason
from tests.support.jobs import wait_for
from tests.support.processes import cli

SLOW_LOADING_CODE = '''
"""A Qwen3 model whose construction waits while the file named by LAYERTAP_TEST_LOAD_GATE exists."""
import os
import time

from transformers import Qwen3ForCausalLM


class SlowLoadingQwen3ForCausalLM(Qwen3ForCausalLM):
    def __init__(self, config):
        gate = os.environ.get("LAYERTAP_TEST_LOAD_GATE")
        while gate and os.path.exists(gate):
            time.sleep(0.05)
        super().__init__(config)
'''


def slow_loading_model(tiny_model: Path, folder: Path) -> Path:
    shutil.copytree(tiny_model, folder)
    (folder / "modeling_slow.py").write_text(SLOW_LOADING_CODE)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_slow.SlowLoadingQwen3ForCausalLM"}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def loading_child(supervisor: subprocess.Popen) -> psutil.Process | None:
    """The supervisor's worker child once its phase file says ``loading``."""
    for child in psutil.Process(supervisor.pid).children():
        phase_file = child.environ().get(PHASE_FILE_ENV)
        if phase_file and os.path.exists(phase_file) and Path(phase_file).read_text() == "loading":
            return child
    return None


def test_a_worker_killed_while_loading_is_explained(tiny_models, redis_server, storage_root, tmp_path):
    model = slow_loading_model(tiny_models["qwen3"], tmp_path / "model")
    gate = tmp_path / "gate"
    gate.touch()
    env = {**os.environ, "LAYERTAP_REDIS_URL": redis_server.url, "LAYERTAP_STORAGE_ROOT": str(storage_root),
           "LAYERTAP_WORKER__TRUST_REMOTE_CODE": "true", "LAYERTAP_TEST_LOAD_GATE": str(gate)}
    log_path = tmp_path / "supervisor.log"
    with open(log_path, "wb") as log:
        supervisor = subprocess.Popen(cli("worker", "--model", str(model), "--name", "slow-loading", "--device", "cpu",
                                          "--gpus", "7"), env=env, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True)
    node = f"gpu7@{socket.gethostname()}"
    try:
        found: list[psutil.Process] = []
        wait_for(lambda: found.append(loading_child(supervisor)) or found[-1], 180,
                 "the worker to be loading its model")
        found[-1].send_signal(signal.SIGKILL)
        reason = "killed by SIGKILL while loading"
        wait_for(lambda: reason in log_path.read_text(), 60, "the supervisor to explain the death")

        status = subprocess.run(cli("status", "--json", "--redis-url", redis_server.url), capture_output=True,
                                text=True, timeout=120, check=True)
        worker = next(w for w in json.loads(status.stdout)["workers"] if w["node"] == node)
        assert worker["last_exit"].startswith(reason) and not worker["alive"]
        text = subprocess.run(cli("status", "--redis-url", redis_server.url), capture_output=True, text=True,
                              timeout=120, check=True)
        assert f"{node} last ended" in text.stdout and reason in " ".join(text.stdout.split())
    finally:
        os.killpg(supervisor.pid, signal.SIGKILL)
        supervisor.wait()


def test_an_out_of_memory_kill_is_named_as_such():
    """The words for each way a child ends (``oom_kills``: how much the cgroup's OOM-kill count rose)."""
    assert exit_reason(-signal.SIGKILL, "loading", 1) == "killed by the kernel: out of memory while loading"
    assert exit_reason(-signal.SIGKILL, "serving", 0).startswith("killed by SIGKILL while serving (not by the kernel")
    assert "no cgroup memory.events" in exit_reason(-signal.SIGKILL, "loading", None)
    assert exit_reason(-signal.SIGSEGV, "serving", 0) == "killed by SIGSEGV while serving"
    assert exit_reason(3, "serving", 0) == "exited with code 3 while serving"
