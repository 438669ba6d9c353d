"""A pytest plugin that records each test's outcome the moment it ends: ``-p tests.support.outcomes
--outcomes PATH`` appends one JSON line per test to ``PATH`` (its id, outcome, seconds, the
properties it recorded with ``record_property``, and a failure's last lines). A run cut off by a time
limit (a lent GPU's call) still leaves every finished test's line; ``benchmarks/gpu_sweep_summary.py``
reads them. Under pytest-xdist only the controller writes, so each test has one line; a setup or
teardown that fails gets its own line (``when``)."""

from __future__ import annotations

import json

import pytest

#: How much of a failure's report a line keeps (its end: the assertion and the error).
FAILURE_CHARS = 4000


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--outcomes", default=None, metavar="PATH",
                     help="append each test's outcome to PATH as a JSON line as soon as it ends")


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption("outcomes")
    if path and not hasattr(config, "workerinput"):  # not an xdist worker: the controller sees every report
        config.pluginmanager.register(OutcomeWriter(path), "layertap-outcomes")


class OutcomeWriter:
    """Appends a line to ``path`` for each test call, and for each setup or teardown that did not pass."""

    def __init__(self, path: str):
        self.path = path

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when != "call" and report.passed:
            return
        line = {"id": report.nodeid, "when": report.when, "outcome": report.outcome,
                "seconds": round(report.duration, 3),
                "properties": {name: value for name, value in report.user_properties},
                "failure": str(report.longrepr)[-FAILURE_CHARS:] if report.failed else ""}
        with open(self.path, "a") as out:
            out.write(json.dumps(line, default=repr) + "\n")
