"""Old import names, kept for one release (deprecated).

- ``producer`` and ``worker``: the wheel installs the code under ``layertap`` only, plus two
  one-line shim packages named ``producer`` and ``worker`` (``layertap/shims/``) that call :func:`alias`.
- The shared kernel's old homes under the client side (``layertap.producer.protocol``, ``.storage``,
  ``.transport``, ``.settings``, ``.extras``, ``.command``, ``.ops.throughput``): ``import layertap``
  installs :data:`KERNEL_MOVES` as aliases of ``layertap.protocol`` and the rest.

Invariant: an old name is never a second copy of a module; ``producer.x.y`` *is*
``layertap.producer.x.y`` and ``layertap.producer.protocol.keys`` *is* ``layertap.protocol.keys``
(the same object in ``sys.modules``), so classes and module state are shared. Removed in the next release.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

OLD_NAMES = ("producer", "worker")

#: old module prefix -> its home now (the kernel both sides share moved out of the client side)
KERNEL_MOVES = {f"layertap.producer.{name}": f"layertap.{name}"
                for name in ("protocol", "storage", "transport", "settings", "extras", "command")}
KERNEL_MOVES["layertap.producer.ops.throughput"] = "layertap.rates"


class _AliasLoader(importlib.abc.Loader):
    """Returns the module named ``target`` itself; executes nothing and leaves its ``__spec__`` as it was."""

    def __init__(self, target: str) -> None:
        self.target = target
        self._target_spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.target)
        self._target_spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self._target_spec  # the import system set the alias's spec on the shared module


def _moved(fullname: str) -> str | None:
    """The module an old name stands for, or None."""
    top, _, rest = fullname.partition(".")
    if top in OLD_NAMES and rest and not fullname.endswith(".__main__"):
        return f"layertap.{fullname}"
    for old, new in KERNEL_MOVES.items():
        if fullname == old or fullname.startswith(old + "."):
            warnings.warn(f"`{old}` moved to `{new}`; the old name goes away in the next release",
                          DeprecationWarning, stacklevel=4)
            return new + fullname[len(old):]
    return None


class _AliasFinder(importlib.abc.MetaPathFinder):
    """Finds ``producer.*``, ``worker.*`` (never the packages' ``__main__``) and the kernel's old
    homes as aliases."""

    def find_spec(self, fullname: str, path: object = None,
                  target: object = None) -> importlib.machinery.ModuleSpec | None:
        new = _moved(fullname)
        return None if new is None else importlib.machinery.ModuleSpec(fullname, _AliasLoader(new))


def install() -> None:
    """Put the alias finder first on ``sys.meta_path`` (once)."""
    if not any(isinstance(finder, _AliasFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AliasFinder())


def alias(old: str) -> None:
    """Make ``sys.modules[old]`` (``producer`` or ``worker``) the ``layertap.`` package, with a
    ``DeprecationWarning`` naming the new import."""
    warnings.warn(f"`import {old}` is deprecated and goes away in the next release: import layertap.{old} "
                  f"(or `from layertap import ...`)", DeprecationWarning, stacklevel=3)
    install()
    sys.modules[old] = importlib.import_module(f"layertap.{old}")
