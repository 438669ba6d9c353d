"""The package boundaries hold, checked by import-linter (contracts in ``pyproject.toml``):
no import cycles at any level, the client side free of the worker side and torch, the engine
free of Redis and Celery, file reading free of Celery and Redis, and both sides layered."""

from __future__ import annotations

import logging
from pathlib import Path

from importlinter.cli import lint_imports

ROOT = Path(__file__).resolve().parents[2]


def test_import_contracts_are_kept(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    loggers = [logger for logger in logging.Logger.manager.loggerDict.values() if isinstance(logger, logging.Logger)]
    enabled = [logger for logger in loggers if not logger.disabled]
    try:
        code = lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True, no_logo=True)
    finally:  # import-linter configures logging, disabling every logger that existed: later tests read them
        for logger in enabled:
            logger.disabled = False
    assert code == 0, capsys.readouterr().out[-6000:]
