"""The ambient-settings rule of ``tests/conftest.py``: what a test sees (the shell's value or each value
for what it names, a pinned default for the rest, never the shell's). Inner suites run in-process
through ``pytester`` with a copy of the real conftest."""

from __future__ import annotations

import os
import re
import shutil
import types
from pathlib import Path

import pytest

from fastvideo import envs
from tests.conftest import AMBIENT_VARS, PINNED, ambient_vars

ROOT = Path(__file__).resolve().parents[1]
A2A, LONG = AMBIENT_VARS

INNER = f'''
import pytest
from fastvideo import envs

def test_reads_without_marker():
    assert envs.get("{LONG}") == "auto" and envs.get("{A2A}") == "off"  # pinned, whatever the shell says

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
    assert envs.get("{A2A}") == "off"
'''


@pytest.fixture
def inner(pytester: pytest.Pytester) -> pytest.Pytester:
    shutil.copy(ROOT / "tests" / "conftest.py", pytester.path / "conftest.py")
    pytester.makeini("[pytest]\nmarkers =\n    ambient: reads the transport settings\n")
    pytester.makepyfile(test_inner=INNER)
    return pytester


def test_all_runs_marked_tests_once_per_value_and_pins_the_rest(inner, monkeypatch):
    monkeypatch.setenv(A2A, "auto")  # the shell's values must not reach what a test does not name
    monkeypatch.setenv(LONG, "chunked")
    result = inner.runpytest_inprocess("--ulysses-ambient=all", "-p", "no:cacheprovider", "-v")
    # 1 + 1 + 2 (long) + 4 (both) + 2 (long; the route pinned) = 10 runs
    result.assert_outcomes(passed=10)
    out = result.stdout.str()
    assert "test_reads_long[long=auto] PASSED" in out and "test_reads_long[long=chunked] PASSED" in out
    assert "test_reads_both[a2a=auto,long=chunked] PASSED" in out
    assert "test_reads_without_marker PASSED" in out
    assert "test_reads_route_but_names_only_long[long=chunked] PASSED" in out


def test_negative_control_a_shell_value_would_reach_an_unpinned_test(inner, monkeypatch):
    """Without the pin (the fixture disabled), the shell's value reaches the test: the rule is what stops it."""
    monkeypatch.setenv(LONG, "chunked")
    inner.makeconftest("import pytest\n@pytest.fixture(autouse=True)\ndef ulysses_ambient():\n    return {}\n")
    result = inner.runpytest_inprocess("-p", "no:cacheprovider", "-k", "test_reads_without_marker")
    result.assert_outcomes(failed=1)


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


def test_unmarked_test_sees_the_pinned_values():
    assert all(os.environ[name] == PINNED[name] for name in AMBIENT_VARS)
    assert envs.get(A2A) == "off" and envs.get(LONG) == "auto"


@pytest.mark.ambient(LONG)
def test_marked_test_sees_its_value_and_the_pin_for_the_other():
    assert envs.get(LONG) in ("auto", "chunked") and os.environ[A2A] == PINNED[A2A]


def test_marker_naming_another_variable_is_a_usage_error():
    node = types.SimpleNamespace(nodeid="t", get_closest_marker=lambda _: pytest.mark.ambient("FASTVIDEO_X").mark)
    with pytest.raises(pytest.UsageError, match="FASTVIDEO_X"):
        ambient_vars(node)


def _rank_env(rank, world_size):
    return [os.environ.get(name) for name in AMBIENT_VARS]


def test_gloo_ranks_see_what_the_test_sees():
    """The forkserver's children get this test's values, not the environment the forkserver started with."""
    from tests.distributed import mp

    assert mp.run_ranks(1, _rank_env) == [[PINNED[A2A], PINNED[LONG]]]


def _checked_switches(rank, world_size):
    import torch.distributed as dist

    return os.environ.get("FASTVIDEO_ULYSSES_A2A_CHECKED"), os.environ.get("TORCH_DISTRIBUTED_DEBUG"), \
        dist.get_debug_level().name


def test_checked_mode_switches_are_pinned_in_the_ranks_too(monkeypatch):
    """Every test's ranks see the checked mode pinned off (CHECKED=auto, torch's debug level OFF), whatever
    the forkserver's environment; control: a test that sets DETAIL gets DETAIL in its ranks, torch's level
    included (each rank re-reads it, as a fresh process does)."""
    from tests.distributed import mp

    assert mp.run_ranks(1, _checked_switches) == [("auto", None, "OFF")]
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
    assert mp.run_ranks(1, _checked_switches) == [("auto", "DETAIL", "DETAIL")]


# Reading os.environ directly would bypass validation and the settings agreement: every read of these
# two variables must go through fastvideo.envs.
_DIRECT_READ = re.compile(
    r"""(os\.getenv|os\.environ\.get|environ\.get)\(\s*["']FASTVIDEO_ULYSSES_A2A"""
    r"""|os\.environ\[\s*["']FASTVIDEO_ULYSSES_A2A[A-Z_]*["']\s*\](?!\s*=[^=])"""
)


def test_code_reads_the_transport_settings_only_through_envs():
    assert _DIRECT_READ.search('x = os.environ.get("FASTVIDEO_ULYSSES_A2A")')  # the pattern can match
    assert _DIRECT_READ.search("if os.environ['FASTVIDEO_ULYSSES_A2A_LONG_TRAINING'] == 'auto':")
    assert not _DIRECT_READ.search('os.environ["FASTVIDEO_ULYSSES_A2A"] = route')  # a write is fine
    # The code under test and the programs tests launch; a test itself may inspect os.environ.
    # Upstream's edited tests (fastvideo/tests/) are upstream's files, outside this package's checks.
    programs = [*(p for p in (ROOT / "fastvideo").rglob("*.py") if (ROOT / "fastvideo" / "tests") not in p.parents),
                *(ROOT / "benchmarks").rglob("*.py"), *(ROOT / "tests").rglob("check_*.py"),
                *(ROOT / "tests").rglob("smoke_*.py")]
    offenders = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in sorted(programs)
        if path != ROOT / "fastvideo" / "envs.py"
        for n, text in enumerate(path.read_text().splitlines(), 1)
        if _DIRECT_READ.search(text)
    ]
    assert not offenders, f"read these through fastvideo.envs.get: {offenders}"
