"""Shared fixtures: a real Redis server, real tiny HF models, real worker processes.

Nothing here is faked: Redis is a ``redis-server`` process on a free port (killable and
restartable), models are built with ``make-tiny-model`` and loaded back with
``from_pretrained``, and workers are ``layertap worker`` processes with a Celery pool.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from layertap.producer.client.client import Client
from layertap.producer.dev.redis_server import RedisServer
from layertap.settings import Settings
from tests.support import blocking, faulty
from tests.support.architectures import ARCHES
from tests.support.jobs import ORPHAN_TIMEOUT, RELIABILITY_ENV
from tests.support.processes import WorkerProcess


def pytest_configure(config: pytest.Config) -> None:
    """Ctrl-C reaches the commands the tests start. A suite started as a background job of a
    non-interactive shell (``make test &``, nohup) inherits SIGINT ignored, and an ignored signal
    stays ignored across ``exec``: every command a test starts would ignore the test's Ctrl-C
    (seen: both Ctrl-C tests failed so). Each pytest process, xdist's workers too, takes Python's
    default handler back, so its children start with SIGINT at its default."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    check_xdist_groups(config)


def check_xdist_groups(config: pytest.Config) -> None:
    """``--dist loadgroup`` must group: otherwise a grouped test goes to any process, and every
    module-scoped fixture (a venv, a server) is built once per process. pytest 9.2 keeps node ids
    where pytest-xdist up to 3.8 cannot add its group suffix, and nothing fails (pytest-xdist issue
    1386): refuse that pair (pyproject pins pytest below 9.2)."""
    if config.getoption("dist", "no") != "loadgroup":
        return
    import xdist
    from packaging.version import Version

    if Version(pytest.__version__) >= Version("9.2.0.dev0") and Version(xdist.__version__) < Version("3.9"):
        raise pytest.UsageError(f"pytest {pytest.__version__} with pytest-xdist {xdist.__version__}: --dist loadgroup "
                                "would not group tests (pytest-xdist issue 1386); pip install 'pytest<9.2'")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under pytest-xdist (``make test``: ``--dist loadgroup``), the tests of a module with a
    module-scoped fixture (a worker, a server, a model built once) run in one process, so the
    fixture is built once; so do the tests that ask for ``arch_workers`` (the llama and gpt2
    workers then start in one process, not in each); every other test goes wherever a process is
    free. Each process has its own session fixtures (Redis on a free port, tiny models, workers)
    and temporary folders. A test with both kinds of fixture goes with its module."""
    for item in items:
        fixtures = getattr(item, "_fixtureinfo", None)
        if fixtures and any(definition.scope == "module" for definitions in fixtures.name2fixturedefs.values()
                            for definition in definitions):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__ if item.module else item.nodeid))
        elif "arch_workers" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("arch_workers"))


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with RedisServer(data_dir=tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny float32 models of three architectures (4 layers, hidden 64), built on the fly: once
    per run, shared by the pytest-xdist processes (the tests only read them; a test that changes
    a model changes a copy)."""
    from layertap.worker.model.tiny_model import make_tiny_model

    if not os.environ.get("PYTEST_XDIST_WORKER"):
        root = tmp_path_factory.mktemp("models")
        return {arch: make_tiny_model(root / arch, arch) for arch in ARCHES}
    root = tmp_path_factory.getbasetemp().parent / "models"  # the run's folder, above each process's own
    root.mkdir(exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the first process builds them, the others wait
        if not (root / ".built").exists():
            for arch in ARCHES:
                make_tiny_model(root / arch, arch)
            (root / ".built").touch()
    return {arch: root / arch for arch in ARCHES}


@pytest.fixture(scope="session")
def storage_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("files")


@pytest.fixture(scope="session", autouse=True)
def readers_storage_root(storage_root: Path) -> Iterator[None]:
    """The tests' own process, and the CLI it runs, read files as a user configured like the
    workers: ``LAYERTAP_STORAGE_ROOT`` names the shared workers' root (readers take a result's file
    only under their own storage roots). A test of other roots gives its readers those."""
    before = os.environ.get("LAYERTAP_STORAGE_ROOT")
    os.environ["LAYERTAP_STORAGE_ROOT"] = str(storage_root)
    yield
    if before is None:
        os.environ.pop("LAYERTAP_STORAGE_ROOT", None)
    else:
        os.environ["LAYERTAP_STORAGE_ROOT"] = before


@contextmanager
def serve_tiny(arches: tuple[str, ...], redis_server: RedisServer, tiny_models: dict[str, Path], storage_root: Path,
               logs: Path) -> Iterator[dict[str, WorkerProcess]]:
    """One worker per architecture in ``arches``, serving ``tiny-<arch>`` as node
    ``test-<arch>@localhost``, started together, ready when yielded, stopped after."""
    started = {
        arch: WorkerProcess(tiny_models[arch], f"tiny-{arch}", redis_server.url, storage_root,
                            node=f"test-{arch}@localhost", log_path=logs / f"{arch}.log").start(wait=False)
        for arch in arches
    }
    try:
        for process in started.values():
            process.wait_ready()
        yield started
    finally:
        for process in started.values():
            process.stop()


@pytest.fixture(scope="session")
def workers(redis_server: RedisServer, tiny_models: dict[str, Path], storage_root: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, WorkerProcess]]:
    """The tiny qwen3 worker, serving ``tiny-qwen3``, for the whole session: what most tests submit to."""
    with serve_tiny(("qwen3",), redis_server, tiny_models, storage_root, tmp_path_factory.mktemp("logs")) as started:
        yield started


