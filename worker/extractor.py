"""In-process extraction, no Redis: for notebooks and one-off offline runs.

``Extractor(model, layers=[2, 18, -1]).extract(prompts, out_dir)`` runs the same engine,
writes the same files and returns the same :class:`~layertap.protocol.schema.Result` objects as
a queued worker. The Celery task is a thin shell around the same ``JobProcessor``.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from layertap.protocol.images import with_image_digests
from layertap.protocol.layers import eagle3_layer_ids
from layertap.protocol.schema import Job, Result
from layertap.settings import Limits
from layertap.storage.base import Storage
from layertap.storage.registry import storage_for
from layertap.worker.engine.engine import Engine
from layertap.worker.engine.prefix_cache import PrefixCache
from layertap.worker.engine.prefix_keys import batch_bytes, cache_refusal
from layertap.worker.engine.scheduler import MAX_PADDING
from layertap.worker.engine.self_check import (
    check_compiled,
    check_prefix_cache,
    check_prefix_sharing,
    check_with_fallback,
)
from layertap.worker.job.examiners import Examiners
from layertap.worker.job.image_check import check_image_batching
from layertap.worker.job.pipeline import JobProcessor
from layertap.worker.job.reuse import CaptureIndex
from layertap.worker.job.sampling import Sampler, SamplingPlan, worker_facts
from layertap.worker.job.tokenize import Preparer
from layertap.worker.model.loading import LoadedModel, load_model
from layertap.worker.model.modes import use_tower_graphs
from layertap.worker.model.vision.tower_graphs import SIZES as tower_graph_sizes

log = logging.getLogger(__name__)


#: The prefix cache's share of the device memory free at load (torch's cached blocks counted free),
#: where no size is set.
PREFIX_CACHE_SHARE = 0.4
#: ... and its size on the CPU, where no size is set.
PREFIX_CACHE_CPU_BYTES = 1 << 30


def _prefix_cache(engine: Engine, mib: int | None, layers: int) -> PrefixCache | None:
    """The engine's prefix cache of ``mib`` MiB (None: :data:`PREFIX_CACHE_SHARE` of the free device
    memory), or None where the model is not one it serves, or the budget holds fewer than two full
    batches capturing ``layers`` layers (a forward that keeps its keys holds one batch's more while
    it runs: on a card the weights nearly fill, that room is the batch's) (logged: why)."""
    loaded = engine.loaded
    refusal = cache_refusal(loaded.model, loaded.layers, loaded.batching.name, loaded.split is not None)
    if refusal is None:
        if mib is not None:
            budget = mib << 20
        elif loaded.device.type == "cuda":
            free = (torch.cuda.mem_get_info(loaded.device)[0] + torch.cuda.memory_reserved(loaded.device)
                    - torch.cuda.memory_allocated(loaded.device))
            budget = int(free * PREFIX_CACHE_SHARE)
        else:
            budget = PREFIX_CACHE_CPU_BYTES
        batch = batch_bytes(loaded.model, loaded.num_layers, engine.token_budget, layers, loaded.dtype)
        if budget < 2 * batch:
            refusal = (f"{budget >> 20} MiB hold fewer than two full batches ({batch >> 20} MiB each: "
                       "worker.prefix_cache_mib)")
    if refusal is None:
        refusal = check_prefix_cache(engine, budget)
    if refusal is not None:
        log.info("%s: rows are computed whole, not over cached prefixes: %s", loaded.architecture, refusal)
        return None
    log.info("%s: rows are computed past their longest prefix cached on the device (up to %.0f MiB)",
             loaded.architecture, budget / (1 << 20))
    return PrefixCache(budget, lambda tokens, layers: batch_bytes(loaded.model, loaded.num_layers, tokens, layers,
                                                                  loaded.dtype))


def build_processor(loaded: LoadedModel, *, storage_root: str | Path | Storage, worker_name: str,
                    layers: list[int] | None, limits: Limits, token_budget: int, max_batch_jobs: int = 256,
                    batch_wait_s: float = 0.002,
                    max_padding: float = MAX_PADDING,
                    host_buffers: int = 3, writer_threads: int | None = None, prepare_ahead: int = 2,
                    compile_layers: bool = False, images_root: Path | None = None,
                    on_fatal: Callable[[BaseException], None] | None = None,
                    tower_graphs: int = tower_graph_sizes, prefix_sharing: bool = True,
                    prefix_cache_mib: int | None = None,
                    sampling: SamplingPlan | None = None, captures: CaptureIndex | None = None,
                    examine_processes: int | None = None) -> JobProcessor:
    """Engine + tokenizer + writer for one loaded model (shared by the worker and the Extractor);
    files go to ``storage_root`` (a folder, a URL such as ``s3://bucket/prefix``, or a Storage).
    The engine passes the batching self-check first (``layertap.worker.engine.self_check``), falling back
    to slower exact layouts where batching changes the states, or this raises
    :class:`~layertap.worker.model.batching.ModelRefused` and nothing is served; then image chats get
    theirs (``layertap.worker.job.image_check``: one per forward where batched ones differ), and
    a batched grid tower on a GPU its CUDA graphs, for up to ``tower_graphs`` image sizes. With
    ``compile_layers`` the decoder layers are compiled and the check runs again through them
    (``self_check.check_compiled``: eager where they fail it), before the checks that follow. With
    ``prefix_sharing`` (and the load-time prefix check passed), a row that begins with a longer row
    of its batch is sliced from it (``layertap.worker.engine.prefix_share``); with ``prefix_cache_mib``
    (None: 40% of the device memory free at load; 0: off) of device memory, a row computes only
    its tokens past its longest prefix an earlier batch computed, on the models
    ``prefix_keys.cache_refusal`` admits that pass ``self_check.check_prefix_cache``
    (``layertap.worker.engine.prefix_cache``). ``sampling``: the rows
    measured for the runs' certificates (``layertap.worker.job.sampling``;
    None: none); ``captures``: the index jobs are answered from without a forward (``reuse``; None: none);
    ``examine_processes``: helper processes checking files on a local storage (``examiners``;
    None: one per core but one; 0: threads)."""
    preparer = Preparer(loaded, layers if layers is not None else eagle3_layer_ids(loaded.num_layers), limits,
                        images_root)

    def start_engine() -> Engine:
        return Engine(loaded, token_budget=token_budget, max_batch_jobs=max_batch_jobs,
                      batch_wait_s=batch_wait_s, max_padding=max_padding, host_buffers=host_buffers,
                      staging_layers=len(preparer.default_layers), prepare_ahead=prepare_ahead,
                      on_fatal=on_fatal)

    engine, report = check_with_fallback(loaded, start_engine)
    if compile_layers:  # checked again through the compiled code; the checks below run it too
        report = check_compiled(engine, report)
    if prefix_sharing:
        unshared = check_prefix_sharing(engine)
        if unshared:
            log.warning("%s: rows that begin with another row are computed on their own: %s", loaded.architecture,
                        unshared)
        engine.prefix_sharing = unshared is None
    if prefix_cache_mib != 0:
        engine.prefix_cache = _prefix_cache(engine, prefix_cache_mib, len(preparer.default_layers))
    check_image_batching(engine, preparer)
    use_tower_graphs(loaded, tower_graphs)
    if not loaded.compiled and loaded.quant_compute.startswith("fp8") and loaded.device.type == "cuda":
        log.warning("fp8 matmuls without --compile: each activation quantization runs as separate kernels and "
                    "can cost more than the fp8 matmul saves; --compile fuses it into each layer (BENCHMARKS.md)")
    sampler = None
    if sampling is not None:
        sampler = Sampler(engine, worker_name, worker_facts(loaded, report, sampling.every, sampling.minimum),
                          sampling.book, every=sampling.every, minimum=sampling.minimum, within_s=sampling.within_s)
    return JobProcessor(loaded, engine, preparer, storage_for(storage_root), worker_name, writer_threads,
                        self_check=report, sampler=sampler, captures=captures,
                        examiners=Examiners(examine_processes))


class Extractor:
    """Load a model once; extract many inputs in batches; write files; return results."""

    def __init__(self, model: str | LoadedModel, *, layers: list[int] | None = None, device: str = "auto",
                 dtype: str = "auto", name: str | None = None, storage_root: str | Path = "layertap-data",
                 token_budget: int = 16384, concurrency: int = 64, limits: Limits | None = None,
                 batching: str = "auto", batch_wait_ms: float = 2.0, images_root: str | Path | None = None,
                 stages: int = 0, prefix_cache_mib: int | None = None, compile_layers: bool = False):
        """``batch_wait_ms``: how long the engine waits for more jobs before it runs a batch
        that is not full (as the worker's setting). ``images_root``: where image paths in
        chats are read (``settings.images_root``). ``stages``: the model split over layers
        (as the worker's ``split_stages``; 0: one stage per visible GPU for ``device`` ``cuda``).
        ``prefix_cache_mib``: as the worker's setting (None: its default; 0: off). ``compile_layers``:
        as the worker's ``--compile`` (torch.compile the decoder layers, checked again through them)."""
        self.loaded = model if isinstance(model, LoadedModel) else load_model(
            model, name=name, device=device, dtype=dtype, batching=batching, stages=stages,
            token_budget=token_budget, captured_layers=len(layers) if layers else None)
        self.processor = build_processor(self.loaded, storage_root=storage_root,
                                         worker_name=f"in-process-{os.getpid()}@{socket.gethostname()}",
                                         layers=layers, limits=limits or Limits(), token_budget=token_budget,
                                         batch_wait_s=batch_wait_ms / 1000, prefix_cache_mib=prefix_cache_mib,
                                         compile_layers=compile_layers,
                                         images_root=None if images_root is None else Path(images_root))
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="layertap-job")

    @property
    def name(self) -> str:
        return self.loaded.name

    def job(self, item: str | list[int] | Mapping[str, Any] | Job, run: str, **fields: Any) -> dict[str, Any]:
        """Turn an input (prompt text, token ids, chat messages, job fields or Job) into job data;
        image paths in chats get the sha256 of their file under ``images_root``, as the Client
        does (:class:`~layertap.protocol.images.ImageError` for one that cannot be read)."""
        if isinstance(item, Job):
            return item.model_dump(exclude_none=True)
        if isinstance(item, str):
            data: dict[str, Any] = {"prompt": item}
        elif isinstance(item, Mapping):
            data = dict(item)
        elif item and isinstance(item[0], Mapping):
            data = {"messages": list(item)}
        else:
            data = {"token_ids": list(item)}
        return with_image_digests({"model": self.name, "run": run, **fields, **data},
                                  self.processor.preparer.images_root, self.processor.preparer.limits.max_image_bytes)

    def extract(self, inputs: Iterable[str | list[int] | Mapping[str, Any] | Job], out_dir: str | Path | None = None,
                *, run: str = "offline", job_ids: Sequence[str] | None = None, **fields: Any) -> list[Result]:
        """Extract every input; results come back in input order. ``fields`` apply to every job.
        Files are ``<out_dir>/<run>/<fan-out>/<job id>.safetensors``, as a worker writes them: ``run``
        names the folder, ``job_ids`` (one per input, names as for ``Job.job_id``) the files; without
        them a job's id is its own ``job_id`` field, else the hash of its content. Result paths are
        absolute (``out_dir`` is resolved against the working folder now)."""
        processor = self.processor
        out_root = None if out_dir is None else storage_for(out_dir)
        if out_root is not None and out_root.root != processor.storage_root:
            processor = processor.writing_to(out_root)
        jobs = [self.job(item, run, **fields) for item in inputs]
        if job_ids is not None:
            if len(job_ids) != len(jobs):
                raise ValueError(f"{len(job_ids)} job_ids for {len(jobs)} inputs: give one per input")
            jobs = [{**job, "job_id": job_id} for job, job_id in zip(jobs, job_ids)]
        return list(self._pool.map(processor.process, jobs))

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.processor.close()

    def __enter__(self) -> Extractor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
