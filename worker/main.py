"""``layertap worker``: load the model once, start the engine, serve the model's queue.

The worker is one process per device with a Celery *threads* pool: up to
``concurrency`` jobs are in flight at once, each on a task thread that tokenizes,
hands its tokens to the single engine thread that owns the GPU, then writes its file
and publishes its result. CUDA is initialised in this process only (no fork).

:func:`run_worker` is the wiring: what a worker is made of, in the order it is built.
:class:`Worker` is its life: named hooks that Celery's signals and the engine call.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from celery import Celery
from celery.signals import worker_ready, worker_shutting_down

from layertap.protocol import keys
from layertap.protocol.naming import served_model_name
from layertap.settings import LogFormat, Settings
from layertap.storage.base import Storage
from layertap.transport.broker_transport import set_held_messages
from layertap.transport.celery_app import make_celery
from layertap.worker.extractor import build_processor
from layertap.worker.job.image_check import warm_up_images
from layertap.worker.job.pipeline import JobProcessor
from layertap.worker.job.sampling import SamplingPlan
from layertap.worker.model.attention import resolved_kernel, use_varlen_kernel
from layertap.worker.model.loading import LoadedModel, load_model
from layertap.worker.ops.cpu_threads import set_cpu_threads
from layertap.worker.ops.gc_freeze import freeze_long_lived_objects
from layertap.worker.ops.lifecycle import Service, ServiceGroup
from layertap.worker.ops.logs import configure_logging
from layertap.worker.ops.metrics import WorkerMetrics
from layertap.worker.ops.phase import LOADING, SERVING, report_phase
from layertap.worker.ops.progress import ProgressLine
from layertap.worker.ops.watchdog import EngineWatchdog, start_deadline
from layertap.worker.queue.handler import WorkerService
from layertap.worker.queue.lease import LeaseKeeper, held_delivery_tags
from layertap.worker.queue.publisher import PUBLISH_GIVE_UP_S, ResultPublisher
from layertap.worker.queue.reconciler import Reconciler
from layertap.worker.queue.retention import RetentionSweep
from layertap.worker.queue.run_records import LedgerCaptures, LedgerSamples
from layertap.worker.queue.sinks import SinkContext, build_sinks
from layertap.worker.queue.task_events import batch_task_events
from layertap.worker.queue.tasks import register_bundle_task, register_extract_task
from layertap.worker.startup import check_layers, check_model_source, reach_redis, settings_line

log = logging.getLogger("layertap.worker")
#: Exit code after a device fault: the supervisor (or systemd, Kubernetes) restarts the process.
EXIT_DEVICE_FAULT = 3
#: Exit code of a worker that stopped making progress (hung engine, warm shutdown past its deadline).
EXIT_STALLED = 4


def run_worker(settings: Settings) -> int:
    """Serve until shut down (SIGTERM/SIGINT: finish the jobs queued for the engine, hand every
    other message back to its queue unstarted). Returns the exit code."""
    ws = settings.worker
    if not ws.model:
        raise ValueError("no model given: pass --model (a local folder or hub id) or set LAYERTAP_WORKER__MODEL")
    check_model_source(ws.model)
    configure_logging(ws.loglevel, ws.log_format)
    client = reach_redis(settings)
    worker = Worker(settings, ws.node_name or default_node_name())
    storage = swept(settings.storage())  # a local root is made absolute: published paths are absolute
    report_phase(LOADING)
    use_varlen_kernel(ws.attention_kernel)
    loaded = load(settings)
    processor = build_processor(loaded, storage_root=storage, worker_name=worker.node, layers=ws.layers,
                                limits=settings.limits, token_budget=ws.token_budget,
                                max_batch_jobs=ws.max_batch_jobs, batch_wait_s=ws.batch_wait_ms / 1000,
                                max_padding=ws.max_padding, host_buffers=ws.host_buffers,
                                writer_threads=ws.writer_threads, prepare_ahead=ws.prepare_ahead_batches,
                                compile_layers=ws.compile, images_root=settings.images_root, on_fatal=worker.on_fatal,
                                tower_graphs=ws.tower_graphs, prefix_sharing=ws.prefix_sharing,
                                prefix_cache_mib=ws.prefix_cache_mib,
                                sampling=SamplingPlan(LedgerSamples(client, PUBLISH_GIVE_UP_S), ws.sample_every,
                                                      ws.sample_min, ws.sample_within_s)
                                if ws.sample_every or ws.sample_min else None,
                                captures=LedgerCaptures(client) if ws.reuse else None,
                                examine_processes=ws.examine_processes)
    log_image_chats(loaded, settings.images_root)
    log.info("files written by %d writer threads (worker.writer_threads %s)", processor.writer_threads,
             "unset" if ws.writer_threads is None else ws.writer_threads)
    if loaded.device.type == "cuda":
        log.info("packed attention's GPU kernel: %s (worker.attention_kernel = %s)", resolved_kernel(loaded.device),
                 ws.attention_kernel)
    metrics = WorkerMetrics(processor.engine, labels(worker.node, loaded), storage)
    publisher = ResultPublisher(client, sinks=build_sinks(ws.result_sinks, SinkContext(worker.node, metrics)))
    app = serving(make_celery(settings), WorkerService(processor, publisher, settings.max_attempts,
                                                       storage_retry_s=ws.storage_retry_s))
    warm_up(processor, metrics, ws.metrics_port)
    keeper = LeaseKeeper(client, worker.node, registration(loaded, processor, metrics, storage, ws.metrics_port),
                         settings.orphan_timeout)
    worker.attach(processor, metrics, keeper, [  # started in this order once Celery consumes, stopped in reverse
        Reconciler(client, app, worker.node, interval=settings.orphan_timeout, grace=settings.orphan_timeout,
                   publisher=publisher),
        RetentionSweep(client, worker.node, settings.retention.results_s, settings.retention.sweep_interval_s),
        EngineWatchdog(processor.engine, processor.awaiting_engine, ws.hang_bound_s(settings.limits.max_tokens),
                       worker.on_stall),
        ProgressLine(processor.engine, client, loaded.name, ws.progress_interval_s)])
    worker_ready.connect(worker.on_ready, weak=False)
    worker_shutting_down.connect(worker.on_shutting_down, weak=False)
    return worker.serve(app, keys.model_queue(loaded.name))


class Worker:
    """One worker process's life (arq's shape): its parts, as :func:`run_worker` builds them, and
    the named hooks run at each turn of it.

    * :meth:`on_fatal` (a device fault in the engine): a warm shutdown; the exit code says so;
    * :meth:`on_ready` (Celery consumes and handles SIGTERM): the background services start, the
      heartbeat announcing the worker first and stopping last; the phase is ``serving``;
    * :meth:`on_shutting_down` (SIGTERM/SIGINT, a warm shutdown): messages still waiting for a
      place ahead of the engine go back to their queue unstarted, and the deadline is armed;
    * :meth:`on_stall` (a hung engine, or a shutdown past its deadline): exit at once;
    * :meth:`serve`: Celery's worker until it shuts down, then services, metrics and engine stopped.
    """

    def __init__(self, settings: Settings, node: str) -> None:
        self.settings = settings
        self.node = node
        self.faults: list[BaseException] = []
        self.processor: JobProcessor | None = None
        self.metrics: WorkerMetrics | None = None
        self.keeper: LeaseKeeper | None = None
        self.services = ServiceGroup([])

    def attach(self, processor: JobProcessor, metrics: WorkerMetrics, keeper: LeaseKeeper,
               services: Sequence[Service]) -> None:
        """The parts the hooks act on: the background ``services`` run after the heartbeat (``keeper``)."""
        self.processor, self.metrics, self.keeper = processor, metrics, keeper
        self.services = ServiceGroup([keeper, *services])

    def on_fatal(self, exc: BaseException) -> None:
        log.critical("device fault, stopping so the supervisor restarts this worker: %s", exc)
        self.faults.append(exc)
        os.kill(os.getpid(), signal.SIGTERM)  # warm shutdown: running tasks end (their jobs retry elsewhere)

    def on_ready(self, **_: object) -> None:
        # Announce the worker (heartbeat) only once Celery consumes and handles SIGTERM.
        self.services.start()
        report_phase(SERVING)

    def on_shutting_down(self, **_: object) -> None:
        # Messages still waiting for a place ahead of the engine go back to the queue unstarted
        # (layertap.worker.queue.tasks); off the signal handler's thread, which must not wait on a lock.
        assert self.processor is not None, "attached before Celery runs"
        threading.Thread(target=self.processor.engine.close_admission, name="layertap-close-admission",
                         daemon=True).start()
        seconds = self.settings.worker.shutdown_deadline_s(self.settings.limits.max_tokens)
        start_deadline(seconds, f"the warm shutdown did not end within {seconds:.0f}s "
                                "(LAYERTAP_WORKER__SHUTDOWN_TIMEOUT)", self.on_stall)

    def on_stall(self, reason: str) -> None:
        # Nothing here waits on the engine: stop renewing leases, deregister, exit. The held
        # messages go back to the queue after orphan_timeout; the supervisor restarts us.
        log.critical("worker stalled, exiting so its jobs go to other workers: %s", reason)
        if self.keeper is not None:
            self.keeper.stop()
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(EXIT_STALLED)

    def serve(self, app: Celery, queue: str) -> int:
        """Consume ``queue`` until shut down; the exit code."""
        ws = self.settings.worker
        celery_worker = app.Worker(
            hostname=self.node, pool_cls="threads", concurrency=ws.concurrency, queues=[queue],
            loglevel=ws.loglevel.upper(), without_gossip=True, without_mingle=True, send_events=True,
            quiet=ws.log_format is LogFormat.json,  # no banner on stdout: every line stays JSON
        )
        try:
            celery_worker.start()
        finally:
            if self.processor is not None and self.processor.sampler is not None:
                self.processor.sampler.close()  # its rows measured while the heartbeat says it lives
            self.services.stop()
            if self.metrics is not None:
                self.metrics.close()
            if self.processor is not None:
                self.processor.close()
        return EXIT_DEVICE_FAULT if self.faults else (celery_worker.exitcode or 0)


def default_node_name() -> str:
    """``layertap-<pid>@<host>``: the Celery node name when ``worker.node_name`` is unset (one per process)."""
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


def swept(storage: Storage) -> Storage:
    """``storage``, with what dead writers left in it removed."""
    removed = storage.sweep_stale()
    if removed:
        log.info("removed %d stale temp files of %s", removed, storage)
    return storage


def load(settings: Settings) -> LoadedModel:
    """The worker's model, loaded once and checked against its settings; what it serves is logged."""
    ws = settings.worker
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
    return loaded


