"""Fixes that changed what some models' files hold, by model type.

A file's identity (``content_id``) names what decides its bytes, not the layertap release that
wrote it. Where a fix changes a model's files, the model's entry here goes into the identity of
every file the worker writes for it (``compute_fixes``): a file written before the fix lacks it,
so a worker no longer answers its job from that file, and writes it again when the job comes
again. Models without an entry keep their identities.

Invariant: entries are only ever added or extended (``"; "``-joined), never removed or edited, or
files written after a fix would be computed again for nothing.
"""

from __future__ import annotations

from typing import Any

_KOSMOS = "2026-12-03 packed positions numbered from 0, not from the padding id + 1 (now padded)"
#: model type (a config's ``model_type``, the top level's or its text config's) -> its fixes.
FIXES: dict[str, str] = {
    "deepseek_v4": "2026-12-05 padded batches picked other compressed-sparse key blocks than the prompt alone "
                   "(now one prompt per batch)",
    "doge": "2026-12-03 packed attention ran without its dynamic mask (now padded); 2026-12-05 padded batches kept "
            "other keys than the prompt alone past keep_window_size (now one prompt per batch)",
    "kosmos-2": _KOSMOS,
    "kosmos-2.5": _KOSMOS,
    "kosmos_2_text_model": _KOSMOS,
    "kosmos_2_5_text_model": _KOSMOS,
}


def fixes_of(config: Any) -> str:
    """The fixes of the model ``config`` describes (its own type's and its text config's, each
    once), or ""."""
    types = [config.model_type, config.get_text_config().model_type]
    return "; ".join(dict.fromkeys(FIXES[kind] for kind in types if kind in FIXES))
