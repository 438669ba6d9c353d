"""layertap's client side: the wire protocol, settings, submitting jobs, reading results
and files. Imports no torch.

Lazy: ``import layertap.producer`` imports nothing else; each public name imports its module on
first use, so a DataLoader process that only reads files never imports Celery or Redis.
"""

from __future__ import annotations

if __name__ == "producer":  # the deprecated top-level name, from a source tree: an alias, never a second copy
    from layertap.legacy_names import alias

    alias(__name__)

from importlib import import_module
from typing import Any

__version__ = "0.1.0"  # the package version (pyproject.toml reads it from here)

#: public name -> the module that holds it
_EXPORTS = {
    "Client": "layertap.producer.client.client",
    "FileFormatError": "layertap.protocol.fileformat",
    "cleanup_hidden_states": "layertap.producer.files.reader",
    "load_hidden_states": "layertap.producer.files.reader",
    "ChatMessage": "layertap.protocol.schema",
    "ErrorType": "layertap.protocol.schema",
    "Job": "layertap.protocol.schema",
    "Result": "layertap.protocol.schema",
    "Status": "layertap.protocol.schema",
    "Settings": "layertap.settings",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'layertap.producer' has no attribute {name!r}")
    value = getattr(import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this hook
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
