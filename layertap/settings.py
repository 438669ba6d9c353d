"""Configuration: environment (``LAYERTAP_`` prefix, ``__`` for nested groups), an
optional ``.env`` and an optional ``layertap.toml`` in the working directory.

Precedence: CLI flags > environment > ``.env`` > ``layertap.toml`` > defaults.
Example: ``LAYERTAP_WORKER__TOKEN_BUDGET=32768``.
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Mapping
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, Field, ValidationInfo, field_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from layertap.protocol.certificate import MEASURE_WITHIN_S
from layertap.protocol.dtypes import AUTO, WorkerDtype, normalize_dtype
from layertap.protocol.keys import DEFAULT_CONSUMER_GROUP
from layertap.protocol.naming import MAX_NAME_CHARS, check_printable_name

if TYPE_CHECKING:
    from layertap.storage.base import Storage

DEFAULT_REDIS_URL = "redis://localhost:6379/0"
#: Most characters of ``worker.model``, a folder path or hub id (Linux's PATH_MAX).
MAX_PATH_CHARS = 4096
#: The default hang bound: this much time per batch, plus its tokens at the slowest prefill assumed.
HANG_BASE_S = 60.0
WORST_TOKENS_PER_S = 200.0


class LogFormat(str, Enum):
    """How a worker writes its log lines."""

    text = "text"
    json = "json"  # one JSON object per line, with job_id and run


class WorkerSettings(BaseModel):
    """One worker process: the model it serves and how it batches."""

    model: str | None = None  # local folder or hub id
    served_model_name: str | None = None  # name jobs use; defaults to ``model``
    revision: str | None = None
    trust_remote_code: bool = False
    # default layers; None = EAGLE-3's [2, L//2, L-3, L]; from the environment as "2,18,-1" or "[2, 18, -1]"
    layers: Annotated[list[int] | None, NoDecode] = None
    chat_template: str | None = None  # a Jinja chat template file used instead of the model's (read once)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: WorkerDtype = AUTO  # aliases bf16, fp16, fp32 accepted
    token_budget: int = Field(default=16384, gt=0)  # tokens per batch (padded batches: rows x longest)
    batching: str = "auto"  # auto, or a layout to force (layertap.worker.model.batching.LAYOUTS; checked at load)
    # quantized checkpoints: auto (fp8 matmuls where the device has them, else dequantize layer by layer) |
    # dequant | fp8
    quant_compute: Literal["auto", "dequant", "fp8"] = "auto"
    max_batch_jobs: int = Field(default=256, gt=0)
    batch_wait_ms: float = Field(default=2.0, ge=0)  # wait this long for more jobs before a partial batch
    max_padding: float = Field(default=0.25, ge=0, lt=1)  # padded batches: the largest share of a batch that is padding
    concurrency: int = Field(default=64, gt=0)  # messages in flight per worker (Celery threads; a bundle counts once)
    # files written at once, shared by all messages; None = the cores but one, at least 2, at most 8
    writer_threads: int | None = Field(default=None, gt=0)
    prepare_ahead_batches: int = Field(default=2, ge=0)  # task threads prepare jobs while fewer batches are queued
    host_buffers: int = Field(default=3, gt=0)  # host buffers, pinned once at start: batches between GPU and writers
    compile: bool = False  # torch.compile the decoder layers (GPU; slower start, faster forward)
    # packed attention's kernel on a GPU: flash (aten's FlashAttention 2), cudnn (NVIDIA's cuDNN frontend, the
    # cudnn extra; worker.model.cudnn_attention), or auto: cudnn on Hopper cards where the extra is installed
    attention_kernel: Literal["auto", "flash", "cudnn"] = "auto"
    # a row that begins with a longer row of its batch is sliced from it (after a load-time check)
    prefix_sharing: bool = True
    # device memory (MiB) for earlier batches' keys, values and states: a row computes only its tokens past its
    # longest prefix held there (worker.engine.prefix_cache; tested families, after a load-time check);
    # None = 40% of the device memory free at load (1 GiB on the CPU), 0 = off; out of memory halves it
    prefix_cache_mib: int | None = Field(default=None, ge=0)
    # a run's certificate: 1 in sample_every computed rows (0: none), and the first sample_min of each run, are
    # computed again alone and measured (layertap.worker.job.sampling); a row over its bound fails its run's certificate
    sample_every: int = Field(default=1000, ge=0)
    sample_min: int = Field(default=8, ge=0)
    # seconds a sampled row waits for an idle engine before it is measured between two batches (its result is not held)
    sample_within_s: float = Field(default=MEASURE_WITHIN_S, ge=0)
    # helper processes that check the files already at a call's jobs' names on a local storage before
    # answering from them (a re-run); None = one per core but one (shared out between the workers of a
    # supervisor, --gpus), 0 = threads only (layertap.worker.job.examiners)
    examine_processes: int | None = Field(default=None, ge=0)
    reuse: bool = True  # answer a job from a file of its capture holding its layers, with no forward (worker.job.reuse)
    # image sizes whose grid vision tower (Qwen-VL style) runs as a CUDA graph in batched image forwards (GPU); 0 = off
    tower_graphs: int = Field(default=64, ge=0)  # (layertap.worker.model.vision.tower_graphs.SIZES)
    # torch CPU threads per operation; 0 = 1 on a GPU (its preparers and writers share the host with the
    # thread that issues batches), torch's own on the CPU; OMP_NUM_THREADS, where set, is kept (worker.ops.cpu_threads)
    cpu_threads: int = Field(default=0, ge=0)
    node_name: str | None = None  # Celery node name; default layertap-<pid>@<host>
    gpus: str | None = None  # "all" or "0,1,...": supervise one worker process per GPU (group)
    # GPUs per worker process: one model split over them (layertap.worker.model.split)
    gpus_per_worker: int = Field(default=1, gt=0)
    # stages the model's layers are split into: 0 = one per visible GPU (device "cuda"); more than the GPUs
    # share them (2 on one GPU: the split's own cost), or run in turn on the CPU
    split_stages: int = Field(default=0, ge=0)
    loglevel: str = "INFO"
    log_format: LogFormat = LogFormat.text
    metrics_port: int = Field(default=0, ge=0, le=65535)  # Prometheus /metrics; 0 = off (supervised: +i per child)
    # Where results go besides the run's stream: sink name (layertap.worker.queue.sinks.SINKS) or "module:Class" ->
    # its options; every result a worker publishes passes them. Listing sinks replaces the default.
    result_sinks: dict[str, dict[str, Any]] = Field(default_factory=lambda: {"metrics": {}})
    progress_interval_s: float = Field(default=10.0, ge=0)  # a progress line (tokens/s, jobs/s, queue, memory); 0 = off
    # Seconds jobs may wait on the engine with no batch finished before the worker counts as hung
    # and exits (its jobs go to other workers); None: see hang_bound_s.
    hang_timeout: float | None = Field(default=None, gt=0)
    # Seconds a job whose file cannot be written (read-only or full storage, I/O error) keeps being
    # retried, with backoff, before it is dead-lettered.
    storage_retry_s: float = Field(default=900.0, gt=0)
    # Seconds a warm shutdown (SIGTERM) may take before the worker exits anyway; None: the hang bound + 60 s.
    shutdown_timeout: float | None = Field(default=None, gt=0)

    def hang_bound_s(self, max_tokens: int) -> float:
        """``hang_timeout``, else 60 s plus the longest batch (the larger of ``token_budget`` and the
        longest job, ``max_tokens``) at 200 tokens/s: about 12 minutes for a 131k-token prompt."""
        return self.hang_timeout or HANG_BASE_S + max(self.token_budget, max_tokens) / WORST_TOKENS_PER_S

    def shutdown_deadline_s(self, max_tokens: int) -> float:
        """``shutdown_timeout``, else the hang bound plus a minute for the writes and publishes after it."""
        return self.shutdown_timeout or self.hang_bound_s(max_tokens) + HANG_BASE_S

    @field_validator("model", "served_model_name", "node_name")
    @classmethod
    def _names(cls, value: str | None, info: ValidationInfo) -> str | None:
        """The names that reach queue and heartbeat keys and log lines pass the one name rule
        (``naming.check_printable_name``); ``model`` too, as the served name may be its folder's,
        with a path's length (a served name longer than a job's ``model`` is reached by no job)."""
        if value is None:
            return None
        return check_printable_name(value, f"worker.{info.field_name}",
                                    MAX_PATH_CHARS if info.field_name == "model" else MAX_NAME_CHARS)

    @field_validator("layers", mode="before")
    @classmethod
    def _layers(cls, value: Any) -> Any:
        if isinstance(value, str):
            from layertap.protocol.layers import parse_layer_list

            return json.loads(value) if value.strip().startswith("[") else parse_layer_list(value)
        return value

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype(cls, value: Any) -> Any:
        return normalize_dtype(value)


class Limits(BaseModel):
    """Sizes past which a job is refused with ``invalid_job`` or ``too_long``. The worker applies
    them (``max_job_bytes`` is also checked by the Client before sending); set them where workers run."""

    max_tokens: int = Field(default=131072, gt=0)
    max_turns: int = Field(default=4096, gt=0)
    #: The one byte limit of a job: its compact JSON, every field counted (text, messages, tools,
    #: tool_calls, token ids, metadata), checked before the job is validated, rendered or tokenized.
    max_job_bytes: int = Field(default=8 * 1024 * 1024, gt=0)
    max_topk: int = Field(default=256, gt=0)  # largest ``topk`` a job may ask for
    max_images: int = Field(default=16, ge=0)  # images in one chat
    max_image_bytes: int = Field(default=20 * 1024 * 1024, gt=0)  # bytes of one image (file or data URL)


class TlsSettings(BaseModel):
    """TLS for ``rediss://`` URLs (ignored for ``redis://``)."""

    ca_certs: str | None = None  # CA bundle that signed the server's certificate
    certfile: str | None = None  # client certificate (mutual TLS)
    keyfile: str | None = None
    cert_reqs: str = Field(default="required", pattern="^(required|optional|none)$")


