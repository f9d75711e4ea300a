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


def _first_chunks(order: list, workers: int) -> list[list]:
    """What pytest -n's work stealing first hands each worker (xdist's ``WorkStealingScheduling.check_schedule``:
    the i-th of k idle workers takes ``len(pending) // (k - i)`` of the tests still pending, from the front)."""
    chunks, pending = [], list(order)
    for i in range(workers):
        take = len(pending) // (workers - i)
        chunks.append(pending[:take])
        pending = pending[take:]
    return chunks


def test_slow_tests_start_at_once_on_every_worker():
    from tests.conftest import slow_at_chunk_heads

    slow, rest = [f"slow{i}" for i in range(5)], [f"t{i}" for i in range(97)]
    for workers in (1, 2, 3, 8):
        order = slow_at_chunk_heads(slow, rest, workers)
        assert sorted(order) == sorted(slow + rest)  # each test once
        assert [t for t in order if t in rest] == rest and [t for t in order if t in slow] == sorted(
            slow, key=lambda t: (int(t[4:]) % workers, int(t[4:])))  # each list keeps its own order per chunk
        heads = [chunk[0] for chunk in _first_chunks(order, workers)]
        assert heads[:min(workers, len(slow))] == slow[:workers], (workers, heads)
    # Negative control: slow tests merely collected first all land in the first worker's chunk.
    first, second = _first_chunks(slow + rest, 2)
    assert set(slow) <= set(first) and second[0] in rest


def test_a_files_slow_tests_share_one_workers_chunk():
    """Two slow tests of one file (a module fixture they share) start on one worker; the others' go to the rest."""
    from tests.conftest import slow_at_chunk_heads

    slow = ["a.py::r1", "a.py::r2", "b.py::o", "c.py::u1", "c.py::u2"]
    rest = [f"t{i}" for i in range(45)]
    first, second = _first_chunks(slow_at_chunk_heads(slow, rest, 2), 2)
    assert (first[:3], second[:2]) == (["a.py::r1", "a.py::r2", "b.py::o"], ["c.py::u1", "c.py::u2"])
    # Negative control: round robin by test would split c.py's two between the workers.
    robin = [slow[j::2] for j in range(2)]
    assert "c.py::u1" in robin[1] and "c.py::u2" in robin[0]
