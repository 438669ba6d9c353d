"""The old import names ``producer`` and ``worker``, kept for one release (deprecated).

The wheel installs the code under ``layertap`` only, plus two one-line shim packages named
``producer`` and ``worker`` (``layertap/shims/``) that call :func:`alias`. Invariant: an old name
is never a second copy of a module; ``producer.x.y`` *is* ``layertap.producer.x.y`` (the same
object in ``sys.modules``), so classes and module state are shared. Removed in the next release.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

OLD_NAMES = ("producer", "worker")


class _AliasLoader(importlib.abc.Loader):
    """Returns the ``layertap.``-prefixed module itself; executes nothing."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(f"layertap.{spec.name}")

    def exec_module(self, module: ModuleType) -> None:
        pass


class _AliasFinder(importlib.abc.MetaPathFinder):
    """Finds ``producer.*`` and ``worker.*`` (never the packages' ``__main__``) as aliases."""

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        top, _, rest = fullname.partition(".")
        if top not in OLD_NAMES or not rest or fullname.endswith(".__main__"):
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader())


def alias(old: str) -> None:
    """Make ``sys.modules[old]`` (``producer`` or ``worker``) the ``layertap.`` package, with a
    ``DeprecationWarning`` naming the new import."""
    warnings.warn(f"`import {old}` is deprecated and goes away in the next release: import layertap.{old} "
                  f"(or `from layertap import ...`)", DeprecationWarning, stacklevel=3)
    if not any(isinstance(finder, _AliasFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AliasFinder())
    sys.modules[old] = importlib.import_module(f"layertap.{old}")
