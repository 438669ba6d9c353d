"""Reference hidden states from plain ``transformers``, never from layertap's code.

Layer id ``i < L``: ``output_hidden_states[i]``; id ``L``: the last decoder layer's output
caught by a forward hook (HF's own ``hidden_states[L]`` is after the final norm). Models
load with the attention implementation transformers picks for them (SDPA where the model
has it, else its own) and never the ``kernels`` library's hub layers, one prompt per forward.
"""

from __future__ import annotations

from functools import lru_cache

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


@lru_cache(maxsize=8)
def load(model_dir: str, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """The plain model (on ``device``, in ``dtype``) and its tokenizer (None for a weights-only folder)."""
    # the model's own torch code: transformers 5.25 would swap in hub kernels on CUDA (use_kernels)
    placement = {"use_kernels": False, **({} if device == "cpu" else {"device_map": device})}
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **placement).eval()
    except ValueError as exc:  # a part with no SDPA (Gemma 4's audio tower): transformers' eager attention
        if "does not support an attention implementation" not in str(exc):
            raise
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager",
                                                     **placement).eval()
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError, TypeError, ImportError):  # a weights-only folder (the architecture sweep)
        tokenizer = None
    return model, tokenizer


def last_layer_module(model, every: bool = False):
    """The last decoder block (``every``: the list of all of them)."""
    for decoder in (model.get_decoder(), model.base_model, getattr(model, "model", None),
                    getattr(model.base_model, "encoder", None)):
        for name in ("layers", "h", "blocks", "layer"):
            layers = getattr(decoder, name, None)
            if isinstance(layers, torch.nn.ModuleList):
                return layers if every else layers[-1]
    raise AttributeError(f"{type(model).__name__}: no layers, h, blocks or layer found")


def block_input_states(model_dir: str, token_ids: list[int], layer_ids: list[int], *,
                       dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.Tensor:
    """``[T, len(layer_ids), ...]``: the input of each decoder block ``i < L`` and the output of
    the last (id ``L``), caught by hooks on the plain model's blocks (run in ``dtype`` on ``device``;
    the states stay there). The same convention as :func:`reference_states` without relying on
    ``output_hidden_states`` (which some families, such as Mamba, list shifted by one block)."""
    model, _ = load(model_dir, dtype, device)
    return hooked_block_states(last_layer_module(model, every=True), layer_ids, len(token_ids),
                               lambda: model(torch.tensor([token_ids], device=device), use_cache=False))


def hooked_block_states(layers, layer_ids: list[int], tokens: int, forward) -> torch.Tensor:
    """``[T, len(layer_ids), ...]``: what ``forward()`` (one prompt of ``tokens`` tokens, no grad)
    feeds each of ``layers`` (id ``i < L``) and what the last one returns (id ``L``), caught by hooks."""
    caught: dict[int, torch.Tensor] = {}

    def token_major(hidden):
        """The one prompt's stream, tokens first: ``[1, T, ...]``, or AltUp's ``[copies, 1, T, H]``."""
        return (hidden[0] if hidden.shape[1] == tokens else hidden[:, 0].movedim(0, 1)).clone()

    def pre_hook(index):
        def hook(module, args, kwargs):
            caught[index] = token_major(args[0] if args else kwargs["hidden_states"])
        return hook

    def last_hook(module, args, output):
        caught[len(layers)] = token_major(output[0] if isinstance(output, (tuple, list)) else output)

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
    caught: dict[str, torch.Tensor] = {}

    def hook(module, args, output):
        caught["last"] = output[0] if isinstance(output, (tuple, list)) else output

    handle = last_layer_module(model).register_forward_hook(hook)
    try:
        with torch.no_grad():
            out = model(torch.tensor([token_ids]), output_hidden_states=True, use_cache=False)
    finally:
        handle.remove()
    num_layers = len(out.hidden_states) - 1  # transformers' own count of blocks (not always num_hidden_layers)
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
