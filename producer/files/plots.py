"""PNG charts: a file's per-layer statistics (``inspect --plot``) and a run's throughput
over time (``watch --plot``). Needs matplotlib (``pip install 'layertap[plots]'``), no torch.

Figures are drawn on a bare :class:`matplotlib.figure.Figure` with the Agg canvas (no
pyplot, no global backend switch) at a fixed size: :data:`FILE_PLOT_PX` and
:data:`THROUGHPUT_PLOT_PX` pixels.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from layertap.extras import MissingExtra, hint
from layertap.producer.files.file_stats import (
    layer_cosine_similarity,
    read_hidden_states,
    token_norms,
)

try:
    from matplotlib.colors import LogNorm
    from matplotlib.figure import Figure
except ImportError:  # the client install has no matplotlib; the CLI prints this one line
    raise MissingExtra(hint("matplotlib", "--plot")) from None

DPI = 100
FILE_PLOT_PX = (1400, 500)
THROUGHPUT_PLOT_PX = (1000, 400)
MAX_BUCKETS = 60
MIN_BUCKET_S = 1.0


def _figure(size_px: tuple[int, int]) -> Figure:
    return Figure(figsize=(size_px[0] / DPI, size_px[1] / DPI), dpi=DPI, layout="constrained")


def plot_file_stats(layers: Sequence[int], hidden: np.ndarray, out: str | Path, title: str = "") -> Path:
    """Two panels from ``hidden`` ``[T, num_layers, H]``: token norm per position and layer
    (log colour scale), and the mean cosine similarity between layers."""
    norms = token_norms(hidden)
    cosine = layer_cosine_similarity(hidden)
    labels = [str(layer) for layer in layers]
    figure = _figure(FILE_PLOT_PX)
    left, right = figure.subplots(1, 2, width_ratios=[2.2, 1])
    positive = norms[norms > 0]
    scale = LogNorm(vmin=positive.min(), vmax=positive.max()) if positive.size and positive.size == norms.size else None
    image = left.imshow(norms, aspect="auto", interpolation="nearest", norm=scale, cmap="viridis")
    left.set(title="token state norm ‖h‖ per position", xlabel="token position", ylabel="layer id",
             yticks=range(len(labels)), yticklabels=labels)
    figure.colorbar(image, ax=left)
    matrix = right.imshow(cosine, vmin=-1, vmax=1, cmap="RdBu_r", interpolation="nearest")
    right.set(title="mean cosine similarity between layers", xlabel="layer id", ylabel="layer id",
              xticks=range(len(labels)), xticklabels=labels, yticks=range(len(labels)), yticklabels=labels)
    if len(labels) <= 12:
        for i in range(len(labels)):
            for j in range(len(labels)):
                right.text(j, i, f"{cosine[i, j]:.2f}", ha="center", va="center", fontsize=8)
    figure.colorbar(matrix, ax=right)
    if title:
        figure.suptitle(title, fontsize=10)
    figure.savefig(out, dpi=DPI)
    return Path(out)


def plot_file(path: str | Path, out: str | Path) -> Path:
    """:func:`plot_file_stats` of a layertap file's ``hidden_states``."""
    layers, hidden = read_hidden_states(path)
    return plot_file_stats(layers, hidden, out, title=f"{Path(path).name}: {hidden.shape[0]} tokens")


def plot_throughput(points: Sequence[tuple[float, int]], out: str | Path, title: str = "") -> Path:
    """Tokens per second over time (bucketed) and jobs finished, from ``(finished_at, num_tokens)``."""
    figure = _figure(THROUGHPUT_PLOT_PX)
    axes = figure.subplots()
    axes.set(title=title or "throughput", xlabel="seconds since the first result", ylabel="tokens / s")
    if points:
        times = np.array([t for t, _ in points], dtype=np.float64)
        tokens = np.array([n for _, n in points], dtype=np.float64)
        times -= times[0]
        width = max(MIN_BUCKET_S, float(times[-1]) / MAX_BUCKETS)  # at most MAX_BUCKETS bars
        edges = np.arange(0.0, float(times[-1]) + width, width)
        edges = edges if len(edges) > 1 else np.array([0.0, width])
        per_bucket, _ = np.histogram(times, bins=edges, weights=tokens)
        axes.stairs(per_bucket / width, edges, fill=True, alpha=0.6, color="tab:blue", label="tokens / s")
        axes.set_xlim(edges[0], edges[-1])
        jobs_axis = axes.twinx()
        jobs_axis.plot(times, np.arange(1, len(times) + 1), color="tab:orange", label="jobs finished (ok)")
        jobs_axis.set_ylabel("jobs finished (ok)")
        jobs_axis.set_ylim(bottom=0)
    figure.savefig(out, dpi=DPI)
    return Path(out)
