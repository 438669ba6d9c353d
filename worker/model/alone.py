"""One prompt's states computed alone through the model's own forward, without layertap's capture:
the reference a run's sampled rows are measured against (``layertap.worker.job.sampling``).

The decoder runs the tokens as one sequence (no padding, no packing, the positions it numbers
itself) on the attention implementation transformers chose for it (``modes.transformers_attention``)
through all of its layers, eagerly (layers the engine compiled run their eager code): what a
user's ``model(input_ids)`` runs. Hooks read vLLM's convention
(``layertap.protocol.layers``): id ``i < L`` is the input of decoder layer ``i``, id ``L`` the output of
the last one. Nothing of the engine's batching, layouts or capture buffers is used. Run it on the
engine thread (``Engine.call_when_idle``): it switches the attention implementation for its forward.
:func:`start_alone_states` never waits for the device: the states come back through pinned host
memory, and :meth:`AloneStates.result` (any thread) waits for them, so the engine thread goes on
launching batches while the row runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from layertap.worker.model.capture import block_input, hidden_of
from layertap.worker.model.loading import LoadedModel
from layertap.worker.model.modes import transformers_attention


@dataclass
class AloneStates:
    """States on their way to the host: ready once ``done`` (a CUDA event; None on the CPU) is."""

    states: torch.Tensor
    done: torch.cuda.Event | None

    def result(self) -> torch.Tensor:
        """``[T, len(layer_ids), *per_token]`` in the compute dtype, on the host (waits for the copy)."""
        if self.done is not None:
            self.done.synchronize()
        return self.states


def start_alone_states(loaded: LoadedModel, token_ids: torch.Tensor, layer_ids: Sequence[int]) -> AloneStates:
    """``token_ids`` (int64 ``[T]``) run alone, their states at ``layer_ids`` (resolved, ``0..L``, in
    the order wanted) copied to the host as they are computed, without waiting for the device."""
    stream, last = loaded.capture.stream, loaded.num_layers
    caught: dict[int, torch.Tensor] = {}

    def keep(index: int, hidden: torch.Tensor) -> None:
        caught[index] = stream.tokens(hidden).clone()

    def pre_hook(index: int):
        return lambda module, args, kwargs: keep(index, block_input(args, kwargs))

    handles = [loaded.layers[index].register_forward_pre_hook(pre_hook(index), with_kwargs=True)
               for index in sorted(set(layer_ids)) if index < last]
    if last in layer_ids:
        handles.append(loaded.layers[-1].register_forward_hook(
            lambda module, args, output: keep(last, hidden_of(output))))
    try:
        # eagerly, whatever the engine compiled: the plain model's forward, and no recompile of the engine's
        # graphs for an attention setup and shapes they never take (which stalled a compiled worker for seconds)
        with transformers_attention(loaded), torch.inference_mode(), torch.compiler.set_stance("force_eager"):
            loaded.decoder(input_ids=token_ids[None].to(loaded.device), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    states = torch.stack([caught[index] for index in layer_ids], dim=1)
    if states.device.type != "cuda":
        return AloneStates(states, None)
    host = torch.empty(states.shape, dtype=states.dtype, pin_memory=True)
    host.copy_(states, non_blocking=True)  # the device copy may be freed now: its stream reuses it after the copy
    done = torch.cuda.Event()
    done.record()
    return AloneStates(host, done)


def alone_states(loaded: LoadedModel, token_ids: torch.Tensor, layer_ids: Sequence[int]) -> torch.Tensor:
    """``[T, len(layer_ids), *per_token]`` in the compute dtype, on the host: :func:`start_alone_states`, waited for."""
    return start_alone_states(loaded, token_ids, layer_ids).result()
