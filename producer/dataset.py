"""The public path ``producer.dataset``: a thin re-export of ``producer.files.dataset`` and, on
first use (it needs torch at import), ``producer.files.streaming.StreamingHiddenStatesDataset``."""

from typing import Any

from producer.files.dataset import HiddenStatesDataset, collate, load_item

__all__ = ["HiddenStatesDataset", "StreamingHiddenStatesDataset", "collate", "load_item"]  # noqa: F822 (lazy)


def __getattr__(name: str) -> Any:
    if name == "StreamingHiddenStatesDataset":
        from producer.files.streaming import StreamingHiddenStatesDataset

        return StreamingHiddenStatesDataset
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
