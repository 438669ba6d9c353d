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
import threading
import time
from pathlib import Path

from celery.signals import worker_ready, worker_shutting_down

from layertap.protocol import keys
from layertap.protocol.naming import served_model_name
from layertap.settings import LogFormat, Settings
from layertap.transport.broker_transport import set_held_messages
from layertap.transport.celery_app import make_celery
from layertap.worker.extractor import build_processor
from layertap.worker.job.image_check import warm_up_images
from layertap.worker.model.loading import load_model
from layertap.worker.ops.cpu_threads import set_cpu_threads
from layertap.worker.ops.gc_freeze import freeze_long_lived_objects
from layertap.worker.ops.lifecycle import ServiceGroup
from layertap.worker.ops.logs import configure_logging
from layertap.worker.ops.metrics import WorkerMetrics
from layertap.worker.ops.progress import ProgressLine
from layertap.worker.ops.phase import LOADING, SERVING, report_phase
from layertap.worker.ops.watchdog import EngineWatchdog, start_deadline
from layertap.worker.queue.handler import WorkerService
from layertap.worker.queue.lease import LeaseKeeper, held_delivery_tags
from layertap.worker.queue.publisher import PUBLISH_GIVE_UP_S, ResultPublisher
from layertap.worker.queue.reconciler import Reconciler
from layertap.worker.queue.retention import RetentionSweep
from layertap.worker.queue.run_records import LedgerCaptures, sample_recorder
from layertap.worker.queue.sinks import SinkContext, build_sinks
from layertap.worker.queue.task_events import batch_task_events
from layertap.worker.queue.tasks import register_bundle_task, register_extract_task
from layertap.worker.startup import check_layers, check_model_source, reach_redis, settings_line

log = logging.getLogger("layertap.worker")
#: Exit code after a device fault: the supervisor (or systemd, Kubernetes) restarts the process.
EXIT_DEVICE_FAULT = 3
#: Exit code of a worker that stopped making progress (hung engine, warm shutdown past its deadline).
EXIT_STALLED = 4


def default_node_name() -> str:
    return f"layertap-{os.getpid()}@{socket.gethostname()}"