def log_image_chats(loaded: LoadedModel, images_root: Path | None) -> None:
    """How the worker serves chats with images, once its image self-check has run (``build_processor``)."""
    log.info("image chats: %s", f"{type(loaded.processor).__name__}, {loaded.image_batching.describe()}, paths under "
             f"{images_root or '(no images_root: data URLs only)'}" if loaded.processor is not None
             else f"not served ({loaded.processor_problem})")


def labels(node: str, loaded: LoadedModel) -> dict[str, str]:
    """The worker's metrics labels."""
    return {"node": node, "model": loaded.name, "device": str(loaded.device),
            "gpus": os.environ.get("CUDA_VISIBLE_DEVICES", ""), "dtype": str(loaded.dtype).removeprefix("torch.")}


def serving(app: Celery, service: WorkerService) -> Celery:
    """``app`` with the worker's tasks, run by ``service``."""
    set_held_messages(held_delivery_tags)  # a broker channel closing after an error leaves these held
    register_extract_task(app, service)
    register_bundle_task(app, service)
    batch_task_events(app)
    return app


def warm_up(processor: JobProcessor, metrics: WorkerMetrics, metrics_port: int | None) -> None:
    """The engine's first batches run before any job (on a GPU a full one, and an image batch: the
    first jobs then run at the worker's pace), long-lived objects frozen for the collector, the
    metrics fed and served."""
    gpu = processor.loaded.device.type == "cuda"
    processor.engine.warm_up(full_batch=gpu)  # allocator growth, compiled shapes
    if gpu:  # compiled vision blocks, the image path's kernels
        warm_up_images(processor.engine, processor.preparer)
    freeze_long_lived_objects()
    processor.engine.on_batch = metrics.observe_batch
    if metrics_port:
        metrics.serve(metrics_port)


