"""The suite's progress lines (tests/conftest.py): a failing test is named the moment it fails, so a run cut by a
time limit (a GPU host's ten-minute call) still says what failed. Run on a two-test file in a subprocess, with the
conftest loaded as a plugin. Negative control: without ``--progress-every`` nothing is printed, so the line comes
from the plugin and not from pytest's own summary."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
TWO_TESTS = "def test_ok():\n    assert 1 + 1 == 2\n\n\ndef test_bad():\n    assert 1 + 1 == 3\n"


def _run(tmp_path: pathlib.Path, *args: str) -> str:
    (tmp_path / "test_two.py").write_text(TWO_TESTS)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider",
                           *args, str(tmp_path / "test_two.py")], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]  # one test fails
    return done.stdout


def test_a_failing_test_is_named_as_it_fails(tmp_path):
    lines = _run(tmp_path, "--progress-every=1").splitlines()
    failed = [line for line in lines if "progress: FAILED" in line]
    assert len(failed) == 1 and failed[0].endswith("test_two.py::test_bad (call)")
    assert any(line.startswith("progress: [2/2]") for line in lines)


def test_negative_control_without_progress_nothing_is_named_early(tmp_path):
    assert "progress:" not in _run(tmp_path)
