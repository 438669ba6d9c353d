"""The client install: a fresh venv with ``pip install .`` and no extras (so no torch)
enqueues, reads results and status, loads a file with numpy, and prints the install hint for
the commands that need the worker extra. The jobs are served by a worker from the dev venv."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def client_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv where ``pip install .`` ran in a copy of the checkout's package files (no extras;
    dependencies from pip's indexes), so the build leaves nothing in the checkout."""
    root = tmp_path_factory.mktemp("client-venv")
    source = root / "layertap"
    source.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(REPO / name, source / name)
    for package in ("layertap", "producer", "worker"):  # layertap/producer and layertap/worker are links
        shutil.copytree(REPO / package, source / package, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    env_dir = root / "venv"
    venv.create(env_dir, with_pip=True)
    built = subprocess.run([str(env_dir / "bin" / "python"), "-m", "pip", "install", "-v", "."], cwd=source,
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    # `make demo` showed them
    for noise in ("BuildBackendWarning", "SetuptoolsDeprecationWarning", "layertap.producer.data"):
        assert noise not in built.stdout + built.stderr
    return env_dir / "bin"


def run_in(bin_dir: Path, cwd: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run a command of the client venv outside the checkout (so the checkout's packages are not on the path)."""
    clean = {key: value for key, value in os.environ.items() if not key.startswith(("LAYERTAP_", "PYTHON"))}
    return subprocess.run([str(bin_dir / args[0]), *args[1:]], cwd=cwd, env={**clean, **(env or {})},
                          capture_output=True, text=True, timeout=120)


def test_client_install_has_no_torch_and_works(client_venv, workers, redis_server, run_name, tmp_path):
    missing = run_in(client_venv, tmp_path, "python", "-c",
                     "import importlib.util as u; print([m for m in ('torch', 'transformers') if u.find_spec(m)])")
    assert missing.stdout.strip() == "[]", missing.stdout + missing.stderr
    assert run_in(client_venv, tmp_path, "layertap", "--help").returncode == 0
    version = run_in(client_venv, tmp_path, "layertap", "--version")
    assert version.returncode == 0 and version.stdout.startswith("layertap ")

    env = {"LAYERTAP_REDIS_URL": redis_server.url}
    sent = run_in(client_venv, tmp_path, "layertap", "enqueue", "--model", "tiny-qwen3", "--run", run_name,
                  "--prompt", "Hello from a client without torch", env=env)
    assert sent.returncode == 0, sent.stderr
    (job_id,) = sent.stdout.split()
    follow = run_in(client_venv, tmp_path, "layertap", "results", "--run", run_name, "--follow", "--json",
                    "--timeout", "60", env=env)
    assert follow.returncode == 0, follow.stderr
    (result,) = [json.loads(line) for line in follow.stdout.splitlines()]
    assert result["job_id"] == job_id and result["status"] == "ok", result
    status = run_in(client_venv, tmp_path, "layertap", "status", env=env)
    assert status.returncode == 0 and "tiny-qwen3" in status.stdout and redis_server.url in status.stdout

    loaded = run_in(client_venv, tmp_path, "python", "-c",
                    "import sys; from layertap import load_hidden_states; t = load_hidden_states(sys.argv[1]); "
                    "print(type(t['hidden_states']).__module__, t['hidden_states'].shape[0], len(t['token_ids']))",
                    result["path"])
    assert loaded.returncode == 0, loaded.stderr
    module, rows, tokens = loaded.stdout.split()
    assert module == "numpy" and int(rows) == int(tokens) == result["num_tokens"]
    inspected = run_in(client_venv, tmp_path, "layertap", "inspect", result["path"], "--plot", str(tmp_path / "x.png"))
    assert inspected.returncode == 1
    assert inspected.stderr.strip() == ("error: --plot needs matplotlib, which is not installed: "
                                        "pip install 'layertap[plots]'")
    watched = run_in(client_venv, tmp_path, "layertap", "watch", "--run", f"{run_name}-never", "--plot",
                     str(tmp_path / "w.png"), env=env)  # refused at the start, not after a run that never ends
    assert watched.returncode == 1
    assert watched.stderr.strip() == ("error: watch --plot needs matplotlib, which is not installed: "
                                      "pip install 'layertap[plots]'")


@pytest.mark.parametrize("command", [["worker", "--model", "anything"], ["make-tiny-model", "x"], ["demo"],
                                     ["bench"]])
def test_worker_commands_print_the_install_hint(client_venv, tmp_path, command):
    out = run_in(client_venv, tmp_path, "layertap", *command)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        f"error: `layertap {command[0]}` needs torch, which is not installed: pip install 'layertap[worker]'"]


def test_worker_extractor_names_the_extra_to_install(client_venv, tmp_path):
    out = run_in(client_venv, tmp_path, "python", "-c", "from layertap import Extractor")
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1] == (
        "layertap.extras.MissingExtra: worker.Extractor needs torch, which is not installed: "
        "pip install 'layertap[worker]'")


def test_a_users_own_producer_and_worker_modules_shadow_nothing_of_ours(client_venv, tmp_path):
    for name in ("producer", "worker"):
        (tmp_path / f"{name}.py").write_text("MINE = True\n")
    code = ("import producer, worker, layertap, layertap.producer.client.client, layertap.worker; "
            "assert producer.MINE and worker.MINE; from layertap import Client, load_hidden_states; print('ok')")
    out = run_in(client_venv, tmp_path, "python", "-c", code)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stdout + out.stderr


def test_the_old_import_names_still_work_for_one_release_with_a_warning(client_venv, tmp_path):
    strict = run_in(client_venv, tmp_path, "python", "-W", "error::DeprecationWarning", "-c", "import producer")
    assert strict.returncode != 0 and "`import producer` is deprecated" in strict.stderr, strict.stderr
    code = ("import warnings\n"
            "with warnings.catch_warnings(record=True) as seen:\n"
            "    warnings.simplefilter('always')\n"
            "    import producer.protocol.keys as old, worker\n"
            "    import layertap.producer.transport.ledger as old_ledger\n"
            "    from producer import Client\n"
            "import layertap, layertap.protocol.keys as new, layertap.transport.ledger as ledger\n"
            "assert old is new and old_ledger is ledger and Client is layertap.Client and worker is layertap.worker\n"
            "assert new.__spec__.name == 'layertap.protocol.keys'\n"
            "print(sorted({str(w.message).split('`')[1] for w in seen if w.category is DeprecationWarning}))")
    out = run_in(client_venv, tmp_path, "python", "-c", code)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip() == "['import producer', 'import worker', 'layertap.producer.protocol', " \
                                 "'layertap.producer.transport']"
