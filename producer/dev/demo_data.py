"""The demo's bundled inputs: a few prompts and chats (``data/demo_jobs.jsonl``)."""

from __future__ import annotations

import json
from importlib import resources
from typing import Any


def demo_jobs() -> list[dict[str, Any]]:
    """The demo's jobs as raw job data: one dict (a prompt or a chat) per line of ``data/demo_jobs.jsonl``."""
    text = resources.files("layertap.producer").joinpath("data/demo_jobs.jsonl").read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]
