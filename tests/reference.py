"""Reference hidden states from plain ``transformers``, never from layertap's code.

Layer id ``i < L``: ``output_hidden_states[i]``; id ``L``: the last decoder layer's output
caught by a forward hook (HF's own ``hidden_states[L]`` is after the final norm).
"""

from __future__ import annotations

from functools import lru_cache

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


@lru_cache(maxsize=8)
def load(model_dir: str):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


def last_layer_module(model) -> torch.nn.Module:
    decoder = model.get_decoder()
    layers = getattr(decoder, "layers", None) or getattr(decoder, "h")
    return layers[-1]


def reference_states(model_dir: str, token_ids: list[int], layer_ids: list[int]) -> torch.Tensor:
    """``[T, len(layer_ids), H]`` for resolved (non-negative) ``layer_ids``."""
    model, _ = load(model_dir)
    num_layers = model.config.num_hidden_layers
    caught: dict[str, torch.Tensor] = {}

    def hook(module, args, output):
        caught["last"] = output[0] if isinstance(output, tuple) else output

    handle = last_layer_module(model).register_forward_hook(hook)
    try:
        with torch.no_grad():
            out = model(torch.tensor([token_ids]), output_hidden_states=True, use_cache=False)
    finally:
        handle.remove()
    picked = [caught["last"][0] if i == num_layers else out.hidden_states[i][0] for i in layer_ids]
    return torch.stack(picked, dim=1)


def final_norm_states(model_dir: str, token_ids: list[int]) -> torch.Tensor:
    """HF's ``hidden_states[-1]`` (after the final norm)."""
    model, _ = load(model_dir)
    with torch.no_grad():
        out = model(torch.tensor([token_ids]), output_hidden_states=True, use_cache=False)
    return out.hidden_states[-1][0]


def teacher_logprobs(model_dir: str, token_ids: list[int]) -> torch.Tensor:
    """``log_softmax`` of HF's float32 ``logits`` ``[T, vocab]``: row ``t`` is the distribution of token ``t + 1``."""
    model, _ = load(model_dir)
    with torch.no_grad():
        logits = model(torch.tensor([token_ids]), use_cache=False).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)
