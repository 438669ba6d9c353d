"""The bench report's machine and software lines, and its markdown table."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch


def device_name() -> str:
    """The report's device: GPU 0's name, else ``CPU <processor> x<logical CPUs>``."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    import platform

    return f"CPU {platform.processor() or platform.machine()} x{os.cpu_count()}"


def software_versions() -> dict[str, str]:
    """The report's library versions: Python, torch, transformers, safetensors, celery and CUDA (``none`` without)."""
    import celery
    import safetensors
    import transformers

    return {"python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__,
            "safetensors": safetensors.__version__, "celery": celery.__version__,
            "cuda": torch.version.cuda or "none"}


def format_flops(rate: float) -> str:
    """A FLOP/s figure in the unit that shows it (a CPU's is GFLOP/s, not "0.0 TFLOP/s")."""
    if rate <= 0:
        return "unknown FLOP/s"
    return f"{rate / 1e12:.1f} TFLOP/s" if rate >= 1e12 else f"{rate / 1e9:.1f} GFLOP/s"


def format_table(report: dict[str, Any]) -> str:
    """A markdown table of the parts, then ratios and notes."""
    lines = ["| part | tokens/s | GB/s written | MFU | device idle | seconds | errors |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for part in report["parts"].values():
        idle = "" if part["device_idle_share"] is None else f"{part['device_idle_share']:.1%}"
        mfu = "-" if part["mfu"] is None else f"{part['mfu']:.1%}"
        lines.append(f"| {part['name']} | {part['tokens_per_s']:,.0f} | {part['gb_per_s']:.2f} | {mfu} | "
                     f"{idle} | {part['seconds']:.2f} | {part['errors']} |")
    for part in report["parts"].values():
        if "jobs_per_s" in part["notes"]:
            lines.append(f"{part['name']}: {part['notes']['jobs_per_s']} jobs/s over the whole part, "
                         f"{part['notes'].get('jobs_per_s_first_to_last_result')} jobs/s first to last result")
    lines.append("")
    lines.append("ratios: " + ", ".join(f"{k} = {v:.2f}" for k, v in report["ratios"].items()))
    if report.get("exactness_vs_unbatched_hf"):
        e = report["exactness_vs_unbatched_hf"]
        per_layer = ", ".join(f"{layer}: {err:.2g}"
                              for layer, err in zip(report["layer_ids"], e["relative_error_per_layer"]))
        lines.append(f"engine vs unbatched HF ({e['prompts_compared']} prompts): "
                     f"max abs error {e['max_abs_error']:.3g}, "
                     f"max relative error {e['max_relative_error']:.3g}; per layer {per_layer}")
        for key in ("naive_bf16_vs_fp32", "engine_vs_fp32"):
            if key in e:
                lines.append(f"{key} relative error per layer: "
                             + ", ".join(f"{layer}: {err:.2g}" for layer, err in zip(report["layer_ids"], e[key])))
    if report.get("memory"):
        lines.append("memory: " + json.dumps(report["memory"]))
    return "\n".join(lines)
