"""What pinning a batch's host buffer costs on the engine thread (why ``worker/host_staging`` pins once).

Times ``torch.empty(n, pin_memory=True)`` for a fresh size, the same size again after the
first is freed (torch's caching host allocator), and a smaller size of the same power-of-two
class; plus the device idle a fresh pinned allocation causes between two queued matmuls.

    python benchmarks/pinned_alloc.py
"""

from __future__ import annotations

import json
import time

import torch

MIB = 1 << 20


def pin_seconds(mib: int, keep: list[torch.Tensor]) -> float:
    """Seconds to allocate ``mib`` MiB of pinned host memory (kept alive in ``keep``)."""
    start = time.perf_counter()
    keep.append(torch.empty(mib * MIB, dtype=torch.uint8, pin_memory=True))
    return time.perf_counter() - start


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    torch.cuda.init()
    torch.empty(1, pin_memory=True)  # the host allocator's own start-up
    report: dict[str, float] = {}
    for mib in (64, 256, 512, 1024):
        buffers: list[torch.Tensor] = []
        report[f"fresh_{mib}MiB_s"] = pin_seconds(mib, buffers)
        buffers.clear()  # back to the cache
        report[f"cached_{mib}MiB_s"] = pin_seconds(mib, buffers)
        report[f"cached_same_class_{mib * 3 // 4}MiB_s"] = pin_seconds(mib * 3 // 4, buffers)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for fresh in (False, True):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            a @ a
        if fresh:
            torch.empty(600 * MIB, dtype=torch.uint8, pin_memory=True)
        else:
            torch.empty(16, dtype=torch.uint8, pin_memory=True)
        for _ in range(20):
            a @ a
        end.record()
        end.synchronize()
        report[f"40_matmuls_with_{'fresh_600MiB' if fresh else 'tiny'}_pin_between_ms"] = start.elapsed_time(end)
    print(json.dumps({"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                      **{k: round(v, 4) for k, v in report.items()}}, indent=1))


if __name__ == "__main__":
    main()
