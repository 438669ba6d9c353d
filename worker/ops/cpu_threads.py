"""How many CPU threads each torch operation of a worker process may use.

A GPU worker runs its model on the device; on the host it prepares chats (image decoding, the
processor's resizing and normalizing, the pinned copy), writes files and issues the device's
work, on several threads at once. torch gives each CPU operation a team of as many threads as the
host has cores, so four preparer threads make four such teams, the host is oversubscribed, and the
engine thread that issues the batch waits for a core: on an H200 host (16 cores) an image batch
took 447 ms instead of 404 while four threads prepared chats beside it, and 406 ms (393 alone) with
one thread per operation, at which the four threads prepared chats no slower (70 chats/s, against 69
at torch's 16; H200, 2026-12-03, BENCHMARKS.md, "Image chats").
vLLM sets one thread per operation for the same reason (``OMP_NUM_THREADS=1`` unless set).

A CPU worker computes its model with those teams: it keeps torch's own count. An explicit
``OMP_NUM_THREADS`` is the operator's choice and is kept on both.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

import torch

log = logging.getLogger(__name__)

#: Threads per CPU operation of a GPU worker left to choose (``worker.cpu_threads`` 0, no OMP_NUM_THREADS).
GPU_WORKER_THREADS = 1


def cpu_threads_for(setting: int, device: torch.device, environ: Mapping[str, str] = os.environ) -> int | None:
    """The threads per CPU operation a worker on ``device`` sets, or None to leave torch's count:
    ``setting`` where it is not 0; else :data:`GPU_WORKER_THREADS` on a GPU unless ``OMP_NUM_THREADS``
    is set; else None (a CPU worker computes with them)."""
    if setting:
        return setting
    if device.type == "cpu" or environ.get("OMP_NUM_THREADS"):
        return None
    return GPU_WORKER_THREADS


def set_cpu_threads(setting: int, device: torch.device) -> int:
    """Apply :func:`cpu_threads_for` to this process; returns the threads per operation in force."""
    threads = cpu_threads_for(setting, device)
    if threads is not None:
        torch.set_num_threads(threads)
    count = torch.get_num_threads()
    log.info("CPU threads per torch operation: %d (worker.cpu_threads %d, device %s, OMP_NUM_THREADS %s)", count,
             setting, device.type, os.environ.get("OMP_NUM_THREADS") or "unset")
    return count
