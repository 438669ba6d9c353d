"""Switching a loaded model between the ways it runs, after its load: the served batching
layout, transformers' own attention for a reference run, each sequence or image chat alone (the
self-checks' references), compiled decoder layers and a grid tower's CUDA graphs. The engine
only runs the model; every such change is made here or at load (``loading``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from layertap.worker.model.attention import set_attention
from layertap.worker.model.batching import layout_class
from layertap.worker.model.layouts.base import BatchLayout
from layertap.worker.model.vision.tower_graphs import TowerGraphs
from layertap.worker.model.vision.towers import takes_host_inputs

if TYPE_CHECKING:
    from layertap.worker.model.loading import LoadedModel


def use_layout(loaded: LoadedModel, layout: BatchLayout) -> None:
    """Serve ``loaded`` with ``layout`` from now on (the self-check's fallback): its attention
    implementation, or the one transformers chose."""
    set_attention(loaded.model, layout.attention or loaded.native_attention)
    loaded.batching = layout


@contextlib.contextmanager
def transformers_attention(loaded: LoadedModel) -> Iterator[None]:
    """Within the block the model runs the attention implementation transformers chose for it
    (the reference the self-check and the bench compare batching with); after it, the layout's
    again (a layout that keeps the model's own never leaves it)."""
    switched = loaded.batching.attention
    if switched is not None:
        set_attention(loaded.model, loaded.native_attention)
    try:
        yield
    finally:
        if switched is not None:
            set_attention(loaded.model, switched)


@contextlib.contextmanager
def _one_per_forward(loaded: LoadedModel, field: str, reason: str) -> Iterator[None]:
    """Within the block ``loaded.<field>`` (a layout) is the one-per-forward layout, under
    transformers' attention, and compiled layers run their eager code (the model as a user runs it;
    no graphs compiled for a setup the engine never serves); the served layout again after it."""
    with transformers_attention(loaded), torch.compiler.set_stance("force_eager"):
        served = getattr(loaded, field)
        setattr(loaded, field, layout_class("single")(reason))
        try:
            yield
        finally:
            setattr(loaded, field, served)


def each_sequence_alone(loaded: LoadedModel) -> contextlib.AbstractContextManager[None]:
    """Within the block every text batch is one sequence run as the model runs it by itself:
    transformers' attention for it (:func:`transformers_attention`), and no ``position_ids``
    (the one-per-forward layout), so the model numbers the positions itself. That is the
    self-check's reference: packing passes positions restarting at 0, which a model that
    numbers its own otherwise (Kosmos-2.5 from its padding id + 1) would not compute."""
    return _one_per_forward(loaded, "batching", "the self-check's reference: each sequence alone")


def each_image_chat_alone(loaded: LoadedModel) -> contextlib.AbstractContextManager[None]:
    """Within the block image chats run one per forward, unpadded, which runs them plain (as a
    user runs the model on its processor's output: transformers' attention, the chat's mask, the
    positions and tower inputs the model derives itself; ``engine.runner.run_with_images``).
    That is the image self-check's reference, so it covers the worker's host numbering too (a
    wrong one would otherwise pass, batched and alone alike)."""
    return _one_per_forward(loaded, "image_batching", "the image self-check's reference: each chat alone")


def compile_decoder_layers(loaded: LoadedModel, backend: str | Callable[..., Any] = "inductor") -> Callable[[], None]:
    """``torch.compile`` each decoder layer's ``forward`` with dynamic shapes: norms, rotary,
    MLP and residual adds fuse; attention stays eager (``packed_attention`` is excluded)
    and the capture hooks stay outside (they run in ``Module.__call__``), as do accelerate's
    (a split model's: the layer's own forward is compiled, under them). Identical layers
    share one compiled graph; the first batch through them pays the compile time. ``backend``: torch's
    (``eager`` traces the graphs without generating code, as the tests of their breaks do).
    A VLM's grid tower (``layertap.worker.model.vision.towers``) has its blocks compiled the same
    way, one graph for all of them, its varlen flash attention a custom op inside it (no graph
    break). Not the whole tower: that unrolls every block into one graph; on an H200
    (Qwen2.5-VL-7B's 32 blocks) a first forward so compiled had not ended after a minute (17 s
    with its blocks compiled). The image warm-up compiles them. Returns what makes every one of them
    run its eager code again (``self_check.check_compiled``, where the compiled layers fail it)."""
    eager: list[tuple[torch.nn.Module, str, Callable[..., Any] | None]] = []
    for layer in [*loaded.layers, *getattr(loaded.grid_tower, "blocks", [])]:
        field = "_old_forward" if hasattr(layer, "_old_forward") else "forward"  # accelerate's hook calls the first
        held = layer.__dict__.get(field)  # an instance's own forward (a hook's); None: the class's
        eager.append((layer, field, held))
        setattr(layer, field, torch.compile(getattr(layer, field), dynamic=True, backend=backend))
    loaded.compiled = True

    def run_eagerly() -> None:
        for layer, field, held in eager:
            if held is None:
                del layer.__dict__[field]
            else:
                setattr(layer, field, held)
        loaded.compiled = False
    return run_eagerly


def use_tower_graphs(loaded: LoadedModel, limit: int) -> None:
    """Replay ``loaded``'s grid tower as CUDA graphs by image size (``layertap.worker.model.vision.tower_graphs``)
    in batched image forwards, for up to ``limit`` sizes: where chats with images batch, for a
    tower given its inputs on the host (:func:`~layertap.worker.model.vision.towers.takes_host_inputs`)
    that attends by one varlen flash op (``vision.attention``: a GPU, bf16/fp16), so that its
    forward never waits on the device. Else (or ``limit`` 0) nothing changes."""
    batched = loaded.image_batching is not None and not loaded.image_batching.slow
    if limit and batched and loaded.vision_attention is not None and takes_host_inputs(loaded.grid_tower):
        loaded.tower_graphs = TowerGraphs(limit)
