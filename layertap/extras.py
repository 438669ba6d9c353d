"""Optional dependencies: which extra brings which module, and the one-line hint when one is missing.

The client install (``pip install layertap``) has no torch; commands and functions that need
an extra call :func:`need` (import a module) or :func:`require` (check before starting) and a
missing module becomes :class:`MissingExtra`, a ``RuntimeError`` the CLI prints as one line.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

#: Top-level module -> the extra that installs it.
EXTRA_OF = {
    "torch": "worker", "transformers": "worker", "tokenizers": "worker", "jinja2": "worker",
    "prometheus_client": "worker", "pythonjsonlogger": "worker",
    "datasets": "data", "pyarrow": "data", "ijson": "data",
    "matplotlib": "plots", "cudnn": "cudnn",
}
#: What ``layertap worker``, ``make-tiny-model``, ``demo`` and ``bench`` load.
WORKER_MODULES = ("torch", "transformers")


class MissingExtra(RuntimeError):
    """An optional dependency is not installed; the message says which extra to install."""


def hint(module: str, what: str, extra: str | None = None) -> str:
    """``"<what> needs <module>: pip install 'layertap[<extra>]'"`` (the extra from :data:`EXTRA_OF`
    unless given)."""
    top = module.split(".")[0]
    return f"{what} needs {top}, which is not installed: pip install 'layertap[{extra or EXTRA_OF.get(top, 'worker')}]'"


def need(module: str, what: str = "reading this input", extra: str | None = None) -> Any:
    """Import ``module`` (an optional dependency), or raise :class:`MissingExtra` saying how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingExtra(hint(module, what, extra)) from None


def require(what: str, modules: tuple[str, ...] = WORKER_MODULES) -> None:
    """Raise :class:`MissingExtra` if any of ``modules`` is not installed (checked without importing)."""
    for module in modules:
        if importlib.util.find_spec(module) is None:
            raise MissingExtra(hint(module, what))
