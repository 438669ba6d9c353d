"""Part (d) of ``layertap bench``: jobs through Redis to a ``layertap worker`` process and
results back from the stream."""

from __future__ import annotations

import os
import socket
import subprocess
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from layertap.command import layertap_argv
from layertap.worker.bench.config import BenchConfig, PartResult
from layertap.worker.bench.measure import dir_bytes


def beats_after(serving: Callable[[], dict[str, Any]], moment: float, most_s: float) -> list[dict[str, Any]]:
    """The record of each worker ``serving()`` names, once each is from a heartbeat after ``moment``
    (a beat stamps its time before it reads the engine's counters), or as they are after ``most_s``."""
    deadline = time.monotonic() + most_s
    while True:
        records = list(serving().values())
        if all(float(record.get("beat") or 0) > moment for record in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.1)


def run_queue(cfg: BenchConfig, prompts: list[list[int]], layer_ids: list[int], out: Path, *,
              jobs: list[dict[str, Any]] | None = None, images_root: Path | None = None) -> PartResult:
    """(d) Redis -> Celery worker process -> files -> results on the stream. ``jobs``: job data
    to send instead of ``prompts`` as token ids (chats with images, paths under ``images_root``
    for client and worker); tokens are then counted from the results."""
    from layertap.producer.client.client import Client, NoWorkerWarning
    from layertap.producer.dev.redis_server import RedisServer
    from layertap.settings import Settings

    server = None if cfg.redis_url else RedisServer().start()
    url = cfg.redis_url or server.url  # type: ignore[union-attr]
    node = f"bench-{os.getpid()}@{socket.gethostname()}"
    name = "bench-model"
    env = {**os.environ, "LAYERTAP_REDIS_URL": url, "LAYERTAP_STORAGE_ROOT": str(out),
           "LAYERTAP_WORKER__QUANT_COMPUTE": cfg.quant_compute,
           "LAYERTAP_WORKER__CONCURRENCY": str(cfg.concurrency), "LAYERTAP_WORKER__COMPILE": str(cfg.compile).lower(),
           "LAYERTAP_WORKER__MAX_PADDING": str(cfg.max_padding), "LAYERTAP_WORKER__SPLIT_STAGES": str(cfg.split_stages),
           "LAYERTAP_WORKER__GPUS_PER_WORKER": str(cfg.gpus_per_worker),
           **({"LAYERTAP_IMAGES_ROOT": str(images_root)} if images_root is not None else {})}
    log = open(out.parent / "bench-worker.log", "w")
    placement = ["--node-name", node, "--device", cfg.device] if not cfg.gpus else (
        ["--gpus", cfg.gpus] + (["--device", cfg.device] if cfg.device != "auto" else []))
    worker: subprocess.Popen[bytes] | None = None

    def start_worker() -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            layertap_argv("worker", "--model", cfg.model, "--name", name, *placement,
             "--dtype", cfg.dtype, "--layers", ",".join(map(str, layer_ids)), "--token-budget",
             str(cfg.token_budget), "--loglevel", "WARNING"), env=env, stdout=log, stderr=subprocess.STDOUT)

    expected = len(cfg.gpus.split(",")) // cfg.gpus_per_worker if cfg.gpus else 1
    run = f"bench-{int(time.time())}"
    try:
        with Client(Settings(redis_url=url, images_root=images_root)) as client:
            deadline = time.monotonic() + 600

            def submit_all() -> list[str]:  # in bundles unless LAYERTAP_BUNDLE__MAX_JOBS=1
                data = jobs if jobs is not None else ({"token_ids": ids} for ids in prompts)
                sent = ({**job, "job_id": f"p{i}"} for i, job in enumerate(data))
                return [job.job_id for job in client.submit_many(sent, model=name, run=run, layers=layer_ids,
                                                                 check=False)]  # (a backlog: before its worker)

            def serving() -> dict[str, Any]:
                return {n: i for n, i in client.workers().items() if i["model"] == name}

            with warnings.catch_warnings():  # a backlog is queued before its worker starts, on purpose
                warnings.simplefilter("ignore", NoWorkerWarning)
                job_ids = submit_all() if cfg.backlog else []
            worker = start_worker()
            while len(serving()) < expected:
                if worker.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"bench worker did not start; see {log.name}")
                time.sleep(0.05)
            before = list(serving().values())
            start, start_wall = time.perf_counter(), time.time()
            if not cfg.backlog:
                job_ids = submit_all()
            submitted_s = time.perf_counter() - start
            results = client.wait(run, job_ids, timeout=3600)
            seconds, end_wall = time.perf_counter() - start, time.time()
            after = beats_after(serving, end_wall, client.settings.orphan_timeout / 4 + 5.0)  # final stats
    finally:
        if worker is not None:
            worker.terminate()
            worker.wait(60)
        log.close()
        if server is not None:
            server.close()

    def delta(section: str, key: str) -> float:
        return sum(info[section][key] for info in after) - sum(info[section][key] for info in before)

    busy = delta("engine", "busy_s") / expected
    errors = [r for r in results.values() if not r.ok]
    label = f"d: queue end to end, {expected} workers (--gpus {cfg.gpus})" if cfg.gpus else "d: queue end to end"
    if cfg.backlog:
        label += ", draining a backlog"
    tokens = sum(r.num_tokens or 0 for r in results.values() if r.ok)  # an error result computed nothing
    count = len(prompts) if jobs is None else len(jobs)
    part = PartResult(label, seconds, tokens, count, dir_bytes(out),
                      errors=len(errors), device_idle_share=max(0.0, 1 - busy / seconds))
    if errors:
        part.notes["first_error"] = errors[0].error
    finished = sorted(r.finished_at for r in results.values())
    if len(finished) > 1 and finished[-1] > finished[0]:  # the workers' own pace
        part.notes["jobs_per_s_first_to_last_result"] = round((len(finished) - 1) / (finished[-1] - finished[0]), 1)
    part.notes["jobs_per_s"] = round(count / seconds, 1)
    # where the part's time goes outside the workers' pace: sending, the first result, the wait's return
    part.notes["submit_s"] = round(submitted_s, 3)
    if finished:
        part.notes["first_result_after_s"] = round(finished[0] - start_wall, 3)
        part.notes["returned_after_last_result_s"] = round(end_wall - finished[-1], 3)
    part.notes["batches"] = int(delta("engine", "batches"))
    # the engine thread's time in its batches' runs: wall well above CPU means it waited for the GIL
    part.notes["engine_run_s"] = round(delta("engine", "run_s") / expected, 3)
    part.notes["engine_run_cpu_s"] = round(delta("engine", "run_cpu_s") / expected, 3)
    # the engine thread's wait for a host buffer the writers had not given back yet
    part.notes["engine_buffer_wait_s"] = round(delta("engine", "buffer_wait_s") / expected, 3)
    # the worker processes' CPU per job, every thread: user (Python, torch's host side) and system (writes)
    part.notes["worker_cpu_ms_per_job"] = {kind: round(delta("cpu", f"{kind}_s") / count * 1e3, 3)
                                           for kind in ("user", "system")}
    bundle = Settings().bundle
    part.notes["bundle"] = f"max_jobs={bundle.max_jobs} max_tokens={bundle.max_tokens}" if bundle.max_jobs > 1 \
        else "off"
    return part
