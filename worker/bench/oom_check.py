"""``python -m layertap.worker.bench.oom_check``: out-of-memory handling on a real GPU, under a memory cap.

Caps the process with ``torch.cuda.set_per_process_memory_fraction`` to the weights plus
a little, sends a token budget far larger than fits, and reports: whether the batch was
split and every job still came back ok, and what a single prompt too large to fit alone
got. Prints one JSON report (recorded in BENCHMARKS.md).
"""

from __future__ import annotations

import json
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from layertap.protocol.layers import eagle3_layer_ids
from layertap.settings import Limits
from layertap.worker.bench.prompts import random_prompts
from layertap.worker.extractor import build_processor
from layertap.worker.model.loading import load_model


def main(shape: str = "shape:qwen3-8b", headroom_gb: float = 6.0) -> dict:
    """Load ``shape`` in bfloat16 on CUDA, cap the process at its weights plus ``headroom_gb``, and return the report:
    48 prompts of 2,048 tokens under a 131,072-token budget, one 131,072-token prompt alone, then one job more.
    Captures EAGLE-3's layers of the shape (2, 18, 33 and 36 for an 8B)."""
    loaded = load_model(shape, name="oom-check", device="cuda", dtype="bfloat16")
    device = loaded.device
    weights = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.empty_cache()
    fraction = (weights + headroom_gb * 1e9) / total
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    out = Path("/dev/shm/layertap-oom")
    processor = build_processor(loaded, storage_root=out, worker_name="oom-check",
                                layers=eagle3_layer_ids(loaded.num_layers), limits=Limits(), token_budget=131072)
    report: dict = {"weights_gb": weights / 1e9, "cap_gb": fraction * total / 1e9, "token_budget": 131072}
    try:
        prompts = random_prompts(48, 2048, 2048, loaded.vocab_size, 7)
        jobs = [{"model": "oom-check", "run": "oom", "job_id": f"j{i}", "token_ids": p} for i, p in enumerate(prompts)]
        with ThreadPoolExecutor(64) as pool:
            results = list(pool.map(processor.process, jobs))
        report["batch"] = {"jobs": len(results), "ok": sum(r.ok for r in results),
                           "oom_splits": processor.engine.stats.oom_splits,
                           "batches_run": processor.engine.stats.batches,
                           "errors": sorted({str(r.error) for r in results if not r.ok})}
        huge = random_prompts(1, 131072, 131072, loaded.vocab_size, 8)[0]
        single = processor.process({"model": "oom-check", "run": "oom", "job_id": "huge", "token_ids": huge})
        report["single_too_large"] = {"status": single.status.value,
                                      "error_type": single.error_type.value if single.error_type else None,
                                      "error": single.error}
        after = processor.process(jobs[0] | {"job_id": "after"})
        report["job_after_that"] = after.status.value
    finally:
        processor.close()
        shutil.rmtree(out, ignore_errors=True)
    return report


if __name__ == "__main__":
    # python -m layertap.worker.bench.oom_check [SHAPE [HEADROOM_GB]]
    print(json.dumps(main(*sys.argv[1:2], *map(float, sys.argv[2:3])), indent=2))