def _process_cpu() -> dict[str, float]:
    """This process's user and system CPU seconds so far (every thread)."""
    times = os.times()
    return {"user_s": round(times.user, 3), "system_s": round(times.system, 3)}


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
    """Serve until shut down (SIGTERM/SIGINT: finish the jobs queued for the engine, hand every
    other message back to its queue unstarted). Returns the exit code."""
    ws = settings.worker
    if not ws.model:
        raise ValueError("no model given: pass --model (a local folder or hub id) or set LAYERTAP_WORKER__MODEL")
    check_model_source(ws.model)
    configure_logging(ws.loglevel, ws.log_format)
    client = reach_redis(settings)
    node = ws.node_name or default_node_name()
    storage = settings.storage()  # a local root is made absolute: published paths are absolute
    removed = storage.sweep_stale()
    if removed:
        log.info("removed %d stale temp files of %s", removed, storage)
    report_phase(LOADING)
    loaded = load_model(ws.model, name=ws.served_model_name or served_model_name(ws.model), device=ws.device,
                        dtype=ws.dtype, revision=ws.revision, trust_remote_code=ws.trust_remote_code,
                        chat_template=read_chat_template(ws.chat_template), batching=ws.batching,
                        quant_compute=ws.quant_compute, stages=ws.split_stages, token_budget=ws.token_budget,
                        captured_layers=len(ws.layers) if ws.layers else None)
    check_layers(ws.layers, loaded.num_layers)
    set_cpu_threads(ws.cpu_threads, loaded.device)
    log.info("serving %s (%s, %d layers, hidden %d) on %s as %s; queue %s; jobs use --model %s", loaded.name,
             loaded.architecture, loaded.num_layers, loaded.hidden_size, loaded.device,
             str(loaded.dtype).removeprefix("torch."), keys.model_queue(loaded.name), loaded.name)
    log.info("weights fingerprint %s (%s%s), tokenizer fingerprint %s", loaded.weights_fingerprint, loaded.source,
             f" @ {loaded.revision}" if loaded.revision else "", loaded.tokenizer_fingerprint or "-")
    log.info("batching: %s", loaded.batching.describe())
    log.info("model source %s, revision %s; settings in force: %s", loaded.source, ws.revision or "(default)",
             settings_line(settings))
    faults: list[BaseException] = []

    def on_fatal(exc: BaseException) -> None:
        log.critical("device fault, stopping so the supervisor restarts this worker: %s", exc)
        faults.append(exc)
        os.kill(os.getpid(), signal.SIGTERM)  # warm shutdown: running tasks end (their jobs retry elsewhere)

    processor = build_processor(loaded, storage_root=storage, worker_name=node, layers=ws.layers,
                                limits=settings.limits, token_budget=ws.token_budget,
                                max_batch_jobs=ws.max_batch_jobs, batch_wait_s=ws.batch_wait_ms / 1000,
                                max_padding=ws.max_padding,
                                host_buffers=ws.host_buffers, writer_threads=ws.writer_threads,
                                prepare_ahead=ws.prepare_ahead_batches,
                                compile_layers=ws.compile, images_root=settings.images_root, on_fatal=on_fatal,
                                tower_graphs=ws.tower_graphs, prefix_sharing=ws.prefix_sharing,
                                sampling=(sample_recorder(client, PUBLISH_GIVE_UP_S), ws.sample_every, ws.sample_min)
                                if ws.sample_every or ws.sample_min else None,
                                captures=LedgerCaptures(client) if ws.reuse else None)
    log.info("image chats: %s", f"{type(loaded.processor).__name__}, {loaded.image_batching.describe()}, paths under "
             f"{settings.images_root or '(no images_root: data URLs only)'}" if loaded.processor is not None
             else f"not served ({loaded.processor_problem})")
    gpus, dtype = os.environ.get("CUDA_VISIBLE_DEVICES", ""), str(loaded.dtype).removeprefix("torch.")
    metrics = WorkerMetrics(processor.engine, {"node": node, "model": loaded.name, "device": str(loaded.device),
                                               "gpus": gpus, "dtype": dtype}, storage)
    publisher = ResultPublisher(client, sinks=build_sinks(ws.result_sinks, SinkContext(node, metrics)))
    service = WorkerService(processor, publisher, settings.max_attempts,
                            storage_retry_s=settings.worker.storage_retry_s)
    app = make_celery(settings)
    set_held_messages(held_delivery_tags)  # a broker channel closing after an error leaves these held
    register_extract_task(app, service)
    register_bundle_task(app, service)
    batch_task_events(app)
    # on a GPU also a full batch: the first jobs run at the worker's pace (allocator growth, compiled shapes)
    processor.engine.warm_up(full_batch=loaded.device.type == "cuda")
    if loaded.device.type == "cuda":  # and an image batch (compiled vision blocks, the image path's kernels)
        warm_up_images(processor.engine, processor.preparer)
    freeze_long_lived_objects()
    processor.engine.on_batch = metrics.observe_batch
    if ws.metrics_port:
        metrics.serve(ws.metrics_port)
    static_info = {"model": loaded.name, "source": loaded.source, "device": str(loaded.device), "dtype": dtype,
                   "layers": processor.preparer.default_layers, "num_layers": loaded.num_layers,
                   "hidden_size": loaded.hidden_size, "residual_copies": loaded.capture.stream.copies,
                   "pid": os.getpid(),
                   "host": socket.gethostname(), "started": time.time(), "storage_root": storage.root,
                   "gpus": gpus, "metrics_port": ws.metrics_port, "architecture": loaded.architecture,
                   "batching": loaded.batching.name, "batching_reason": loaded.batching.reason,
                   "weights_fingerprint": loaded.weights_fingerprint, "revision": loaded.revision,
                   "tokenizer_fingerprint": loaded.tokenizer_fingerprint,
                   "self_check": processor.self_check.describe() if processor.self_check else None,
                   "load": loaded.load_report.as_json() if loaded.load_report else None,
                   "quantization": loaded.quantization.describe() if loaded.quantization else None,
                   "quant_compute": loaded.quant_compute or None, "experts": loaded.experts}
    keeper = LeaseKeeper(client, node, lambda: {**static_info, "engine": processor.engine.snapshot(),
                                                "tokens_per_s": round(metrics.tokens_per_second(), 1),
                                                "cpu": _process_cpu()},
                         settings.orphan_timeout)
    reconciler = Reconciler(client, app, node, interval=settings.orphan_timeout, grace=settings.orphan_timeout,
                            publisher=publisher)
    retention = RetentionSweep(client, node, settings.retention.results_s, settings.retention.sweep_interval_s)

    hang_bound = ws.hang_bound_s(settings.limits.max_tokens)

    def on_stall(reason: str) -> None:
        # Nothing here waits on the engine: stop renewing leases, deregister, exit. The held
        # messages go back to the queue after orphan_timeout; the supervisor restarts us.
        log.critical("worker stalled, exiting so its jobs go to other workers: %s", reason)
        keeper.stop()
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(EXIT_STALLED)

    watchdog = EngineWatchdog(processor.engine, processor.awaiting_engine, hang_bound, on_stall)
    progress = ProgressLine(processor.engine, client, loaded.name, ws.progress_interval_s)
    # Started in this order once Celery consumes, stopped in reverse: the watchdog before the
    # engine stops, the heartbeat (deregistering) last.
    background = ServiceGroup([keeper, reconciler, retention, watchdog, progress])

    def on_ready(**_: object) -> None:
        # Announce the worker (heartbeat) only once Celery consumes and handles SIGTERM.
        background.start()
        report_phase(SERVING)

    def on_shutting_down(**_: object) -> None:
        # Messages still waiting for a place ahead of the engine go back to the queue unstarted
        # (layertap.worker.queue.tasks); off the signal handler's thread, which must not wait on a lock.
        threading.Thread(target=processor.engine.close_admission, name="layertap-close-admission",
                         daemon=True).start()
        seconds = ws.shutdown_deadline_s(settings.limits.max_tokens)
        start_deadline(seconds, f"the warm shutdown did not end within {seconds:.0f}s "
                                "(LAYERTAP_WORKER__SHUTDOWN_TIMEOUT)", on_stall)

    worker_ready.connect(on_ready, weak=False)
    worker_shutting_down.connect(on_shutting_down, weak=False)
    celery_worker = app.Worker(
        hostname=node, pool_cls="threads", concurrency=ws.concurrency, queues=[keys.model_queue(loaded.name)],
        loglevel=ws.loglevel.upper(), without_gossip=True, without_mingle=True, send_events=True,
        quiet=ws.log_format is LogFormat.json,  # no banner on stdout: every line stays JSON
    )
    try:
        celery_worker.start()
    finally:
        background.stop()
        metrics.close()
        processor.close()
    return EXIT_DEVICE_FAULT if faults else (celery_worker.exitcode or 0)
