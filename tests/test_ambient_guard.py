"""The ambient-settings rule of ``tests/conftest.py``: what a test sees, and that a reader without the
marker fails. Inner suites run in-process through ``pytester`` with a copy of the real conftest."""

from __future__ import annotations

import os
import re
import shutil
import types
from pathlib import Path

import pytest

from fastvideo import envs
from tests.conftest import AMBIENT_VARS, UNPINNED, ambient_vars

ROOT = Path(__file__).resolve().parents[1]
A2A, LONG = AMBIENT_VARS

INNER = f'''
import pytest
from fastvideo import envs

def test_reads_without_marker():
    envs.get("{LONG}")

def test_reads_nothing():
    pass

@pytest.mark.ambient("{LONG}")
def test_reads_long(ulysses_ambient):
    assert envs.get("{LONG}") in ("auto", "chunked")

@pytest.mark.ambient
def test_reads_both():
    envs.get("{A2A}"), envs.get("{LONG}")

@pytest.mark.ambient("{LONG}")
def test_reads_route_but_names_only_long():
    envs.get("{A2A}")
'''


@pytest.fixture
def inner(pytester: pytest.Pytester) -> pytest.Pytester:
    shutil.copy(ROOT / "tests" / "conftest.py", pytester.path / "conftest.py")
    pytester.makeini("[pytest]\nmarkers =\n    ambient: reads the transport settings\n")
    pytester.makepyfile(test_inner=INNER)
    return pytester


def test_all_runs_marked_tests_once_per_value_and_fails_unmarked_readers(inner):
    result = inner.runpytest_inprocess("--ulysses-ambient=all", "-p", "no:cacheprovider", "-v")
    # 1 + 1 + 2 (long) + 4 (both) + 2 (long, but reads the route: fails under each) = 10 runs
    result.assert_outcomes(passed=7, failed=3)
    out = result.stdout.str()
    assert "test_reads_long[long=auto] PASSED" in out and "test_reads_long[long=chunked] PASSED" in out
    assert "test_reads_both[a2a=auto,long=chunked] PASSED" in out
    assert "test_reads_without_marker FAILED" in out
    assert f"{LONG}='{UNPINNED}' is not valid" in out  # the failure names the variable and the rule
    assert "test_reads_route_but_names_only_long[long=auto] FAILED" in out


def test_inherit_gives_marked_tests_the_shells_values(inner, monkeypatch):
    monkeypatch.setenv(LONG, "chunked")
    monkeypatch.setenv(A2A, "auto")
    inner.makepyfile(test_shell=f'''
import os, pytest

@pytest.mark.ambient
def test_shell():
    assert os.environ["{A2A}"] == "auto" and os.environ["{LONG}"] == "chunked"
''')
    result = inner.runpytest_inprocess("test_shell.py", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


def test_unmarked_test_sees_the_sentinel():
    assert all(os.environ[name] == UNPINNED for name in AMBIENT_VARS)
    with pytest.raises(ValueError, match=re.escape("tests/conftest.py")):
        envs.get(A2A)


@pytest.mark.ambient(LONG)
def test_marked_test_sees_a_valid_value_only_for_the_variable_it_names():
    assert envs.get(LONG) in ("auto", "chunked") and os.environ[A2A] == UNPINNED


def test_marker_naming_another_variable_is_a_usage_error():
    node = types.SimpleNamespace(nodeid="t", get_closest_marker=lambda _: pytest.mark.ambient("FASTVIDEO_X").mark)
    with pytest.raises(pytest.UsageError, match="FASTVIDEO_X"):
        ambient_vars(node)


def _rank_env(rank, world_size):
    return [os.environ.get(name) for name in AMBIENT_VARS]


def test_gloo_ranks_see_what_the_test_sees():
    """The forkserver's children get this test's values, not the environment the forkserver started with."""
    from tests.distributed import mp

    assert mp.run_ranks(1, _rank_env) == [[UNPINNED, UNPINNED]]


# Reading os.environ directly would see the sentinel as an ordinary string (no error): every read of
# these two variables must go through fastvideo.envs.
_DIRECT_READ = re.compile(
    r"""(os\.getenv|os\.environ\.get|environ\.get)\(\s*["']FASTVIDEO_ULYSSES_A2A"""
    r"""|os\.environ\[\s*["']FASTVIDEO_ULYSSES_A2A[A-Z_]*["']\s*\](?!\s*=[^=])"""
)


def test_code_reads_the_transport_settings_only_through_envs():
    assert _DIRECT_READ.search('x = os.environ.get("FASTVIDEO_ULYSSES_A2A")')  # the pattern can match
    assert _DIRECT_READ.search("if os.environ['FASTVIDEO_ULYSSES_A2A_LONG_TRAINING'] == 'auto':")
    assert not _DIRECT_READ.search('os.environ["FASTVIDEO_ULYSSES_A2A"] = route')  # a write is fine
    # The code under test and the programs tests launch; a test itself may inspect os.environ.
    programs = [*(ROOT / "fastvideo").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py"),
                *(ROOT / "tests").rglob("check_*.py"), *(ROOT / "tests").rglob("smoke_*.py")]
    offenders = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in sorted(programs)
        if path != ROOT / "fastvideo" / "envs.py"
        for n, text in enumerate(path.read_text().splitlines(), 1)
        if _DIRECT_READ.search(text)
    ]
    assert not offenders, f"read these through fastvideo.envs.get: {offenders}"
