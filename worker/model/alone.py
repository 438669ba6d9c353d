"""One prompt's states computed alone through the model's own forward, without layertap's capture:
the reference a run's sampled rows are measured against (``layertap.worker.job.sampling``).

The decoder runs the tokens as one sequence (no padding, no packing, the positions it numbers
itself) on the attention implementation transformers chose for it (``modes.transformers_attention``)
through all of its layers, eagerly (layers the engine compiled run their eager code): what a
user's ``model(input_ids)`` runs. Hooks read vLLM's convention
(``layertap.protocol.layers``): id ``i < L`` is the input of decoder layer ``i``, id ``L`` the output of
the last one. Nothing of the engine's batching, layouts or capture buffers is used. Run it on the
engine thread (``Engine.call``): it switches the attention implementation for its forward.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from layertap.worker.model.capture import block_input, hidden_of
from layertap.worker.model.loading import LoadedModel
from layertap.worker.model.modes import transformers_attention


def alone_states(loaded: LoadedModel, token_ids: torch.Tensor, layer_ids: Sequence[int]) -> torch.Tensor:
    """``[T, len(layer_ids), *per_token]`` in the compute dtype, on the host: ``token_ids`` (int64 ``[T]``)
    run alone; ``layer_ids`` resolved (``0..L``), in the order wanted."""
    stream, last = loaded.capture.stream, loaded.num_layers
    caught: dict[int, torch.Tensor] = {}

    def keep(index: int, hidden: torch.Tensor) -> None:
        caught[index] = stream.tokens(hidden).to("cpu", copy=True)

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
    return torch.stack([caught[index] for index in layer_ids], dim=1)
