"""The code keeps the style ``pyproject.toml``'s ``[tool.ruff]`` declares: pyflakes' findings (unused
or undefined names), pycodestyle's errors and warnings (lines of at most 120 characters), imports
sorted and grouped (standard library, third party, then ``layertap`` and ``tests``), type hints on the
package's public functions' arguments and returns, and a docstring on its public functions and classes
(neither required in tests, benchmarks, examples)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ruff_finds_nothing():
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
                          cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
