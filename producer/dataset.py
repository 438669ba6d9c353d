"""The public path ``layertap.producer.dataset``: a thin re-export of ``layertap.producer.files.dataset`` and, on
first use (it needs torch at import), ``layertap.producer.files.streaming.StreamingHiddenStatesDataset``."""

from typing import Any

from layertap.producer.files.dataset import HiddenStatesDataset, collate, load_item

__all__ = ["HiddenStatesDataset", "StreamingHiddenStatesDataset", "collate", "load_item"]  # noqa: F822 (lazy)


def __getattr__(name: str) -> Any:
    if name == "StreamingHiddenStatesDataset":
        from layertap.producer.files.streaming import StreamingHiddenStatesDataset

        return StreamingHiddenStatesDataset
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
