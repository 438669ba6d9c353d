"""``layertap worker``: load the model once, start the engine, serve the model's queue.

The worker is one process per device with a Celery *threads* pool: up to
``concurrency`` jobs are in flight at once, each on a task thread that tokenizes,
hands its tokens to the single engine thread that owns the GPU, then writes its file
and publishes its result. CUDA is initialised in this process only (no fork).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from pathlib import Path

from producer import keys
from producer.celery_app import make_celery
from producer.redis_conn import connect
from producer.settings import Settings
from worker.extractor import build_processor
from worker.lease import LeaseKeeper
from worker.model_loading import load_model
from worker.publisher import ResultPublisher
from worker.reconciler import Reconciler
from worker.service import WorkerService
from worker.tasks import register_extract_task
from worker.writer import remove_stale_temp_files

log = logging.getLogger("layertap.worker")
#: Exit code after a device fault: the supervisor (or systemd, Kubernetes) restarts the process.
EXIT_DEVICE_FAULT = 3


def default_node_name() -> str:
    return f"layertap-{os.getpid()}@{socket.gethostname()}"


def read_chat_template(path: str | None) -> str | None:
    """The text of the worker's chat template file (read once, at start), or None."""
    if path is None:
        return None
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the chat template file {path}: {exc}") from None
    if not text.strip():
        raise ValueError(f"the chat template file {path} is empty")
    return text


def run_worker(settings: Settings) -> int:
    """Serve until shut down (SIGTERM/SIGINT: finish running jobs, return the rest). Returns the exit code."""
    ws = settings.worker
    if not ws.model:
        raise ValueError("no model given: pass --model (a local folder or hub id) or set LAYERTAP_WORKER__MODEL")
    logging.basicConfig(level=ws.loglevel.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    node = ws.node_name or default_node_name()
    storage_root = Path(settings.storage_root)
    removed = remove_stale_temp_files(storage_root)
    if removed:
        log.info("removed %d stale temp files under %s", removed, storage_root)
    loaded = load_model(ws.model, name=ws.served_model_name, device=ws.device, dtype=ws.dtype,
                        revision=ws.revision, trust_remote_code=ws.trust_remote_code,
                        chat_template=read_chat_template(ws.chat_template))
    log.info("serving %s (%d layers, hidden %d) on %s as %s; queue %s", loaded.name, loaded.num_layers,
             loaded.hidden_size, loaded.device, str(loaded.dtype).removeprefix("torch."), keys.model_queue(loaded.name))
    faults: list[BaseException] = []

    def on_fatal(exc: BaseException) -> None:
        log.critical("device fault, stopping so the supervisor restarts this worker: %s", exc)
        faults.append(exc)
        os.kill(os.getpid(), signal.SIGTERM)  # warm shutdown: running tasks end (their jobs retry elsewhere)

    processor = build_processor(loaded, storage_root=storage_root, worker_name=node, layers=ws.layers,
                                limits=settings.limits, token_budget=ws.token_budget,
                                max_batch_jobs=ws.max_batch_jobs, batch_wait_s=ws.batch_wait_ms / 1000,
                                host_buffers=ws.host_buffers, write_slots=ws.writer_threads,
                                compile_layers=ws.compile, on_fatal=on_fatal)
    client = connect(settings)
    service = WorkerService(processor, client, ResultPublisher(client), settings.max_attempts)
    app = make_celery(settings)
    register_extract_task(app, service)
    processor.engine.warm_up()
    static_info = {"model": loaded.name, "source": loaded.source, "device": str(loaded.device),
            "dtype": str(loaded.dtype).removeprefix("torch."), "layers": processor.preparer.default_layers,
            "num_layers": loaded.num_layers, "pid": os.getpid(), "host": socket.gethostname(),
            "started": time.time(), "storage_root": str(storage_root.resolve())}
    keeper = LeaseKeeper(client, node, lambda: {**static_info, "engine": processor.engine.snapshot()},
                         settings.orphan_timeout).start()
    reconciler = Reconciler(client, app, node, interval=settings.orphan_timeout, grace=settings.orphan_timeout).start()
    celery_worker = app.Worker(
        hostname=node, pool_cls="threads", concurrency=ws.concurrency, queues=[keys.model_queue(loaded.name)],
        loglevel=ws.loglevel.upper(), without_gossip=True, without_mingle=True, send_events=True,
    )
    try:
        celery_worker.start()
    finally:
        reconciler.stop()
        keeper.stop()
        processor.engine.stop()
    return EXIT_DEVICE_FAULT if faults else (celery_worker.exitcode or 0)
