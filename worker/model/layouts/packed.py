"""Packed: every prompt of a batch in one row, positions restarting at each prompt, attention
told the boundaries (``layertap.worker.model.attention``). No padding. Exact only where *every* token
mixer is attention through transformers' attention interface that needs no feature packed
attention lacks (sinks, logit softcapping, ALiBi, chunked masks, a mask the model builds itself). The
scheduler's cost is the sum of the lengths: later jobs fill the gaps, first fit, in arrival order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn
from transformers import PreTrainedModel

from layertap.worker.model.attention import ATTENTION_NAME, packed_sequences
from layertap.worker.model.layouts.base import BatchInputs, BatchLayout, BatchLimits, bounds_of, to_device
from layertap.worker.model.layouts.padded import key_selection

#: ``config.layer_types`` entries that are attention (transformers' own vocabulary).
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention", "attention"})
#: ``config.layer_types`` entries that mix no tokens at all (Nemotron-H's MLP-only blocks).
MIXERLESS_LAYER_TYPES = frozenset({"mlp", "moe"})


def stateful_mixers(model: nn.Module, layers: nn.ModuleList) -> list[str]:
    """Token mixers in the decoder blocks that carry state along a row (so packing would leak
    one prompt into the next): the blocks' config types that are not attention, and any
    ``nn.Conv1d`` (the causal convolutions of Mamba, gated delta nets, short-conv and RG-LRU
    blocks). Returns short descriptions, empty when there are none."""
    found: list[str] = []
    config = model.config.get_text_config()
    layer_types = getattr(config, "layer_types", None) or []
    others = sorted({str(kind) for kind in layer_types if kind not in ATTENTION_LAYER_TYPES | MIXERLESS_LAYER_TYPES})
    if others:
        found.append("layer types " + ", ".join(others))
    convolutions = sorted({type(parent).__name__ for block in layers for parent in block.modules()
                           if any(isinstance(child, nn.Conv1d) for child in parent.children())})
    if convolutions:
        found.append("causal convolutions in " + ", ".join(convolutions))
    return found


def attention_features(model: nn.Module) -> list[str]:
    """Attention features that packed attention does not do."""
    config = model.config.get_text_config()
    features = []
    if getattr(config, "attn_logit_softcapping", None):
        features.append("logit softcapping")
    if any(name.rsplit(".", 1)[-1] == "sinks" for name, _ in model.named_parameters()):
        features.append("attention sinks")
    if getattr(config, "alibi", False) or config.model_type in ("bloom", "mpt"):
        features.append("ALiBi")
    if "chunked_attention" in (getattr(config, "layer_types", None) or []):
        features.append("chunked attention")  # its chunk mask is built outside the attention function
    if any(hasattr(part, "prepare_dynamic_mask") for part in model.modules()):
        features.append("a dynamic mask")  # Doge's per-key score bias, handed to attention as its mask
    return features


class Packed(BatchLayout):
    """The packed layout (module doc): every job in one row; first fit, in arrival order, within ``token_budget``."""

    name = "packed"
    attention = ATTENTION_NAME

    @classmethod
    def admits(cls, model: nn.Module, layers: nn.ModuleList) -> str | None:
        selection = key_selection(model)
        if selection:
            return selection
        mixers = stateful_mixers(model, layers)
        if mixers:
            return "token mixers that carry state along a row: " + "; ".join(mixers)
        features = attention_features(model)
        if features:
            return "attention with " + ", ".join(features)
        outside = sorted({type(part).__name__ for part in model.modules() if isinstance(part, PreTrainedModel)
                          and not getattr(type(part), "_supports_attention_backend", False)})
        if outside:  # a multimodal model's towers count too: switching attention switches theirs
            return "its attention does not go through transformers' attention interface (" + ", ".join(outside) + ")"
        return None

    def select(self, lengths: Sequence[int], compatible: Sequence[bool], limits: BatchLimits) -> list[int]:
        chosen, tokens = [0], lengths[0]
        for index in range(1, len(lengths)):
            if len(chosen) >= limits.max_jobs or tokens >= limits.token_budget:
                break
            if compatible[index] and tokens + lengths[index] <= limits.token_budget:
                chosen.append(index)
                tokens += lengths[index]
        return chosen

    def build_inputs(self, token_ids: Sequence[torch.Tensor], device: torch.device, pad_to: int = 1,
                     pad_id: int = 0, starts: Sequence[int] | None = None) -> BatchInputs:
        """``starts[i]``: the position of ``token_ids[i]``'s first token (the last tokens of a longer
        row, the rest of whose keys the forward is given: ``BatchInputs.keys``); 0 where not given."""
        starts = starts or [0] * len(token_ids)
        ids = torch.cat(list(token_ids))[None]
        positions = torch.cat([torch.arange(start, start + int(job.shape[0]), dtype=torch.long)
                               for start, job in zip(starts, token_ids)])[None]
        return BatchInputs(self, to_device(ids, device), to_device(positions, device), None, bounds_of(token_ids))

    @contextlib.contextmanager
    def forward_context(self, inputs: BatchInputs) -> Iterator[None]:
        with packed_sequences(inputs.bounds, inputs.keys):
            yield
