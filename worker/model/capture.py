"""Forward hooks that copy chosen layers' residual stream into one staging tensor.

Layer id ``i < L`` is read in a pre-hook on decoder layer ``i`` (its input), id ``L``
in a hook on the last layer's output (before the final norm), matching
``producer.protocol.layers``. The hooks are registered once, where the model is loaded
(``worker.model.loading``), and do nothing unless a capture is active.
A hook sees ``[B, T, H]``: one packed row (``B = 1``), or a padded batch whose real tokens
``rows`` picks out of the flattened ``[B * T]`` positions (``worker.engine.inputs``).
Once the last wanted layer is copied, :class:`StopForward` ends the forward: layers
past it, the final norm and lm_head never run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn


class StopForward(Exception):
    """Raised from a hook once every wanted layer is captured; caught by the engine."""


def _hidden_of(value: Any) -> torch.Tensor:
    return value[0] if isinstance(value, (tuple, list)) else value


class LayerCapture:
    """Owns the hooks on one model. Not thread-safe: one engine thread uses it."""

    def __init__(self, layers: nn.ModuleList, final_norm: nn.Module | None, *, hidden_size: int,
                 dtype: torch.dtype, device: torch.device):
        self.num_layers = len(layers)
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.device = device
        self._slots: dict[int, int] = {}
        self._staging: torch.Tensor | None = None
        self._final: torch.Tensor | None = None
        self._stop_at: int | None = None
        self._rows: torch.Tensor | None = None
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
                hidden = args[0] if args else kwargs["hidden_states"]
                self._staging[:, slot].copy_(self._real_tokens(hidden))
            if self._stop_at == index:
                raise StopForward

        return hook

    def _last_layer_hook(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        if self._staging is None:
            return
        slot = self._slots.get(self.num_layers)
        if slot is not None:
            self._staging[:, slot].copy_(self._real_tokens(_hidden_of(output)))
        if self._stop_at == self.num_layers:
            raise StopForward

    def _final_norm_hook(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        if self._final is not None:
            self._final.copy_(self._real_tokens(_hidden_of(output)))

    def _real_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[B, T, H]`` -> ``[num_tokens, H]``: the real tokens, in the captured layout."""
        flat = hidden.reshape(-1, hidden.shape[-1])
        return flat if self._rows is None else flat.index_select(0, self._rows)

    @contextlib.contextmanager
    def capture(self, layer_ids: Sequence[int], num_tokens: int, final: bool = False,
                rows: torch.Tensor | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
        """Within the block, a forward over a batch of ``num_tokens`` real tokens (one packed
        row, or a padded batch with ``rows``) fills ``staging[:, k]`` with layer
        ``layer_ids[k]`` (and ``final`` with the post-norm output when asked).
        ``layer_ids`` are resolved (``0..L``) and distinct."""
        staging = torch.empty(num_tokens, len(layer_ids), self.hidden_size, dtype=self.dtype, device=self.device)
        final_out = (torch.empty(num_tokens, self.hidden_size, dtype=self.dtype, device=self.device)
                     if final else None)
        self._slots = {layer_id: slot for slot, layer_id in enumerate(layer_ids)}
        self._stop_at = None if final else max(layer_ids)
        self._staging, self._final, self._rows = staging, final_out, rows
        try:
            yield staging, final_out
        finally:
            self._staging, self._final, self._slots, self._stop_at, self._rows = None, None, {}, None, None
