"""The bench's prompts: random token ids, or a JSONL file."""

from __future__ import annotations

import json
import random
from typing import Any


def random_prompts(count: int, min_len: int, max_len: int, vocab: int, seed: int) -> list[list[int]]:
    """``count`` prompts of random token ids below ``vocab``, ``min_len`` to ``max_len`` tokens each (inclusive);
    the same for the same ``seed``."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(count)]


def file_prompts(path: str, tokenizer: Any, count: int) -> list[list[int]]:
    """Prompts from a JSONL file (``prompt`` or ``token_ids`` per line)."""
    prompts = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                row = json.loads(line)
                prompts.append(row["token_ids"] if "token_ids" in row else tokenizer(row["prompt"])["input_ids"])
            if len(prompts) >= count:
                break
    return prompts