@pytest.fixture(scope="session")
def arch_workers(workers: dict[str, WorkerProcess], redis_server: RedisServer, tiny_models: dict[str, Path],
                 storage_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, WorkerProcess]]:
    """A worker per tiny architecture (:data:`ARCHES`), serving ``tiny-<arch>``, for the whole session:
    ``workers`` and one each for the others. Its tests run in one pytest-xdist process
    (``pytest_collection_modifyitems``), so only that process starts the others."""
    others = tuple(arch for arch in ARCHES if arch not in workers)
    with serve_tiny(others, redis_server, tiny_models, storage_root, tmp_path_factory.mktemp("logs")) as started:
        yield {**workers, **started}


@pytest.fixture
def client(redis_server: RedisServer) -> Iterator[Client]:
    with Client(Settings(redis_url=redis_server.url)) as value:
        yield value


@pytest.fixture
def run_name(request: pytest.FixtureRequest) -> str:
    """A run name unique to the test (results streams don't mix)."""
    safe = "".join(ch if ch.isalnum() else "-" for ch in request.node.name)[:80].strip("-")
    return f"{safe}-{os.getpid()}-{time.monotonic_ns() % 10**9}"


@pytest.fixture
def private_redis(tmp_path, request):
    """A private server; parametrized indirectly with a ``redis-server`` path to run that one."""
    with RedisServer(data_dir=tmp_path / "redis", binary=getattr(request, "param", None)) as server:
        yield server


@pytest.fixture
def make_worker(private_redis, tiny_models, tmp_path):
    started: list[WorkerProcess] = []
    storage = tmp_path / "files"

    def make(node: str, *, wait: bool = True, extra_args: list[str] | None = None,
             env: dict[str, str] | None = None, model_dir: Path | None = None,
             name: str = "tiny-qwen3") -> WorkerProcess:
        worker = WorkerProcess(model_dir or tiny_models["qwen3"], name, private_redis.url, storage, node=node,
                               extra_args=extra_args or [], env={**RELIABILITY_ENV, **(env or {})},
                               log_path=tmp_path / f"{node.split('@')[0]}.log")
        started.append(worker)
        return worker.start(wait=wait)

    make.storage = storage  # type: ignore[attr-defined]
    yield make
    for worker in started:
        if worker.process and worker.process.poll() is None:
            os.kill(worker.process.pid, signal.SIGCONT)
        worker.kill()


@pytest.fixture
def private_client(private_redis):
    with Client(Settings(redis_url=private_redis.url, orphan_timeout=ORPHAN_TIMEOUT)) as value:
        yield value


def _model_with_code(tiny_model: Path, folder: Path, code: str, class_name: str) -> Path:
    """A copy of ``tiny_model`` in ``folder`` whose config loads ``class_name`` from ``code``."""
    shutil.copytree(tiny_model, folder)
    (folder / "modeling_custom.py").write_text(code)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": f"modeling_custom.{class_name}"}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def blocking_model(tiny_models, tmp_path_factory) -> Path:
    """The tiny Qwen3 model, saved with modeling code of its own that can block."""
    return _model_with_code(tiny_models["qwen3"], tmp_path_factory.mktemp("blocking") / "model",
                            blocking.BLOCKING_MODEL_CODE, "BlockingQwen3ForCausalLM")


@pytest.fixture(scope="module")
def crashing_model(tiny_models, tmp_path_factory) -> Path:
    """The tiny Qwen3 model, saved with modeling code of its own that kills its process on a marker."""
    return _model_with_code(tiny_models["qwen3"], tmp_path_factory.mktemp("crashing") / "model",
                            blocking.CRASHING_MODEL_CODE, "CrashingQwen3ForCausalLM")


@pytest.fixture(scope="module")
def faulty_batch_model(tiny_models, tmp_path_factory) -> Path:
    """The tiny Qwen3 model, saved with modeling code of its own whose long forwards are wrong
    past a position the load-time self-check never reaches (``tests.support.faulty``)."""
    return _model_with_code(tiny_models["qwen3"], tmp_path_factory.mktemp("faulty") / "model",
                            faulty.FAULTY_BATCH_MODEL_CODE, "WrappingQwen3ForCausalLM")