#: When a job stops counting as in flight for ``enqueue.max_inflight``: once it has a final
#: result, or once a streaming consumer acknowledged that result (``layertap.producer.files.streaming``).
InflightUntil = Literal["finished", "consumed"]


class EnqueueSettings(BaseModel):
    """``layertap enqueue``: how a file streams into the queue."""

    max_inflight: int = Field(default=10000, gt=0)  # --max-inflight: jobs of the run submitted but not finished
    #: --inflight-until: a job stops counting at its final result, or once a streaming consumer took it
    inflight_until: InflightUntil = "finished"
    consumer_group: str = DEFAULT_CONSUMER_GROUP  # --consumer-group: whose consumption counts (inflight_until=consumed)


class RetentionSettings(BaseModel):
    """How long Redis keeps what a run no longer needs (applied by the workers, ``layertap.worker.queue.retention``)."""

    results_s: float = Field(default=3600.0, ge=0)  # seconds a result stays on its run's stream; 0: forever
    sweep_interval_s: float = Field(default=300.0, gt=0)  # seconds between retention sweeps


class BundleSettings(BaseModel):
    """How the Client (``Client.bundler``, ``submit_many``, ``layertap enqueue``) groups jobs of one
    model and run into one message; ``Client.submit`` sends its one job at once."""

    max_jobs: int = Field(default=64, gt=0)  # jobs per bundle message; 1 sends every job in its own message
    max_tokens: int = Field(default=32768, gt=0)  # estimated tokens per bundle (``Job.estimated_tokens``)
    max_wait_s: float = Field(default=0.05, gt=0)  # the longest a job waits in a bundle (full: till the next job)


