"""Per-turn rows of random conversations, and how far a run's files are from plain transformers on each row alone."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from layertap.producer.files.reader import load_hidden_states
from tests.support.reference import block_input_states


def conversations(count: int, turns: Sequence[int], seed: int = 0) -> list[list[list[int]]]:
    """``count`` random conversations of ``max(turns)`` tokens, each as its rows: the conversation
    through each turn (its first ``turns[k]`` tokens)."""
    generator = torch.Generator().manual_seed(seed)
    chats = [torch.randint(3, 120, (max(turns),), generator=generator).tolist() for _ in range(count)]
    return [[chat[:length] for length in turns] for chat in chats]


def worst_error(model_dir: str, rows: list[list[int]], paths: list[str], layers: list[int]) -> float:
    """The largest per-token relative error of the files' states against each row run alone."""
    worst = 0.0
    for ids, path in zip(rows, paths):
        got = load_hidden_states(path)["hidden_states"].double().flatten(2)
        reference = block_input_states(model_dir, ids, layers).double().flatten(2)
        worst = max(worst, float(((got - reference).norm(dim=-1) / reference.norm(dim=-1).clamp_min(1e-30)).max()))
    return worst
