"""``layertap worker --gpus``: one worker process per device, restarted when it dies, all
stopped by SIGTERM, none outliving a killed supervisor. On the CPU: the device list is
the ``--gpus`` flag or the ``LAYERTAP_WORKER__GPUS`` setting, and CUDA is never touched.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator

import psutil
import pytest

from layertap.producer.dev.redis_server import free_port
from layertap.protocol import keys
from tests.support.processes import cli

MODEL = "tiny-supervised"
HOST = socket.gethostname()


def wait_for(condition: Callable[[], object], timeout: float, what: str) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise TimeoutError(f"timed out waiting for {what}")


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def two_free_ports() -> int:
    """A port P such that P and P + 1 are both free (a moment ago)."""
    for _ in range(50):
        port = free_port()
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two consecutive free ports")


@pytest.fixture
def supervisor_factory(tiny_models, redis_server, storage_root, tmp_path) -> Iterator[Callable[..., subprocess.Popen]]:
    started: list[subprocess.Popen] = []

    def start(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        log = open(tmp_path / f"supervisor-{len(started)}.log", "wb")
        process = subprocess.Popen(
            cli("worker", "--model", str(tiny_models["qwen3"]), "--name", MODEL, "--device", "cpu", *args),
            env={**os.environ, "LAYERTAP_REDIS_URL": redis_server.url, "LAYERTAP_STORAGE_ROOT": str(storage_root),
                 **(env or {})},
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        started.append(process)
        return process

    yield start
    for process in started:  # whatever a failed test left: the whole process group
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()


def serving(client, node: str, supervisor: subprocess.Popen) -> dict | None:
    """The worker ``node``'s description once it is a child of ``supervisor`` and answers a
    Celery ping (its consumer, and so its SIGTERM handler, is running)."""
    info = client.workers().get(node)
    children = {child.pid for child in psutil.Process(supervisor.pid).children()}
    if info and info["pid"] in children and client.celery.control.ping(destination=[node], timeout=1.0):
        return info
    return None


def test_one_worker_per_device_restarted_and_stopped(supervisor_factory, client, run_name):
    port = two_free_ports()
    supervisor = supervisor_factory("--metrics-port", str(port), env={"LAYERTAP_WORKER__GPUS": "0,1"})
    nodes = [f"gpu0@{HOST}", f"gpu1@{HOST}"]
    infos = {node: wait_for(lambda node=node: serving(client, node, supervisor), 180, node) for node in nodes}

    # One worker per device, each with its own device list, node name and metrics port.
    workers = [p for p in psutil.Process(supervisor.pid).children(recursive=True) if "worker" in p.cmdline()]
    assert sorted(p.pid for p in workers) == sorted(info["pid"] for info in infos.values())
    for index, node in enumerate(nodes):
        environ = psutil.Process(infos[node]["pid"]).environ()
        assert environ["CUDA_VISIBLE_DEVICES"] == str(index)
        # the host's cores but one shared out: the two workers' helper processes together fit them
        assert environ["LAYERTAP_WORKER__EXAMINE_PROCESSES"] == str(max(1, ((os.cpu_count() or 1) - 1) // 2))
        assert infos[node]["gpus"] == str(index) and infos[node]["model"] == MODEL
        assert infos[node]["metrics_port"] == port + index
        with urllib.request.urlopen(f"http://127.0.0.1:{port + index}/metrics", timeout=10) as response:
            assert f'node="{node}"' in response.read().decode()

    # A child killed is started again, under the same node name, by the same supervisor.
    old_pid = infos[nodes[0]]["pid"]
    os.kill(old_pid, signal.SIGKILL)
    restarted = wait_for(lambda: (info := serving(client, nodes[0], supervisor)) and info["pid"] != old_pid
                         and info, 180, "the restarted worker")
    assert supervisor.poll() is None and restarted["gpus"] == "0"
    jobs = [client.submit({"prompt": f"job {i} after a restart"}, model=MODEL, run=run_name) for i in range(4)]
    results = client.wait(run_name, [job.job_id for job in jobs], timeout=120)
    assert all(result.ok for result in results.values())

    # SIGTERM stops every child (warm shutdown: they deregister) and the supervisor exits 0.
    pids = [restarted["pid"], infos[nodes[1]]["pid"]]
    supervisor.send_signal(signal.SIGTERM)
    assert supervisor.wait(timeout=120) == 0
    assert all(gone(pid) for pid in pids)
    assert not set(nodes) & set(client.redis.hkeys(keys.WORKERS_HASH))


def test_workers_do_not_outlive_a_killed_supervisor(supervisor_factory, client):
    supervisor = supervisor_factory("--gpus", "3")
    node = f"gpu3@{HOST}"
    info = wait_for(lambda: serving(client, node, supervisor), 180, node)
    os.kill(supervisor.pid, signal.SIGKILL)
    supervisor.wait()
    wait_for(lambda: gone(info["pid"]), 120, "the orphaned worker to stop")
    assert node not in client.redis.hkeys(keys.WORKERS_HASH)  # it shut down warm and deregistered


def test_supervisor_refuses_bad_device_lists(tmp_path):
    out = subprocess.run(cli("worker", "--model", str(tmp_path), "--gpus", "0,1,2", "--gpus-per-worker", "2"),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert out.stderr.strip() == "error: 3 GPUs cannot be split into groups of 2"
