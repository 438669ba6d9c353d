"""A batch's vision tower run one image at a time, for towers that take a ``grid_thw`` (Qwen2-VL,
Qwen2.5-VL, Qwen3-VL, Qwen3.5, GLM-4.1V, Kimi K2.5): each image's features are then bit for bit the features
it gets alone, whatever else shares its batch.

Why: such a tower concatenates every image's patches into one sequence. Its attention keeps
the images apart, but its matmuls run on all their rows at once, and the kernels a GPU picks
depend on the number of rows: the last bits of an image's features change with its batch
companions, and a deep model amplifies them. Measured on an H200 in bf16, a random-weight
Qwen2.5-VL-7B shape: batched against alone differed by 0.1 at the last layer, the self-check's
tolerance, so image chats ran one per forward. One tower call per image costs a few kernel
launches per block and keeps the tower's own code; the language model still runs the batch.

Invariant: the merged output is what the tower returns for the whole batch, up to those last
bits: every tensor field concatenated along dim 0 in image order, every sequence field (one
tensor per level: deepstack features, hidden states) concatenated level by level.

Given its grid on the host, the tower also gets every quantity it derives from the grid
(rotary positions, sequence and window bounds, position-embedding taps: :func:`host_tower_inputs`)
computed there by transformers' own helpers and copied without a sync: computed from a grid
on the GPU, each takes one or more device syncs per image (``.tolist()``, ``.item()``), which
drain the GPU's queue and leave it idle while the host issues the next kernels. The grid
itself goes to the tower on its device too (copied without a sync): a tower may read it
beyond those helpers in device arithmetic (GLM-4.1V's interpolates its position embeddings
to each patch's image grid, indexing the grid by patch), where a host tensor fails.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from layertap.worker.model.layouts.base import to_device

if TYPE_CHECKING:
    from layertap.worker.model.vision.tower_graphs import TowerGraphs


def vision_module(model: nn.Module, parameter: str) -> nn.Module | None:
    """The first module of ``model`` configured by its ``vision_config`` whose ``forward`` takes
    ``parameter``, else None."""
    vision = getattr(getattr(model, "config", None), "vision_config", None)
    if vision is None:
        return None
    for module in model.modules():
        if getattr(module, "config", None) is vision and parameter in _parameters(module):
            return module
    return None


def grid_tower(model: nn.Module) -> nn.Module | None:
    """The vision tower of ``model`` whose ``forward`` takes ``grid_thw`` (one row per image, its
    patches ``t * h * w`` rows of the pixel values), else None."""
    return vision_module(model, "grid_thw")


def _parameters(module: nn.Module) -> set[str]:
    try:
        return set(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return set()


def takes_host_inputs(tower: nn.Module | None) -> bool:
    """Whether :func:`host_tower_inputs` covers ``tower``: its module derives everything from
    the grid through transformers' ``vision_utils`` helpers, which take precomputed values, and
    numbers its patches by its own ``spatial_merge_size``, as :func:`host_tower_inputs` does. A
    tower with none derives them otherwise (Kimi K2.5's numbers its patches unmerged, bounds a
    whole clip, and takes a frame index and a merge index of its own): it gets its grid on its
    device and derives them itself."""
    if tower is None or not hasattr(tower, "spatial_merge_size"):
        return False
    try:
        from transformers import vision_utils
    except ImportError:  # a transformers before the helpers: the tower derives them itself
        return False
    module = sys.modules[type(tower).__module__]
    return getattr(module, "get_vision_position_ids", None) is vision_utils.get_vision_position_ids


def host_tower_inputs(tower: nn.Module, grid_thw: torch.Tensor, device: torch.device) -> dict[str, Any]:
    """What ``tower`` (:func:`takes_host_inputs`) derives from ``grid_thw``, computed from it on
    the host by the helpers its forward calls, with the same arguments, and put on ``device``
    without a sync (pinned, asynchronous): the keyword arguments under which those helpers
    return them instead of computing them."""
    from transformers import vision_utils

    config = tower.config
    grid = grid_thw.cpu()
    cu_seqlens = vision_utils.get_vision_cu_seqlens(grid)
    inputs: dict[str, Any] = {
        "position_ids": vision_utils.get_vision_position_ids(grid, tower.spatial_merge_size),
        "cu_seqlens": cu_seqlens, "max_seqlen": _longest(cu_seqlens)}
    if hasattr(tower, "fullatt_block_indexes"):  # Qwen2.5-VL's windowed blocks
        window_index, cu_window_seqlens = vision_utils.get_vision_window_index(
            grid, spatial_merge_size=tower.spatial_merge_size, window_size=tower.window_size,
            patch_size=tower.patch_size)
        inputs |= {"window_index": window_index, "cu_window_seqlens": cu_window_seqlens,
                   "max_window_seqlen": _longest(cu_window_seqlens)}
    if hasattr(tower, "num_grid_per_side"):  # Qwen3-VL's interpolated position embeddings
        inputs["interp_indices"], inputs["interp_weights"] = vision_utils.get_vision_interpolation_indices_and_weights(
            grid, num_grid_per_side=tower.num_grid_per_side, mode=tower.interpolation_mode,
            align_corners=tower.interpolation_align_corners, spatial_merge_size=config.spatial_merge_size)
    return {name: to_device(value, device) if isinstance(value, torch.Tensor) else value
            for name, value in inputs.items()}


def _longest(cu_seqlens: torch.Tensor) -> int:
    return int((cu_seqlens[1:] - cu_seqlens[:-1]).max())


def merge_tower_outputs(outputs: Sequence[Any]) -> Any:
    """One output from each image's (see the module's invariant); a plain tensor output is
    concatenated. Raises TypeError for a field of any other kind."""
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(list(outputs))
    merged = {}
    for name, value in first.items():
        values = [output[name] for output in outputs]
        if isinstance(value, torch.Tensor):
            merged[name] = torch.cat(values)
        elif isinstance(value, (list, tuple)) and all(isinstance(level, torch.Tensor) for level in value):
            merged[name] = type(value)(torch.cat(levels) for levels in zip(*values))
        else:
            raise TypeError(f"the vision tower's output field {name!r} ({type(value).__name__}) cannot be merged "
                            "across images")
    return type(first)(**merged)


@contextlib.contextmanager
def one_image_at_a_time(tower: nn.Module | None, graphs: TowerGraphs | None = None) -> Iterator[None]:
    """Within the block, the grid ``tower`` (:func:`grid_tower`; nothing changes for None) runs
    each image of a call alone and merges the outputs (:func:`merge_tower_outputs`). A grid on
    the host (where :func:`takes_host_inputs`) brings each image its :func:`host_tower_inputs`
    and reaches the tower on the pixels' device; with ``graphs`` (a GPU), such an image runs as
    its size's CUDA graph where it has one (``layertap.worker.model.vision.tower_graphs``)."""
    if tower is None:
        yield
        return
    own = tower.__dict__.get("forward")  # an instance forward (accelerate's, a compiled one) stays in place
    forward = tower.forward

    on_host = takes_host_inputs(tower)

    def alone(pixel_values: torch.Tensor, grid_thw: torch.Tensor, **kwargs: Any) -> Any:
        if not (on_host and grid_thw.device.type == "cpu"):
            return forward(pixel_values, grid_thw=grid_thw, **kwargs)

        def derive() -> dict[str, Any]:  # the grid also on the device, for what the tower reads beyond the helpers
            return {**kwargs, **host_tower_inputs(tower, grid_thw, pixel_values.device),
                    "grid_thw": to_device(grid_thw, pixel_values.device)}

        if graphs is None or any(isinstance(value, torch.Tensor) for value in kwargs.values()):
            return forward(pixel_values, **derive())  # (a graph would hold the caller's tensors fixed)
        return graphs.run(pixel_values, grid_thw, derive, forward, options=repr(sorted(kwargs.items())))

    def per_image(pixel_values: torch.Tensor, grid_thw: torch.Tensor, **kwargs: Any) -> Any:
        if grid_thw.shape[0] == 1:
            return alone(pixel_values, grid_thw, **kwargs)
        patches = grid_thw.prod(-1).tolist()  # a device grid: one sync
        return merge_tower_outputs([alone(chunk, grid_thw[index:index + 1], **kwargs)
                                    for index, chunk in enumerate(pixel_values.split(patches))])

    tower.forward = per_image
    try:
        yield
    finally:
        if own is None:
            del tower.forward
        else:
            tower.forward = own
