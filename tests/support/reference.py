"""Reference hidden states from plain ``transformers``, never from layertap's code.

Layer id ``i < L``: ``output_hidden_states[i]``; id ``L``: the last decoder layer's output
caught by a forward hook (HF's own ``hidden_states[L]`` is after the final norm). Models
load with the attention implementation transformers picks for them (SDPA where the model
has it, else its own), one prompt per forward.
"""

from __future__ import annotations

from functools import lru_cache

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


@lru_cache(maxsize=8)
def load(model_dir: str):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError, TypeError):  # a weights-only folder (the architecture sweep)
        tokenizer = None
    return model, tokenizer


def last_layer_module(model, every: bool = False):
    """The last decoder block (``every``: the list of all of them)."""
    for decoder in (model.get_decoder(), model.base_model, getattr(model, "model", None)):
        for name in ("layers", "h", "blocks"):
            layers = getattr(decoder, name, None)
            if layers is not None:
                return layers if every else layers[-1]
    raise AttributeError(f"{type(model).__name__}: no layers, h or blocks found")


def block_input_states(model_dir: str, token_ids: list[int], layer_ids: list[int]) -> torch.Tensor:
    """``[T, len(layer_ids), H]``: the input of each decoder block ``i < L`` and the output of
    the last (id ``L``), caught by hooks on the plain model's blocks. The same convention as
    :func:`reference_states` without relying on ``output_hidden_states`` (which some
    families, such as Mamba, list shifted by one block)."""
    model, _ = load(model_dir)
    return hooked_block_states(last_layer_module(model, every=True), layer_ids,
                               lambda: model(torch.tensor([token_ids]), use_cache=False))


def hooked_block_states(layers, layer_ids: list[int], forward) -> torch.Tensor:
    """``[T, len(layer_ids), H]``: what ``forward()`` (one prompt, no grad) feeds each of
    ``layers`` (id ``i < L``) and what the last one returns (id ``L``), caught by hooks."""
    caught: dict[int, torch.Tensor] = {}

    def pre_hook(index):
        def hook(module, args, kwargs):
            caught[index] = (args[0] if args else kwargs["hidden_states"])[0].clone()
        return hook

    def last_hook(module, args, output):
        caught[len(layers)] = (output[0] if isinstance(output, tuple) else output)[0].clone()

    handles = [layer.register_forward_pre_hook(pre_hook(i), with_kwargs=True) for i, layer in enumerate(layers)]
    handles.append(layers[-1].register_forward_hook(last_hook))
    try:
        with torch.no_grad():
            forward()
    finally:
        for handle in handles:
            handle.remove()
    return torch.stack([caught[i] for i in layer_ids], dim=1)


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