class Settings(BaseSettings):
    """Everything layertap reads from its environment."""

    model_config = SettingsConfigDict(
        env_prefix="LAYERTAP_",
        env_nested_delimiter="__",
        env_file=".env",
        toml_file="layertap.toml",
        extra="ignore",
    )

    redis_url: str | None = None  # None: localhost for worker/client, an embedded server for the demo
    # a send returns once this many replicas hold its message (WAIT, as long as it takes: see
    # layertap.transport.broker_transport); None: 1 with a sentinel:// URL, else 0
    redis_wait_replicas: int | None = Field(default=None, ge=0)
    # where files go: a folder (made absolute by the worker) or an object store URL (s3://bucket/prefix)
    storage_root: str = "layertap-data"
    # the object store's fsspec options (JSON in LAYERTAP_STORAGE_OPTIONS): endpoint_url, key, secret, ...;
    # without them credentials and endpoint come from the standard places (AWS_* variables, ~/.aws)
    storage_options: dict[str, Any] = Field(default_factory=dict)
    # other roots whose files readers (trainers, manifest, export) take from results, besides storage_root (JSON
    # list in LAYERTAP_READ_ROOTS): a result names its file, it never chooses where readers look
    read_roots: list[str] = Field(default_factory=list)
    images_root: Path | None = None  # image paths in chats are read under it (client and worker), nowhere else
    orphan_timeout: float = Field(default=60.0, gt=0)  # seconds until a dead worker's jobs are requeued
    max_attempts: int = Field(default=3, gt=0)  # starts of one job before it is dead-lettered
    # seconds a client (submit, enqueue) waits out a Redis that is away or refuses writes (maxmemory, READONLY)
    redis_wait_s: float = Field(default=3600.0, gt=0)
    result_backend: bool = False  # also store each task's result in Celery's backend (AsyncResult), for result_ttl
    result_ttl: int = Field(default=3600, gt=0)  # seconds Celery's backend keeps a result (with result_backend)
    worker: WorkerSettings = Field(default_factory=WorkerSettings)
    limits: Limits = Field(default_factory=Limits)
    tls: TlsSettings = Field(default_factory=TlsSettings)
    enqueue: EnqueueSettings = Field(default_factory=EnqueueSettings)
    retention: RetentionSettings = Field(default_factory=RetentionSettings)
    bundle: BundleSettings = Field(default_factory=BundleSettings)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        toml = TomlConfigSettingsSource(settings_cls)
        return (init_settings, env_settings, dotenv_settings, toml, file_secret_settings)

    @field_validator("storage_root", mode="before")
    @classmethod
    def _storage_root(cls, value: Any) -> Any:
        return str(value) if isinstance(value, os.PathLike) else value

    def storage(self) -> Storage:
        """The storage ``storage_root`` names (``layertap.storage.registry``)."""
        from layertap.storage.registry import storage_for

        return storage_for(self.storage_root, self.storage_options)

    def reading_storages(self) -> list[Storage]:
        """The storages a reader takes result files from: ``storage_root``'s, then ``read_roots``'."""
        from layertap.storage.registry import storage_for

        return [self.storage(), *(storage_for(root, self.storage_options) for root in self.read_roots)]

    @property
    def broker_url(self) -> str:
        return self.redis_url or DEFAULT_REDIS_URL


