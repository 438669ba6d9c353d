"""Forward hooks that copy chosen layers' residual stream into one staging tensor.

Layer id ``i < L`` is read in a pre-hook on decoder layer ``i`` (its input), id ``L``
in a hook on the last layer's output (before the final norm), matching
``layertap.protocol.layers``. The hooks are registered once, where the model is loaded
(``layertap.worker.model.loading``), and do nothing unless a capture is active.
A hook sees ``[B, T, H]``: one packed row (``B = 1``), or a padded batch whose real tokens
``rows`` picks out of the flattened ``[B * T]`` positions (``layertap.worker.model.layouts``).

Some residual streams carry several copies of the hidden vector per token (hyper-connections
``[B, T, copies, H]``, a stream ``copies x H`` wide, AltUp's ``[copies, B, T, H]``): the
load-time :func:`probe_stream` finds the layout, and those are captured whole, as
``[tokens, layers, copies, H]``. A block that runs more than once per forward (a looped block)
has no one input to name, so the probe refuses the model.
Once the last wanted layer is copied, :class:`StopForward` ends the forward: layers
past it, the final norm and lm_head never run.

A model split over several devices (``layertap.worker.model.split``) is captured where each layer runs:
the hook hands the layer's output to the first device's *gather stream*, which waits for the
compute stream of the layer's device, receives it (from another GPU, over the split's transfer stream) and picks
the real tokens there, so the first device's compute stream never waits for a later stage.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


class StopForward(Exception):
    """Raised from a hook once every wanted layer (and the final norm's output, when asked) is
    captured; caught by the engine."""


class UncapturableStream(Exception):
    """The decoder's residual stream cannot be captured in vLLM's convention; ``str()`` says why."""


def hidden_of(value: Any) -> torch.Tensor:
    """The hidden states of a decoder block's output (the first item of a tuple, or the tensor)."""
    return value[0] if isinstance(value, (tuple, list)) else value


def block_input(args: tuple, kwargs: dict) -> torch.Tensor:
    """The hidden states a decoder block is called with (a pre-hook's ``args``/``kwargs``)."""
    return args[0] if args else kwargs["hidden_states"]


#: Tokens of the probe forward: a length no hidden size or copy count is likely to equal.
PROBE_TOKENS = 7


@dataclass(frozen=True)
class StreamShape:
    """How the residual stream between decoder blocks holds each token: ``copies`` vectors of
    ``hidden_size`` (1: the usual ``[B, T, H]``), copies first (``[copies, B, T, H]``) or not."""

    hidden_size: int
    copies: int = 1
    copies_first: bool = False

    @property
    def per_token(self) -> tuple[int, ...]:
        """The shape of one token's captured state: ``(H,)``, or ``(copies, H)``."""
        return (self.hidden_size,) if self.copies == 1 else (self.copies, self.hidden_size)

    def tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """A block's stream -> ``[B * T, *per_token]``."""
        if self.copies_first:
            hidden = hidden.movedim(0, 2)
        return hidden.reshape(-1, *self.per_token)


def _shape_of(shape: torch.Size, hidden_size: int) -> StreamShape | None:
    """The stream layout a probe's ``[1, PROBE_TOKENS, ...]`` block input shows, or None."""
    dims, tokens = tuple(shape), PROBE_TOKENS
    if len(dims) == 3 and dims[:2] == (1, tokens) and dims[2] % hidden_size == 0:
        return StreamShape(hidden_size, dims[2] // hidden_size)
    if len(dims) == 4 and dims[:2] == (1, tokens) and dims[3] == hidden_size:
        return StreamShape(hidden_size, dims[2])
    if len(dims) == 4 and dims[1:3] == (1, tokens) and dims[3] == hidden_size:
        return StreamShape(hidden_size, dims[0], copies_first=True)
    return None


def probe_stream(decoder: nn.Module, layers: nn.ModuleList, hidden_size: int, device: torch.device) -> StreamShape:
    """Run the decoder once on :data:`PROBE_TOKENS` tokens and read its residual stream: how many
    times each block runs and the shape of what enters it. Raises :class:`UncapturableStream` for
    a block that runs more than once per forward (a looped block: which pass is "the input of
    layer i" would be a silent choice) or a stream that is not ``[tokens, copies, H]``-shaped."""
    seen: dict[int, list[torch.Size]] = {}
    outputs: list[torch.Size] = []

    def pre_hook(index: int):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            seen.setdefault(index, []).append(block_input(args, kwargs).shape)
        return hook

    handles = [layer.register_forward_pre_hook(pre_hook(i), with_kwargs=True) for i, layer in enumerate(layers)]
    handles.append(layers[-1].register_forward_hook(lambda module, args, output: outputs.append(
        hidden_of(output).shape)))
    try:
        with torch.inference_mode():
            decoder(input_ids=torch.arange(3, 3 + PROBE_TOKENS, device=device)[None], use_cache=False)
    except Exception as exc:  # noqa: BLE001 (any failure of the model's own forward is its reason)
        raise UncapturableStream(f"its decoder's forward fails on {PROBE_TOKENS} tokens alone "
                                 f"({type(exc).__name__}: {exc})") from None
    finally:
        for handle in handles:
            handle.remove()
    looped = {index: len(shapes) for index, shapes in seen.items() if len(shapes) > 1}
    if looped:
        index, times = min(looped.items())
        raise UncapturableStream(
            f"decoder block {index} runs {times} times per forward (a looped block), so 'the residual stream "
            f"entering layer {index}' names {times} different tensors; layertap does not pick one")
    missing = [index for index in range(len(layers)) if index not in seen]
    if missing:
        raise UncapturableStream(f"decoder blocks {missing} never run in a forward, so their inputs cannot be read")
    shapes = {shape for shapes in seen.values() for shape in shapes} | set(outputs)
    layouts = {_shape_of(shape, hidden_size) for shape in shapes}
    if len(layouts) != 1 or None in layouts:
        raise UncapturableStream(f"its residual stream between blocks has shapes {sorted(map(tuple, shapes))}, "
                                 f"not [batch, tokens, (copies,) {hidden_size}] throughout")
    return layouts.pop()  # type: ignore[return-value]


class LayerCapture:
    """Owns the hooks on one model. Not thread-safe: one engine thread uses it."""

    def __init__(self, layers: nn.ModuleList, final_norm: nn.Module | None, *, stream: StreamShape,
                 dtype: torch.dtype, device: torch.device):
        self.num_layers = len(layers)
        self.hidden_size = stream.hidden_size
        self.stream = stream
        self.dtype = dtype
        self.device = device
        self._slots: dict[int, int] = {}
        self._staging: torch.Tensor | None = None
        self._final: torch.Tensor | None = None
        self._stop_at: int | None = None
        self._rows: torch.Tensor | None = None
        self.gather: torch.cuda.Stream | None = None  # a model split over GPUs: its gather stream
        self.send: Callable[[torch.Tensor, torch.device], torch.Tensor] | None = None  # ... and its copy between GPUs
        for index, layer in enumerate(layers):
            layer.register_forward_pre_hook(self._pre_hook(index), with_kwargs=True)
        layers[-1].register_forward_hook(self._last_layer_hook)
        if final_norm is not None:
            final_norm.register_forward_hook(self._final_norm_hook)

    def _pre_hook(self, index: int):
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            if self._staging is None:
                return
            slot = self._slots.get(index)
            if slot is not None:
                self._store(self._staging[:, slot], self.stream.tokens(block_input(args, kwargs)))
            if self._stop_at == index:
                raise StopForward

        return hook

    def _last_layer_hook(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        if self._staging is None:
            return
        slot = self._slots.get(self.num_layers)
        if slot is not None:
            self._store(self._staging[:, slot], self.stream.tokens(hidden_of(output)))
        if self._stop_at == self.num_layers:
            raise StopForward

    def _final_norm_hook(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        if self._final is not None:
            hidden = hidden_of(output)
            self._store(self._final, hidden.reshape(-1, hidden.shape[-1]))
            raise StopForward  # nothing after the final norm is read (a VLM's own forward would go on to logits)

    def _store(self, target: torch.Tensor, flat: torch.Tensor) -> None:
        """Copy the real tokens of ``flat`` (``[B * T, ...]``, on the device that ran the layer) into
        ``target`` (on :attr:`device`): directly, or on the gather stream of a split model."""
        gather = self.gather
        if gather is None:
            target.copy_(self._select_rows(flat))
            return
        gather.wait_stream(torch.cuda.current_stream(flat.device))
        with torch.cuda.stream(gather):
            if flat.device == self.device:
                flat.record_stream(gather)  # made on the compute stream, read on the gather stream
            else:
                flat = self.send(flat, self.device)  # type: ignore[misc]
            target.copy_(self._select_rows(flat))

    def _select_rows(self, flat: torch.Tensor) -> torch.Tensor:
        return flat if self._rows is None else flat.index_select(0, self._rows)

    @contextlib.contextmanager
    def capture(self, layer_ids: Sequence[int], num_tokens: int, final: bool = False,
                rows: torch.Tensor | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
        """Within the block, a forward over a batch of ``num_tokens`` real tokens (one packed
        row, or a padded batch with ``rows``) fills ``staging[:, k]`` with layer
        ``layer_ids[k]`` (and ``final`` with the post-norm output when asked).
        ``layer_ids`` are resolved (``0..L``) and distinct."""
        staging = torch.empty(num_tokens, len(layer_ids), *self.stream.per_token, dtype=self.dtype,
                              device=self.device)
        final_out = (torch.empty(num_tokens, self.hidden_size, dtype=self.dtype, device=self.device)
                     if final else None)
        self._slots = {layer_id: slot for slot, layer_id in enumerate(layer_ids)}
        self._stop_at = None if final else max(layer_ids)
        self._staging, self._final, self._rows = staging, final_out, rows
        if self.gather is not None:  # written and read on the gather stream, freed by the engine thread
            for tensor in (staging, final_out, rows):
                if tensor is not None:
                    tensor.record_stream(self.gather)
        try:
            yield staging, final_out
        finally:
            self._staging, self._final, self._slots, self._stop_at, self._rows = None, None, {}, None, None
