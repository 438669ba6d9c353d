"""Exactness: the engine's files against the naive unbatched HF files, and both against float32."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from layertap.worker.engine.self_check import relative_error_per_layer
from layertap.worker.model.loading import LoadedModel


def compare(naive_dir: Path, engine_paths: list[str], count: int) -> dict[str, Any]:
    """Engine files against the naive unbatched HF files: max abs error and relative (Frobenius)
    error, overall and per layer slot."""
    worst_abs, worst_rel, per_layer = 0.0, 0.0, []
    for index in range(min(count, len(engine_paths))):
        reference = load_file(str(naive_dir / f"{index}.safetensors"))["hidden_states"].float()
        got = load_file(engine_paths[index])["hidden_states"].float()
        worst_abs = max(worst_abs, (got - reference).abs().max().item())
        worst_rel = max(worst_rel, ((got - reference).norm() / reference.norm()).item())
        layer_rel = relative_error_per_layer(got, reference).tolist()
        per_layer = [max(a, b) for a, b in zip(per_layer, layer_rel)] if per_layer else layer_rel
    return {"max_abs_error": worst_abs, "max_relative_error": worst_rel, "relative_error_per_layer": per_layer,
            "prompts_compared": min(count, len(engine_paths))}


def fp32_reference_errors(loaded: LoadedModel, prompts: list[list[int]], layer_ids: list[int], naive_dir: Path,
                          engine_paths: list[str], count: int = 4) -> dict[str, list[float]]:
    """Relative error per layer of the naive bf16 files and of the engine's bf16 files against
    an unbatched float32 HF run of the same weights: how far each is from exact."""
    from transformers import AutoModelForCausalLM

    with torch.device(loaded.device):
        reference = AutoModelForCausalLM.from_config(loaded.model.config, dtype=torch.float32,
                                                     attn_implementation=loaded.native_attention).eval()
    reference.load_state_dict(loaded.model.state_dict())
    decoder_layers = reference.get_decoder().layers
    last: dict[str, torch.Tensor] = {}
    handle = decoder_layers[-1].register_forward_hook(
        lambda m, a, o: last.__setitem__("h", o[0] if isinstance(o, tuple) else o))
    naive_err: list[float] = []
    engine_err: list[float] = []
    try:
        for index in range(min(count, len(engine_paths))):
            with torch.inference_mode():
                out = reference(torch.tensor([prompts[index]], device=loaded.device), output_hidden_states=True,
                                use_cache=False)
            exact = torch.stack([last["h"][0] if i == loaded.num_layers else out.hidden_states[i][0]
                                 for i in layer_ids], 1).float().cpu()
            for errors, path in ((naive_err, naive_dir / f"{index}.safetensors"),
                                 (engine_err, Path(engine_paths[index]))):
                got = load_file(str(path))["hidden_states"].float()
                rel = relative_error_per_layer(got, exact).tolist()
                errors[:] = [max(a, b) for a, b in zip(errors, rel)] if errors else rel
    finally:
        handle.remove()
        del reference
        torch.cuda.empty_cache() if loaded.device.type == "cuda" else None
    return {"naive_bf16_vs_fp32": naive_err, "engine_vs_fp32": engine_err}
