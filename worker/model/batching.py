"""How a loaded model may batch many jobs into one forward: a layout object chosen from the
model's structure (:func:`plan_batching`), one class per file in ``layertap.worker.model.layouts``.

:data:`LAYOUTS` lists them fastest first: ``auto`` takes the first whose structural rule admits
the model, and the load-time self-check on the real device and dtype
(``layertap.worker.engine.self_check``) falls back down the list while batching changes the states:
packed -> padded -> one prompt per batch. A model that even one prompt per batch cannot serve
(its layers cannot be captured in vLLM's convention) is refused with :class:`ModelRefused`.
Adding a layout is one file in ``layertap.worker.model.layouts`` and one line here.
"""

from __future__ import annotations

import importlib

from torch import nn

from layertap.worker.model.layouts.base import BatchLayout

#: Every layout, fastest first: name -> ``module:class``, imported when used.
LAYOUTS: dict[str, str] = {
    "packed": "layertap.worker.model.layouts.packed:Packed",
    "padded": "layertap.worker.model.layouts.padded:Padded",
    "single": "layertap.worker.model.layouts.single:OnePerBatch",
}
AUTO = "auto"


class ModelRefused(RuntimeError):
    """This model cannot be served exactly. ``str()`` is one line: the architecture and why."""

    def __init__(self, architecture: str, reason: str):
        super().__init__(f"cannot serve {architecture}: {reason}")
        self.architecture, self.reason = architecture, reason


def layout_class(name: str) -> type[BatchLayout]:
    """The layout registered as ``name``; ValueError for an unknown one."""
    if name not in LAYOUTS:
        raise ValueError(f"batching {name!r} is not one of {AUTO}, {', '.join(LAYOUTS)}")
    module, _, attribute = LAYOUTS[name].partition(":")
    return getattr(importlib.import_module(module), attribute)


def plan_batching(model: nn.Module, layers: nn.ModuleList, requested: str = AUTO) -> BatchLayout:
    """The layout for this model (``requested``: ``auto``, or a layout's name to force it; a forced
    layout is still held to the self-check, with no alternatives)."""
    if requested != AUTO:
        return layout_class(requested)("asked for in the worker's settings")
    names = list(LAYOUTS)
    why_not = ""
    for position, name in enumerate(names):
        layout = layout_class(name)
        refusal = layout.admits(model, layers)
        if refusal is None:
            reason = why_not or "its structure admits it"
            return layout(reason, alternatives=tuple(names[position + 1:]))
        why_not = refusal
    raise ModelRefused(type(model).__name__, f"no batching layout admits it ({why_not})")


def fallback(layout: BatchLayout, model: nn.Module, layers: nn.ModuleList, failure: str) -> BatchLayout | None:
    """The next of ``layout``'s alternatives that admits the model, told why (``failure``: how
    the self-check failed ``layout``); None when none is left."""
    for position, name in enumerate(layout.alternatives):
        candidate = layout_class(name)
        if candidate.admits(model, layers) is None:
            reason = f"{layout.name} batching failed the load-time self-check ({failure})"
            return candidate(reason, alternatives=layout.alternatives[position + 1:])
    return None
