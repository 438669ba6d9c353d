"""Finding a loaded model's parts: its text decoder, the list of its decoder blocks, its final
norm, its experts implementation and its weights' bytes.

Decoder layers are found structurally (the ``nn.ModuleList`` of ``num_hidden_layers``
blocks inside the text decoder, alike or not: hybrids such as Jamba mix block classes),
so Llama, Qwen, Mistral, Gemma, Phi, GPT-2/NeoX-style, hybrid and multimodal wrappers
work without a table of attribute paths; a vision-language model's text decoder is the
innermost ``get_decoder()``.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from layertap.worker.model.batching import ModelRefused

FINAL_NORM_NAMES = ("norm", "ln_f", "final_layernorm", "final_layer_norm", "norm_f", "final_norm")


def text_decoder(model: nn.Module) -> nn.Module:
    """The innermost text decoder: ``get_decoder()`` followed down (a vision-language model's
    returns its language model, which may itself be a causal LM wrapping the decoder, as
    Llama 4's is), else ``base_model``."""
    current: nn.Module = model
    while hasattr(current, "get_decoder"):
        inner = current.get_decoder()
        if not isinstance(inner, nn.Module) or inner is current:
            break
        current = inner
    return current if current is not model else getattr(model, "base_model", model)


def find_decoder_layers(model: nn.Module, num_layers: int) -> tuple[nn.Module, nn.ModuleList]:
    """Return ``(decoder, layers)``: the text decoder module and its list of ``num_layers``
    blocks (the shallowest such list with weights in every block; the blocks may differ in
    class, as in hybrids). Raises :class:`ModelRefused` when there is none."""
    decoder = text_decoder(model)
    base = getattr(model, "base_model", model)
    # the innermost get_decoder() is the text decoder, unless a model names another part so (ModernBERT-decoder's
    # output Linear): then its base model is searched
    scopes = [(decoder, decoder), (base, base), (model, base)]
    for scope, runs in scopes:
        candidates = [
            (name, module) for name, module in scope.named_modules()
            if isinstance(module, nn.ModuleList) and len(module) == num_layers
            and all(any(True for _ in block.parameters()) for block in module)
        ]
        if candidates:
            _, layers = min(candidates, key=lambda item: item[0].count("."))
            return runs, layers
    recorded = _recorded_block_lists(model)
    if len(recorded) == 1:  # num_hidden_layers counts something else (passes of a looped model, say)
        return scopes[0][1], recorded[0]
    if recorded:
        raise ModelRefused(type(model).__name__, f"its decoder blocks sit in {len(recorded)} separate lists (run in "
                           "turn or in cycles), which one list of layer ids cannot name")
    raise ModelRefused(type(model).__name__, f"no list of its {num_layers} decoder blocks (num_hidden_layers in "
                       "its config) found, so its layers cannot be read")


def _recorded_block_lists(model: nn.Module) -> list[nn.ModuleList]:
    """The module lists of the blocks whose outputs transformers records as the model's hidden
    states (its ``_can_record_outputs``), outermost first."""
    found: list[nn.ModuleList] = []
    for part in (model, getattr(model, "base_model", None)):
        recorder = (getattr(part, "_can_record_outputs", None) or {}).get("hidden_states")
        block_class = getattr(recorder, "target_class", recorder)  # a class, or a tuple of them
        if isinstance(block_class, type) or (isinstance(block_class, tuple) and block_class):
            found = [module for module in model.modules() if isinstance(module, nn.ModuleList) and len(module)
                     and all(isinstance(block, block_class) for block in module)]
            break
    return found


def block_count(model: nn.Module, config: Any) -> int | None:
    """How many decoder blocks the model has: ``num_hidden_layers``, unless the model's own record
    of its hidden states counts blocks by another field (LongCat-Flash: two attention sublayers per
    block, so ``num_hidden_layers`` is twice its blocks)."""
    for part in (model, getattr(model, "base_model", None)):
        recorder = (getattr(part, "_can_record_outputs", None) or {}).get("hidden_states")
        key = getattr(recorder, "num_hidden_layers_key", None)
        if key and isinstance(getattr(config, key, None), int):
            return getattr(config, key)
    return getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None)


def find_final_norm(decoder: nn.Module) -> nn.Module | None:
    """The norm applied after the last decoder layer, if the decoder has one of the usual names."""
    for attr in FINAL_NORM_NAMES:
        module = getattr(decoder, attr, None)
        if isinstance(module, nn.Module):
            return module
    return None


def experts_implementation(model: nn.Module) -> str | None:
    """transformers' experts implementation the model runs (it picks ``grouped_mm`` where the kernel
    dispatches, else ``eager``, which loops over the experts chosen); None for a model without experts."""
    if not any(type(module).__name__.endswith("Experts") for module in model.modules()):
        return None
    return str(getattr(model.config.get_text_config(), "_experts_implementation", None) or "eager")


def weights_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers as they sit on the device."""
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
