"""pytest plugin of the upstream-suite runner (``tests/overlay/upstream_suite.py`` loads it with ``-p``): every
test's outcome by node id, written as JSON to ``$FASTVIDEO_UPSTREAM_SUITE_OUTCOMES`` when the session ends.

An outcome is ``passed`` only when the call passed and neither setup nor teardown failed; ``failed``, ``error``
(setup, teardown or collection) and ``skipped`` otherwise (an expected failure counts as skipped).
"""

import json
import os

_OUTCOMES: dict[str, str] = {}


def pytest_runtest_logreport(report) -> None:
    if _OUTCOMES.get(report.nodeid) in ("failed", "error"):
        return
    if report.when == "call":
        _OUTCOMES[report.nodeid] = report.outcome
    elif report.failed:
        _OUTCOMES[report.nodeid] = "error"
    elif report.skipped:
        _OUTCOMES[report.nodeid] = "skipped"


def pytest_collectreport(report) -> None:
    if report.failed:
        _OUTCOMES[report.nodeid] = "error"


def pytest_sessionfinish(session) -> None:
    with open(os.environ["FASTVIDEO_UPSTREAM_SUITE_OUTCOMES"], "w") as f:
        json.dump(_OUTCOMES, f, indent=0, sort_keys=True)
