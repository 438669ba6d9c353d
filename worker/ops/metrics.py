"""Prometheus metrics of one worker process, served on ``--metrics-port`` (0 = not served).

Metrics are always kept (the heartbeat's ``tokens_per_s`` comes from them); the HTTP
endpoint is opt-in. Invariants:

* a job is counted once, when its final result is published (:class:`MetricsSink`):
  retries in between are not results;
* engine counters (tokens, batches, busy seconds) are read from the engine at scrape
  time, so they are never out of step with ``engine.stats``;
* every metric lives in this object's own registry (no global state), named
  ``layertap_*``; constant facts (node, model, device) are labels of ``layertap_worker_info``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from wsgiref.simple_server import WSGIServer

import torch
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    Info,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from layertap.protocol.schema import ErrorType, Result
from layertap.rates import RateWindow
from layertap.storage.base import Storage
from layertap.worker.engine.engine import Engine
from layertap.worker.queue.sinks import ResultSink, SinkContext

log = logging.getLogger(__name__)
TOKEN_RATE_WINDOW_S = 30.0
BATCH_JOBS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
FILL_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
QUEUE_WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 900, 3600, 4 * 3600)
COMPUTE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
WRITE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class EngineCollector(Collector):
    """Engine counters, the current token rate and GPU memory, read when scraped."""

    def __init__(self, engine: Engine, token_rate: RateWindow):
        self.engine = engine
        self.token_rate = token_rate

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.stats
        self.token_rate.add(stats.tokens)
        yield CounterMetricFamily("layertap_tokens", "Tokens computed by the model (all batches).",
                                  value=stats.tokens)
        yield CounterMetricFamily("layertap_tokens_from_batch", "Row tokens served from a longer row of the same "
                                  "batch instead of computed (worker.engine.prefix_share).", value=stats.shared_tokens)
        yield CounterMetricFamily("layertap_tokens_from_cache", "Row tokens taken from a prefix an earlier "
                                  "batch computed instead of computed (worker.engine.prefix_cache).",
                                  value=stats.cached_tokens)
        cache = self.engine.prefix_cache
        yield GaugeMetricFamily("layertap_prefix_cache_bytes", "Device memory held by the prefix cache.",
                                value=0 if cache is None else cache.held_bytes)
        yield CounterMetricFamily("layertap_batches", "Packed batches run.", value=stats.batches)
        yield CounterMetricFamily("layertap_busy_seconds", "Device seconds spent in batches.",
                                  value=self.engine.busy_seconds(wait=False))
        yield CounterMetricFamily("layertap_host_buffer_wait_seconds",
                                  "Seconds the engine waited for a free host buffer with work queued (writers behind).",
                                  value=stats.buffer_wait_s)
        yield CounterMetricFamily("layertap_oom_splits", "Batches split in two after running out of memory.",
                                  value=stats.oom_splits)
        yield GaugeMetricFamily("layertap_tokens_per_second",
                                f"Tokens per second over the last {TOKEN_RATE_WINDOW_S:.0f} s.",
                                value=self.token_rate.rate())
        yield GaugeMetricFamily("layertap_engine_pending_requests", "Requests waiting for a batch.",
                                value=self.engine.pending())
        if self.engine.loaded.device.type == "cuda":
            allocated = GaugeMetricFamily("layertap_gpu_memory_allocated_bytes",
                                          "torch.cuda.memory_allocated per visible GPU.", labels=["gpu"])
            reserved = GaugeMetricFamily("layertap_gpu_memory_reserved_bytes",
                                         "torch.cuda.memory_reserved per visible GPU.", labels=["gpu"])
            for index in range(torch.cuda.device_count()):
                allocated.add_metric([str(index)], torch.cuda.memory_allocated(index))
                reserved.add_metric([str(index)], torch.cuda.memory_reserved(index))
            yield allocated
            yield reserved


class WorkerMetrics:
    """Thread-safe (prometheus-client metrics are). One per worker process."""

    def __init__(self, engine: Engine, info: dict[str, str], storage: Storage):
        """``storage``: where the worker writes (``bytes_written`` is its files' sizes)."""
        self.engine, self.storage = engine, storage
        self.registry = CollectorRegistry()
        self.token_rate = RateWindow(TOKEN_RATE_WINDOW_S)
        self._server: WSGIServer | None = None
        registry = self.registry
        ProcessCollector(registry=registry)
        Info("layertap_worker", "What this worker serves.", registry=registry).info(info)
        self.done = Counter("layertap_jobs_done", "Jobs finished with a file (cached ones included).",
                            registry=registry)
        self.cached = Counter("layertap_jobs_cached", "Jobs answered from a complete file already on disk.",
                              registry=registry)
        self.from_capture = Counter("layertap_jobs_from_capture", "Jobs whose file was written from a file of "
                                    "their capture, with no forward (worker.job.reuse).", registry=registry)
        self.failed = Counter("layertap_jobs_failed", "Jobs finished with an error result, by error type.",
                              ["error_type"], registry=registry)
        for error_type in ErrorType:
            self.failed.labels(error_type.value)
        self.bytes_written = Counter("layertap_bytes_written", "Bytes of files written.", registry=registry)
        self.queue_wait = Histogram("layertap_job_queue_wait_seconds", "Seconds from submit to start.",
                                    buckets=QUEUE_WAIT_BUCKETS, registry=registry)
        self.compute = Histogram("layertap_job_compute_seconds", "Seconds from batch start to states on the host.",
                                 buckets=COMPUTE_BUCKETS, registry=registry)
        self.write = Histogram("layertap_job_write_seconds", "Seconds to write one file (fsync included).",
                               buckets=WRITE_BUCKETS, registry=registry)
        self.batch_fill = Histogram("layertap_batch_fill_ratio", "Tokens per batch / token budget.",
                                    buckets=FILL_BUCKETS, registry=registry)
        self.batch_jobs = Histogram("layertap_batch_jobs", "Jobs per batch.", buckets=BATCH_JOBS_BUCKETS,
                                    registry=registry)
        registry.register(EngineCollector(engine, self.token_rate))

    def observe_batch(self, jobs: int, tokens: int) -> None:
        """Called by the engine after each batch it runs."""
        self.batch_fill.observe(tokens / self.engine.token_budget)
        self.batch_jobs.observe(jobs)

    def observe_result(self, result: Result) -> None:
        """Count one final result (called just before it is published)."""
        if result.ok:
            self.done.inc()
            if result.cached:  # answered by a file already on disk: nothing written
                self.cached.inc()
            elif result.path:  # computed, or written from a file of its capture
                if result.captured_from:
                    self.from_capture.inc()
                try:
                    self.bytes_written.inc(self.storage.size(result.path))
                except Exception:  # removed by hand, or an object store not answering (botocore's own
                    pass           # errors are no OSError): the count is lost, never the publish
        else:
            self.failed.labels((result.error_type or ErrorType.internal).value).inc()
        timings = result.timings
        for histogram, seconds in ((self.queue_wait, timings.queued), (self.compute, timings.compute),
                                   (self.write, timings.write)):
            if seconds is not None:
                histogram.observe(seconds)
        self.token_rate.add(self.engine.stats.tokens)

    def tokens_per_second(self) -> float:
        """The current token rate (also refreshes it)."""
        self.token_rate.add(self.engine.stats.tokens)
        return self.token_rate.rate()

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        """Serve ``/metrics`` on ``addr:port`` from a daemon thread."""
        self._server, _ = start_http_server(port, addr=addr, registry=self.registry)
        log.info("metrics on http://%s:%d/metrics", addr, port)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class MetricsSink(ResultSink):
    """The result sink ``metrics`` (``layertap.worker.queue.sinks``): counts each result just before it
    is published (``before_publish``).

    Invariant: a consumer that has seen a result also sees it in the metrics (counting
    after publishing raced with a scrape made on the result's arrival). A publish that
    fails leaves the job to be redelivered and answered again, so it may count twice.
    """

    def __init__(self, context: SinkContext):
        self.metrics: WorkerMetrics = context.metrics

    def before_publish(self, results: Sequence[Result]) -> None:
        for result in results:
            self.metrics.observe_result(result)
