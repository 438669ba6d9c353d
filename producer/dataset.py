"""The public path ``producer.dataset`` (``HiddenStatesDataset``, ``StreamingHiddenStatesDataset``,
``collate``): a thin re-export of ``producer.files.dataset``."""

from typing import Any

from producer.files import dataset as _dataset
from producer.files.dataset import HiddenStatesDataset, collate, load_item

__all__ = ["HiddenStatesDataset", "StreamingHiddenStatesDataset", "collate", "load_item"]  # noqa: F822 (lazy)


def __getattr__(name: str) -> Any:
    return getattr(_dataset, name)  # StreamingHiddenStatesDataset: imported on first use (it needs torch)