#: ``LAYERTAP_*`` variables that are not settings: ``LAYERTAP_DEBUG`` (tracebacks) and the ones
#: ``compose.yaml`` interpolates.
OTHER_VARIABLES = {"LAYERTAP_DEBUG", "LAYERTAP_MODEL", "LAYERTAP_MODEL_NAME", "LAYERTAP_HOST"}


def setting_paths() -> set[str]:
    """Every setting's dotted name (``redis_url``, ``worker.layers``, ...) and every group's (``worker``)."""
    paths: set[str] = set()
    for name, field in Settings.model_fields.items():
        paths.add(name)
        group = field.annotation if isinstance(field.annotation, type) else None
        if group is not None and issubclass(group, BaseModel):
            paths.update(f"{name}.{sub}" for sub in group.model_fields)
    return paths


def _unknown(path: str, known: set[str], spell: Any) -> str:
    close = difflib.get_close_matches(path, sorted(known), n=1, cutoff=0.75)
    return " (did you mean " + spell(close[0]) + "?)" if close else ""


def unknown_settings(environ: Mapping[str, str] | None = None,
                     toml_path: str | Path = "layertap.toml") -> list[str]:
    """One warning per ``LAYERTAP_*`` variable and ``layertap.toml`` key that is no setting (a typo
    would otherwise be ignored silently)."""
    known = setting_paths()
    warnings = []
    for name in sorted(os.environ if environ is None else environ):
        upper = name.upper()
        if not upper.startswith("LAYERTAP_") or upper in OTHER_VARIABLES:
            continue
        path = upper.removeprefix("LAYERTAP_").lower().replace("__", ".")
        if path not in known:
            hint = _unknown(path, known, lambda found: "LAYERTAP_" + found.upper().replace(".", "__"))
            warnings.append(f"{name} is not a layertap setting{hint}; it is ignored")
    toml_file = Path(toml_path)
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: the file is not checked
        return warnings
    if toml_file.is_file():
        try:
            data = tomllib.loads(toml_file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            return [*warnings, f"{toml_file}: cannot be read ({exc})"]
        for key, value in data.items():
            paths = [f"{key}.{sub}" for sub in value] if isinstance(value, dict) and key in known else [key]
            for path in paths:
                if path not in known:
                    warnings.append(f"{toml_file}: {path} is not a layertap setting"
                                    f"{_unknown(path, known, str)}; it is ignored")
    return warnings
