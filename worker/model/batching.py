"""How a loaded model may batch many jobs into one forward, decided from its structure.

Two exact paths:

* ``packed``: every prompt of a batch in one row, positions restarting at each prompt,
  attention told the boundaries (``packed_attention``). Exact only where *every* token
  mixer is attention that goes through transformers' attention interface and needs no
  feature that packed attention lacks (sinks, logit softcapping, ALiBi). No padding.
* ``padded``: prompts of similar length right-padded into a ``[B, T]`` batch through the
  model's own attention implementation. Exact for any causal model: a real token never
  sees the padding after it, so linear attention, SSM, convolution and recurrent mixers
  (which carry state along a row) are exact too, and so are sinks, softcapping and ALiBi.

The plan is made once at load (:func:`plan_batching`) and backed by a self-check on the
real device and dtype (``worker.engine.self_check``); a model that fails it is refused with
:class:`ModelRefused`, never served.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from torch import nn

#: ``config.layer_types`` entries that are attention (transformers' own vocabulary).
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention", "attention"})
#: ``config.layer_types`` entries that mix no tokens at all (Nemotron-H's MLP-only blocks).
MIXERLESS_LAYER_TYPES = frozenset({"mlp", "moe"})


class BatchingPath(str, enum.Enum):
    """How jobs share a forward; written into each file's header and shown by ``status``."""

    packed = "packed"
    padded = "padded"


class ModelRefused(RuntimeError):
    """This model cannot be served exactly. ``str()`` is one line: the architecture and why."""

    def __init__(self, architecture: str, reason: str):
        super().__init__(f"cannot serve {architecture}: {reason}")
        self.architecture, self.reason = architecture, reason


@dataclass(frozen=True)
class BatchingPlan:
    path: BatchingPath
    reason: str  # one line: why this path

    def describe(self) -> str:
        return f"{self.path.value} ({self.reason})"


def stateful_mixers(model: nn.Module, layers: nn.ModuleList) -> list[str]:
    """Token mixers in the decoder blocks that carry state along a row (so packing would leak
    one prompt into the next): the blocks' config types that are not attention, and any
    ``nn.Conv1d`` (the causal convolutions of Mamba, gated delta nets, short-conv and RG-LRU
    blocks). Returns short descriptions, empty when there are none."""
    found: list[str] = []
    config = model.config.get_text_config()
    layer_types = getattr(config, "layer_types", None) or []
    others = sorted({kind for kind in layer_types if kind not in ATTENTION_LAYER_TYPES | MIXERLESS_LAYER_TYPES})
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
    return features


def plan_batching(model: nn.Module, layers: nn.ModuleList, requested: str = "auto") -> BatchingPlan:
    """The path for this model (``requested``: ``auto``, or ``packed``/``padded`` to force one;
    a forced path is still held to the self-check)."""
    if requested != "auto":
        try:
            return BatchingPlan(BatchingPath(requested), "asked for in the worker's settings")
        except ValueError:
            raise ValueError(f"batching {requested!r} is not one of auto, packed, padded") from None
    mixers = stateful_mixers(model, layers)
    if mixers:
        return BatchingPlan(BatchingPath.padded, "token mixers that carry state along a row: " + "; ".join(mixers))
    features = attention_features(model)
    if features:
        return BatchingPlan(BatchingPath.padded, "attention with " + ", ".join(features))
    if not getattr(type(model), "_supports_attention_backend", False):
        return BatchingPlan(BatchingPath.padded, "its attention does not go through transformers' attention interface")
    return BatchingPlan(BatchingPath.packed, "every token mixer is attention through transformers' interface")
