"""The bench's settings, its per-part record, and the storage folder it owns."""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from layertap.protocol.naming import SHAPE_PREFIX
from layertap.settings import WorkerSettings

PARTS = ("a", "b", "c", "d")  # the default; "p" is asked for by name


@dataclass
class BenchConfig:
    """The settings of one ``layertap bench``, one per flag (``quant_compute`` and ``seed`` have none)."""

    model: str = "shape:qwen3-8b"
    device: str = "auto"
    dtype: str = "auto"
    layers: list[int] | None = None  # None: EAGLE-3's [2, L//2, L-3, L] of the loaded model
    prompts: int = 128
    min_len: int = 128
    max_len: int = 2047
    file: str | None = None
    storage: str = "/dev/shm/layertap-bench"
    token_budget: int = 16384
    max_padding: float = WorkerSettings().max_padding  # padded batches (b, c, d)
    parts: tuple[str, ...] = PARTS
    redis_url: str | None = None
    seed: int = 0
    concurrency: int = 64
    memory_check: bool = False
    compile: bool = False
    gpus: str | None = None  # for (d): start `layertap worker --gpus ...` (one worker per GPU)
    backlog: bool = False  # for (d): enqueue every job before the worker starts, then time the drain
    quant_compute: str = "auto"  # quantized checkpoints: auto | dequant | fp8 (the worker of (d) too)
    split_stages: int = 1  # the model's layers in this many stages (b, c and the worker of d; 0: one per GPU)
    gpus_per_worker: int = 1  # for (d) with gpus: one worker per group of this many GPUs, the model split over them


@dataclass
class PartResult:
    """One part's measurement, as ``parts`` and ``queue_part`` return it; :meth:`fill_rates` adds its rates. The
    report holds it under ``parts``."""

    name: str
    seconds: float
    tokens: int
    jobs: int
    bytes_written: int = 0
    tokens_per_s: float = 0.0
    gb_per_s: float = 0.0
    mfu: float | None = None
    device_idle_share: float | None = None
    peak_memory_gb: float | None = None
    errors: int = 0
    notes: dict[str, Any] = field(default_factory=dict)

    def fill_rates(self, flops: float | None = None, matmul_rate: float = 0.0) -> None:
        """Set the rates from the counts: tokens/s and GB/s written; with the part's useful ``flops``
        and a measured ``matmul_rate`` (FLOP/s), its MFU (none without a rate)."""
        self.tokens_per_s = self.tokens / self.seconds
        self.gb_per_s = self.bytes_written / self.seconds / 1e9
        self.mfu = flops / self.seconds / matmul_rate if flops is not None and matmul_rate > 0 else None


#: A file the bench leaves in its storage folder: the folder is the bench's to empty.
BENCH_MARKER = ".layertap-bench"
#: The largest random-weight shape benched on a CPU (qwen3-8b, 8.2B, would need 33 GB of float32 weights).
CPU_SHAPE_MAX_PARAMETERS = 1_000_000_000


def check_shape_fits(model: str, device_type: str) -> None:
    """Refuse, before anything is built, a random-weight shape too big for a CPU bench."""
    from layertap.worker.model.shapes import is_shape, shape_parameters

    if device_type != "cpu" or not is_shape(model):
        return
    parameters = shape_parameters(model.removeprefix(SHAPE_PREFIX))
    if parameters > CPU_SHAPE_MAX_PARAMETERS:
        raise ValueError(f"--model {model} has {parameters / 1e9:.1f}B parameters ({parameters * 4 / 1e9:.0f} GB of "
                         "float32 weights): too big for a CPU bench; use --model shape:qwen3-tiny on a CPU, "
                         "or --device cuda")


def claim_storage(storage: Path) -> None:
    """Make ``storage`` the bench's folder: new, empty, or made by an earlier bench (it has
    :data:`BENCH_MARKER`). A folder holding anything else is refused, never emptied."""
    if storage.exists() and any(storage.iterdir()) and not (storage / BENCH_MARKER).exists():
        raise ValueError(f"--storage {storage} is not empty and was not made by layertap bench; "
                         "give a new or empty folder (the bench deletes what it writes there)")
    storage.mkdir(parents=True, exist_ok=True)
    (storage / BENCH_MARKER).touch()
    for name in ("a", "c", "d"):  # an interrupted earlier bench's files
        shutil.rmtree(storage / name, ignore_errors=True)