def registration(loaded: LoadedModel, processor: JobProcessor, metrics: WorkerMetrics, storage: Storage,
                 metrics_port: int | None) -> Callable[[], dict[str, Any]]:
    """What the worker's heartbeat says of it (``keys.WORKERS_HASH``): fixed facts, and the engine's
    state, rate and CPU time as of each beat."""
    facts = {"model": loaded.name, "source": loaded.source, "device": str(loaded.device),
             "dtype": str(loaded.dtype).removeprefix("torch."), "layers": processor.preparer.default_layers,
             "num_layers": loaded.num_layers, "hidden_size": loaded.hidden_size,
             "residual_copies": loaded.capture.stream.copies, "pid": os.getpid(), "host": socket.gethostname(),
             "started": time.time(), "storage_root": storage.root, "gpus": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
             "metrics_port": metrics_port, "architecture": loaded.architecture,
             "batching": loaded.batching.name, "batching_reason": loaded.batching.reason,
             "weights_fingerprint": loaded.weights_fingerprint, "revision": loaded.revision,
             "tokenizer_fingerprint": loaded.tokenizer_fingerprint,
             "self_check": processor.self_check.describe() if processor.self_check else None,
             "load": loaded.load_report.as_json() if loaded.load_report else None,
             "quantization": loaded.quantization.describe() if loaded.quantization else None,
             "quant_compute": loaded.quant_compute or None, "experts": loaded.experts, "compiled": loaded.compiled}

    def now() -> dict[str, Any]:
        return {**facts, "engine": processor.engine.snapshot(), "tokens_per_s": round(metrics.tokens_per_second(), 1),
                "cpu": _process_cpu()}
    return now
