"""The outcome log the GPU sweeps are read from (``tests.support.outcomes``): one line per test as
it ends, with the properties it recorded, under pytest-xdist too."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

TESTS = '''
import pytest

@pytest.mark.parametrize("n", [1, 2, 3])
def test_recorded(n, record_property):
    record_property("batching", "packed")
    record_property("errors", [[n, [0.5 * n]]])

def test_failing():
    assert 1 == 2, "one is not two"

@pytest.fixture
def broken():
    raise RuntimeError("the fixture broke")

def test_with_a_broken_fixture(broken):
    pass
'''


def test_each_test_gets_one_line_with_its_properties_under_xdist(tmp_path):
    (tmp_path / "test_sample.py").write_text(TESTS)
    log = tmp_path / "outcomes.jsonl"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider",
                           "-n", "2", "-p", "tests.support.outcomes", "--outcomes", str(log), str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr  # one test fails, one errors
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    by_id = {(line["id"].split("::")[-1], line["when"]): line for line in lines}
    assert len(by_id) == len(lines) == 5, lines
    for n in (1, 2, 3):
        line = by_id[(f"test_recorded[{n}]", "call")]
        assert line["outcome"] == "passed" and line["failure"] == ""
        assert line["properties"] == {"batching": "packed", "errors": [[n, [0.5 * n]]]}
    assert by_id[("test_failing", "call")]["outcome"] == "failed"
    assert "one is not two" in by_id[("test_failing", "call")]["failure"]
    broken = by_id[("test_with_a_broken_fixture", "setup")]
    assert broken["outcome"] == "failed" and "the fixture broke" in broken["failure"]
