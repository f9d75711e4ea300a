"""``scripts/setup_env.sh`` and ``scripts/run_tests.sh`` on a python used as it is, as on a GPU host without a
package registry: nothing is installed, and every step whose tool that python lacks is skipped with a note that
names it, never silently. The python here is this one behind a shim that hides some packages (a
``sitecustomize`` makes the import system report them missing), the way a host python lacks them."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
HIDE = '''
import importlib.machinery
import os

_HIDDEN = set(os.environ.get("FASTVIDEO_TEST_HIDE", "").split())
_find_spec = importlib.machinery.PathFinder.find_spec.__func__


def _hiding_find_spec(cls, name, path=None, target=None):
    if name.partition(".")[0] in _HIDDEN:
        return None
    return _find_spec(cls, name, path, target)


importlib.machinery.PathFinder.find_spec = classmethod(_hiding_find_spec)
'''


def _shim(tmp_path: pathlib.Path, hidden: str) -> tuple[pathlib.Path, dict[str, str]]:
    site = tmp_path / "hide"
    site.mkdir()
    (site / "sitecustomize.py").write_text(HIDE)
    python = tmp_path / "bin" / "python"
    python.parent.mkdir()
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    env = {**os.environ, "FASTVIDEO_PYTHON": str(python), "FASTVIDEO_TEST_HIDE": hidden,
           "PYTHONPATH": f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "FASTVIDEO_SKIP_KERNEL_BUILD": "1"}
    env.pop("FASTVIDEO_MISSING", None)
    return python, env


def test_setup_uses_the_python_as_it_is_and_lists_what_it_lacks(tmp_path):
    python, env = _shim(tmp_path, "ruff clang_format matplotlib")
    script = 'source scripts/setup_env.sh && echo "PY=$PY" && echo "LACKS=$FASTVIDEO_MISSING"'
    proc = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.splitlines()
    assert f"PY={python}" in out and "LACKS=ruff clang-format matplotlib" in out
    assert "NOTE:" in proc.stdout and "lacks: ruff clang-format matplotlib" in proc.stdout
    assert "installing" not in proc.stdout + proc.stderr


def test_the_test_command_skips_what_the_python_lacks_and_says_so(tmp_path):
    _, env = _shim(tmp_path, "ruff clang_format pytest_timeout")
    # A python without pytest-timeout has no entry point for it either; this one has: do not load it.
    env["PYTEST_ADDOPTS"] = "-p no:timeout"
    env["FASTVIDEO_PYTEST_ARGS"] = "tests/test_rotary_embedding.py"
    proc = subprocess.run(["bash", "scripts/run_tests.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "== ruff: SKIPPED, not installed" in proc.stdout
    assert "== clang-format (csrc/): SKIPPED, not installed" in proc.stdout
    assert "== kernel build: SKIPPED (FASTVIDEO_SKIP_KERNEL_BUILD=1" in proc.stdout
    assert "4 passed" in proc.stdout and "failed" not in proc.stdout
    assert proc.stdout.splitlines()[-1].startswith(
        "== done; NOT RUN here: ruff, clang-format, kernel build, per-test timeouts (pytest-timeout)")


def test_negative_control_without_pytest_the_test_command_fails(tmp_path):
    _, env = _shim(tmp_path, "pytest")
    proc = subprocess.run(["bash", "scripts/run_tests.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 1 and "pytest is not installed" in proc.stderr
