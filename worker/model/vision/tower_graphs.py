"""A grid tower's one-image forward replayed as a CUDA graph, one graph per image size.

Why: run one image at a time (``towers``), a Qwen-style tower is bound by the host on an
H200: each of its blocks costs the host about 0.7 ms per image to issue (dynamo's guards, about
ten launches, the attention op's dispatch) against 0.37 ms of GPU time, so the GPU waits. For a
given grid everything the tower derives from it is fixed (``towers.host_tower_inputs``), so
its whole forward for one image is a fixed sequence of kernels on fixed buffers but the pixels:
a graph replays it for one launch.

When: a size's first image runs eagerly (it compiles the blocks' shapes and picks the kernels);
its second is captured, the graph replayed, and its features compared with the eager forward's
for the same image. The graph is kept only if they are equal **bit for bit**; otherwise (or if
the capture fails: a tower that syncs with the host) no graph is made again and every image runs
eagerly, with a warning. So a replay gives an image the features its eager one-image forward
gives, which the image self-check compares with the plain model alone.

Invariants: graphs are made and replayed on the engine thread only; all share one memory pool
and run in turn on the current stream, and each replay's output is copied out before the next
replay (so one graph's buffers may reuse another's). At most ``limit`` sizes get a graph (the
first ones seen); images of other sizes run eagerly. A graph holds its grid's derived inputs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from layertap.worker.model.vision.towers import merge_tower_outputs

log = logging.getLogger(__name__)

#: Image sizes that get a graph by default (``worker.tower_graphs``): each holds its static pixels
#: and outputs, about 27 MB for a Qwen2.5-VL-7B tower at 1,000 visual tokens (4,096 patches); the
#: graphs' working memory is one shared pool.
SIZES = 64


@dataclass
class _Graph:
    """One image size's captured forward: replay after copying an image into ``pixels``."""

    graph: torch.cuda.CUDAGraph
    pixels: torch.Tensor  # the static input
    inputs: dict[str, Any]  # the grid's derived inputs, on the device (held for the graph)
    output: Any  # the static output, overwritten by each replay


def tensors_of(output: Any) -> Iterator[torch.Tensor]:
    """Every tensor of a tower output, in field order (a tensor, or fields of tensors or of
    sequences of tensors, as ``merge_tower_outputs`` takes them)."""
    if isinstance(output, torch.Tensor):
        yield output
        return
    for value in output.values():
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (level for level in value if isinstance(level, torch.Tensor))


def copied(output: Any) -> Any:
    """A copy of a tower output (``merge_tower_outputs`` of one output concatenates each field
    alone: a new tensor)."""
    return merge_tower_outputs([output])


class TowerGraphs:
    """CUDA graphs of one tower's one-image forward, by image size (see the module docstring)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.off: str | None = None  # why no graph is made any more, once one failed its check
        self._graphs: dict[tuple, _Graph] = {}
        self._seen: set[tuple] = set()
        self._pool: Any = None

    @property
    def sizes(self) -> int:
        """Image sizes that have a graph."""
        return len(self._graphs)

    def run(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor, derive: Callable[[], dict[str, Any]],
            forward: Callable[..., Any], options: str = "") -> Any:
        """The tower's output for one image (``grid_thw``: its ``[1, 3]`` grid, on the host):
        ``forward(pixel_values, **derive())`` eagerly, or its size's graph replayed (a copy of
        its output). ``derive``: the forward's keyword arguments for this grid, on the device;
        ``options``: what else decides them (the caller's other arguments), part of the key."""
        key = (tuple(grid_thw.flatten().tolist()), tuple(pixel_values.shape), pixel_values.dtype, options)
        graph = self._graphs.get(key)
        if graph is not None:
            graph.pixels.copy_(pixel_values)
            graph.graph.replay()
            return copied(graph.output)
        inputs = derive()
        output = forward(pixel_values, **inputs)
        if self.off is None and len(self._graphs) < self.limit:
            if key in self._seen:
                self._capture(key, pixel_values, inputs, forward, output)
            else:
                self._seen.add(key)
        return output

    def _capture(self, key: tuple, pixel_values: torch.Tensor, inputs: dict[str, Any], forward: Callable[..., Any],
                 eager: Any) -> None:
        """Capture ``key``'s graph and keep it if its replay of ``pixel_values`` gives ``eager``."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        pixels = pixel_values.clone()
        try:
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                output = forward(pixels, **inputs)
            graph.replay()
            same = all(torch.equal(a, b) for a, b in zip(tensors_of(output), tensors_of(eager), strict=True))
        except RuntimeError as exc:  # a tower that syncs with the host, or one that cannot be captured
            self._stop(f"capturing the vision tower as a CUDA graph failed ({type(exc).__name__}: {exc})")
            return
        if not same:
            self._stop(f"the vision tower's CUDA graph for grid {key[0]} gave other features than its eager forward")
            return
        self._graphs[key] = _Graph(graph, pixels, inputs, output)
        log.info("vision tower: a CUDA graph for image grid %s (%d of at most %d sizes)", key[0], self.sizes,
                 self.limit)

    def _stop(self, reason: str) -> None:
        self.off = reason
        self._graphs.clear()
        log.warning("%s: every image runs its tower eagerly from now on", reason)
