"""``import layertap``: the one import name for users.

``from layertap import Client, load_hidden_states, Extractor``. The code lives in
``layertap.producer`` (the client side: no torch) and ``layertap.worker`` (the GPU side); in the
repository these are the top-level ``producer/`` and ``worker/`` folders, linked here. Lazy: each
name imports its module on first use, so importing this package imports neither torch nor
Celery; ``Extractor`` needs the ``[worker]`` extra.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from layertap.legacy_names import install as _install_old_names
from layertap.producer import __all__ as _producer_names
from layertap.producer import __version__

#: public name -> the package that holds it (the client side's names, and the worker's Extractor)
_EXPORTS = {**{name: "layertap.producer" for name in _producer_names if name != "__version__"},
            "Extractor": "layertap.worker"}

__all__ = ["__version__", *_EXPORTS]

_install_old_names()  # the kernel's old import paths (layertap.producer.protocol, ...) for one release


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'layertap' has no attribute {name!r}")
    value = getattr(import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
