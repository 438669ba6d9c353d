"""``python -m layertap.worker.bench.fp8_error``: float8 reconstruction error on real activations, per layer.

Each model extracts the demo's 16 prompts and chats (``producer/data/demo_jobs.jsonl``)
with every layer and ``final_hidden_states`` twice through the in-process pipeline
(engine -> file -> ``load_hidden_states``): in the model's dtype, and as float8 (e4m3,
one scale per row). The decoded float8 values are compared with the first, per layer,
over all tokens. The bound checked is the one ``layertap.protocol.fp8`` states and the tests assert:
``|x' - x| <= 2**-4 |x| + 2**-10 s`` per element (``s`` = the row's scale).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Optional

import torch
import typer

from layertap.producer.dev.demo_data import demo_jobs
from layertap.producer.files.reader import load_hidden_states
from layertap.worker.extractor import Extractor
from layertap.worker.model.tiny_model import make_tiny_model

RELATIVE_BOUND = 2.0**-4
SUBNORMAL_BOUND = 2.0**-10
COLUMNS = ("model", "layer", "rel. Frobenius", "worst row rel.", "max abs err", "max abs x", "max err / max x",
           "bound held")


def layer_errors(exact: torch.Tensor, decoded: torch.Tensor, scale: torch.Tensor) -> dict[str, Any]:
    """Errors of ``decoded`` ``[N, H]`` against ``exact``, with the rows' float8 ``scale`` ``[N]``."""
    exact, decoded = exact.float(), decoded.float()
    error = decoded - exact
    row_rel = error.norm(dim=1) / exact.norm(dim=1).clamp_min(torch.finfo(torch.float32).tiny)
    bound = RELATIVE_BOUND * exact.abs() + SUBNORMAL_BOUND * scale[:, None]
    return {"rel_frobenius": (error.norm() / exact.norm()).item(), "worst_row_rel": row_rel.max().item(),
            "max_abs_err": error.abs().max().item(), "max_abs_x": exact.abs().max().item(),
            "bound_held": bool((error.abs() <= bound).all())}


def measure(model_dir: str, device: str, work: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Per-layer errors of one model (layer ids, then ``final``) and a description of the run."""
    jobs = demo_jobs()
    with Extractor(model_dir, device=device, storage_root=work) as extractor:
        layers = list(range(extractor.loaded.num_layers + 1))
        fields = {"layers": layers, "final_hidden_states": True}
        exact = extractor.extract(jobs, work / "exact", run="exact", **fields)
        quantized = extractor.extract(jobs, work / "fp8", run="fp8", dtype="float8", **fields)
        info = {"tokens": sum(r.num_tokens or 0 for r in exact), "dtype": str(extractor.loaded.dtype),
                "device": str(extractor.loaded.device), "hidden": extractor.loaded.hidden_size}
    failed = [r for r in [*exact, *quantized] if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} jobs failed, e.g. {failed[0].error_type}: {failed[0].error}")
    exact_files = [load_hidden_states(r.path) for r in exact]
    raw_files = [load_hidden_states(r.path, dequantize=False) for r in quantized]
    decoded_files = [load_hidden_states(r.path) for r in quantized]

    def stacked(files: list[dict[str, torch.Tensor]], name: str, slot: int | None) -> torch.Tensor:
        return torch.cat([f[name] if slot is None else f[name][:, slot] for f in files])

    rows = []
    for slot, layer in [*enumerate(layers), (None, "final")]:
        name = "hidden_states" if slot is not None else "final_hidden_states"
        errors = layer_errors(stacked(exact_files, name, slot), stacked(decoded_files, name, slot),
                              stacked(raw_files, f"{name}_scale", slot))
        rows.append({"layer": layer, **errors})
    return rows, info


def markdown(results: dict[str, tuple[list[dict[str, Any]], dict[str, Any]]], command: str) -> str:
    """The Markdown report: command, inputs and caveats, one line per model, then a table row per model and layer."""
    lines = ["# float8 (e4m3, per-row scale) reconstruction error", "", f"Command: `{command}`", "",
             "Inputs: the demo's 16 prompts and chats, every layer id (vLLM convention: 0 = embeddings output, "
             "L = last layer before the final norm) and `final` (after the final norm). Reference: the same "
             "pipeline's output in the model's dtype. `bound held`: every element within "
             "`2**-4 |x| + 2**-10 s` (s = the row's scale).", "",
             "The tiny models have random weights, so their activations have no outlier channels. In trained "
             "LLMs a few channels can be 100-1000x the rest; the per-element bound still holds, but the small "
             "elements of such a row sit near e4m3's subnormal range (below `2**-6 s`) and keep less relative "
             "precision. Measure a real checkpoint with `--model DIR` before relying on these numbers.", ""]
    for model, (_, info) in results.items():
        lines.append(f"- `{model}`: {info['tokens']} tokens, hidden size {info['hidden']}, {info['dtype']} on "
                     f"{info['device']}")
    lines += ["", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for model, (rows, _) in results.items():
        for row in rows:
            lines.append(f"| {model} | {row['layer']} | {row['rel_frobenius']:.4f} | {row['worst_row_rel']:.4f} | "
                         f"{row['max_abs_err']:.3g} | {row['max_abs_x']:.3g} | "
                         f"{row['max_abs_err'] / row['max_abs_x']:.4f} | {'yes' if row['bound_held'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def main(
    tiny: str = typer.Option("qwen3,llama,gpt2", help="Tiny architectures to build (4 layers, hidden 64, seed 0)."),
    model: Optional[list[str]] = typer.Option(None, "--model", help="Also measure this model folder (repeatable)."),
    device: str = typer.Option("auto", help="auto | cpu | cuda"),
    out: Optional[Path] = typer.Option(None, help="Write the Markdown report here (else print it)."),
) -> None:
    """Measure and report the float8 round-trip error per layer."""
    import sys

    results = {}
    with tempfile.TemporaryDirectory(prefix="layertap-fp8-") as tmp:
        work = Path(tmp)
        sources = {f"tiny-{arch}": str(make_tiny_model(work / "models" / arch, arch))
                   for arch in tiny.split(",") if arch}
        sources.update({path: path for path in model or []})
        for name, source in sources.items():
            results[name] = measure(source, device, work / "runs" / name.replace("/", "_"))
    report = markdown(results, "python -m layertap.worker.bench.fp8_error " + " ".join(sys.argv[1:]))
    if out is None:
        print(report)
    else:
        out.write_text(report)


if __name__ == "__main__":
    typer.run(main)
