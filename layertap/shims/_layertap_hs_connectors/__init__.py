"""Registers layertap's hs-connectors backend whenever ``hs_connectors`` is imported.

hs-connectors (0.9) finds backends only by their ``@HiddenStatesBackend.register(name)`` having
run, and speculators reads its registry when its trainer's config module is imported, so the
backend's module must be imported right after ``hs_connectors``. ``layertap-hs-connectors.pth``
(installed beside the packages, see ``setup.py``) imports this module when Python starts; it only
puts :class:`AfterHsConnectors` on ``sys.meta_path`` (no import of layertap, torch or
hs-connectors). When a process imports ``hs_connectors``, the finder hands the import to the
finders after it, and once the package has run, imports ``layertap.producer.trainers.hs_backend``
(which registers ``layertap``); then it takes itself off ``sys.meta_path``. If that import fails,
hs-connectors still works without the backend, and a warning says why.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

TARGET = "hs_connectors"
BACKEND = "layertap.producer.trainers.hs_backend"


class _ThenBackend(importlib.abc.Loader):
    """``hs_connectors``'s own loader, then the import of the backend's module."""

    def __init__(self, loader: importlib.abc.Loader):
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = module.__spec__.loader = self.loader  # the package sees its own loader
        self.loader.exec_module(module)
        try:
            importlib.import_module(BACKEND)
        except Exception as exc:  # noqa: BLE001 - hs-connectors must keep working without it
            warnings.warn(f"layertap's hs-connectors backend is not registered: importing {BACKEND} failed "
                          f"({type(exc).__name__}: {exc})", RuntimeWarning, stacklevel=2)


class AfterHsConnectors(importlib.abc.MetaPathFinder):
    """Finds ``hs_connectors`` through the finders after it and wraps its loader (module doc)."""

    def find_spec(self, fullname: str, path: object = None,
                  target: object = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = next((found for finder in sys.meta_path if (found := _find(finder, fullname, path, target)) is not None),
                    None)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _ThenBackend(spec.loader)
        return spec


def _find(finder: object, fullname: str, path: object, target: object) -> importlib.machinery.ModuleSpec | None:
    find_spec = getattr(finder, "find_spec", None)
    return find_spec(fullname, path, target) if find_spec is not None else None


def install() -> None:
    """Put the finder on ``sys.meta_path`` (once, and only while ``hs_connectors`` is not imported yet)."""
    if TARGET not in sys.modules and not any(isinstance(f, AfterHsConnectors) for f in sys.meta_path):
        sys.meta_path.insert(0, AfterHsConnectors())


install()
