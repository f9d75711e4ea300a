"""``fastvideo/envs.py`` is upstream FastVideo 0.2.1's registry plus this package's: every upstream variable with
upstream's name, default and parsing, read through ``envs.NAME``, ``envs.get`` and ``environment_variables``.

Two checks. The committed table below (``UPSTREAM``: each upstream variable's value when unset and its parsing kind,
every kind pinned by explicit samples) always runs. The live comparison loads upstream's own ``envs.py`` from the
pinned wheel (``tests/upstream_tree.py``: skipped with the reason where it cannot be had offline, a failure under
CI) and compares it with this module on every sample, and the committed table with upstream's names, so the table
cannot drift from what it describes. Negative controls: a reader with another parsing fails the sample check, and
the one deliberate difference (``FASTVIDEO_ULYSSES_A2A``'s validation) is asserted as a difference.
"""

from __future__ import annotations

import importlib.util
import math
import os
import pathlib
import pickle

import pytest

from fastvideo import envs
from tests import upstream_tree

HOME = "/home/fv-test"
RAISES = ValueError  # what upstream's casts raise on a value they refuse

# Each parsing kind of upstream's, pinned by samples: raw value -> expected value (type included) or RAISES.
KINDS: dict[str, dict[str, object]] = {
    "text": {"": "", "0": "0", " Mixed Case ": " Mixed Case ", "~/x": "~/x"},
    "int": {"7": 7, " 7 ": 7, "-3": -3, "0": 0, "": RAISES, "1.5": RAISES, "x": RAISES},
    "float": {"0.5": 0.5, " 2 ": 2.0, "1": 1.0, "": RAISES, "x": RAISES},
    "not_zero": {"0": False, "1": True, "": True, "false": True, " 0": True, "00": True},
    "int_flag": {"0": False, "1": True, "2": True, " 1 ": True, "": RAISES, "true": RAISES},
    "path": {"~/x": f"{HOME}/x", "/abs": "/abs", "": "", "rel": "rel"},
    "precompiled": {"": False, "0": True, "1": True},
}

# Upstream 0.2.1's variables: (name, value when unset with HOME=/home/fv-test and no XDG_* set, parsing kind).
UPSTREAM: list[tuple[str, object, str]] = [
    ("FASTVIDEO_TARGET_DEVICE", "cuda", "text"),
    ("MAX_JOBS", None, "text"),
    ("NVCC_THREADS", None, "text"),
    ("FASTVIDEO_USE_PRECOMPILED", False, "precompiled"),
    ("CMAKE_BUILD_TYPE", None, "text"),
    ("VERBOSE", False, "int_flag"),
    ("FASTVIDEO_CONFIG_ROOT", f"{HOME}/.config/fastvideo", "path"),
    ("FASTVIDEO_CACHE_ROOT", f"{HOME}/.cache/fastvideo", "path"),
    ("FASTVIDEO_HOST_IP", "", "text"),
    ("FASTVIDEO_LOOPBACK_IP", "", "text"),
    ("FASTVIDEO_RAY_PER_WORKER_GPUS", 1.0, "float"),
    ("FASTVIDEO_RINGBUFFER_WARNING_INTERVAL", 60, "int"),
    ("FASTVIDEO_NCCL_SO_PATH", None, "text"),
    ("LD_LIBRARY_PATH", None, "text"),
    ("FASTVIDEO_TEST_DYNAMO_FULLGRAPH_CAPTURE", True, "not_zero"),
    ("LOCAL_RANK", 0, "int"),
    ("CUDA_VISIBLE_DEVICES", None, "text"),
    ("FASTVIDEO_ENGINE_ITERATION_TIMEOUT_S", 60, "int"),
    ("FASTVIDEO_CONFIGURE_LOGGING", 1, "int"),
    ("FASTVIDEO_LOGGING_CONFIG_PATH", None, "text"),
    ("FASTVIDEO_LOGGING_LEVEL", "INFO", "text"),
    ("FASTVIDEO_LOGGING_PREFIX", "", "text"),
    ("FASTVIDEO_TRACE_FUNCTION", 0, "int"),
    ("FASTVIDEO_ATTENTION_BACKEND", None, "text"),
    ("FASTVIDEO_FA4", False, "not_zero"),
    ("FASTVIDEO_MINIMAX_H3_FA4_PACKED_VARLEN", False, "not_zero"),
    ("FASTVIDEO_INFERENCE_TORCH_COMPILE", False, "not_zero"),
    ("FASTVIDEO_VAE_PARALLEL_DECODE", False, "not_zero"),
    ("FASTVIDEO_VAE_PARALLEL_ENCODE", False, "not_zero"),
    ("FASTVIDEO_VAE_PARALLEL_DECODE_STRATEGY", None, "text"),
    ("FASTVIDEO_MINIMAX_H3_FUSIONS", "", "text"),
    ("FASTVIDEO_ULYSSES_A2A", "off", "ulysses"),
    ("FASTVIDEO_WORKER_MULTIPROC_METHOD", "spawn", "text"),
    ("FASTVIDEO_NVTX_PROFILE", False, "not_zero"),
    ("FASTVIDEO_TORCH_PROFILER_DIR", None, "path"),
    ("FASTVIDEO_TORCH_PROFILER_RECORD_SHAPES", False, "not_zero"),
    ("FASTVIDEO_TORCH_PROFILER_WITH_PROFILE_MEMORY", False, "not_zero"),
    ("FASTVIDEO_TORCH_PROFILER_WITH_STACK", False, "not_zero"),
    ("FASTVIDEO_TORCH_PROFILER_WITH_FLOPS", False, "not_zero"),
    ("FASTVIDEO_TORCH_PROFILE_REGIONS", "", "text"),
    ("FASTVIDEO_TRACE_ACTIVATIONS", False, "not_zero"),
    ("FASTVIDEO_TRACE_LAYERS", "", "text"),
    ("FASTVIDEO_TRACE_STATS", "abs_mean,sum", "text"),
    ("FASTVIDEO_TRACE_OUTPUT", "/tmp/fv_trace_<pid>.jsonl", "text"),
    ("FASTVIDEO_TRACE_STEPS", "", "text"),
    ("FASTVIDEO_SERVER_DEV_MODE", False, "int_flag"),
    ("FASTVIDEO_STAGE_LOGGING", False, "int_flag"),
    ("FASTVIDEO_CFG_GATE_STEP", 1.0, "float"),
]
NAMES = [name for name, _, _ in UPSTREAM]
# Every raw value any kind is sampled with, for the live comparison (each variable is read with all of them).
ALL_SAMPLES = sorted({raw for samples in KINDS.values() for raw in samples} | {"auto", " AUTO ", "on", "off"})


@pytest.fixture
def clean_env(monkeypatch):
    """No FastVideo variable set, a fixed HOME and no XDG roots: defaults are then the table's."""
    for name in {*NAMES, *envs.environment_variables, "FASTVIDEO_PRECOMPILED_WHEEL_LOCATION", "XDG_CACHE_HOME",
                 "XDG_CONFIG_HOME"}:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", HOME)
    return monkeypatch


def _outcome(read):
    """What one read gives: ``("value", type, value)`` or ``("raises", exception type)``. ``envs.NAME``'s value is
    compared as the plain value it wraps with ``.override`` (what it pickles as)."""
    try:
        value = read()
    except Exception as exc:  # noqa: BLE001 - the exception type is the outcome compared
        return ("raises", type(exc))
    if hasattr(value, "override"):
        value = pickle.loads(pickle.dumps(value))
    return ("value", type(value), value)


def _expected(value):
    return ("raises", value) if value is RAISES else ("value", type(value), value)


def _check_samples(read_of, name: str, kind: str, monkeypatch) -> list[str]:
    """Every sample of ``kind`` through ``read_of(name)``; the mismatches, described."""
    wrong = []
    for raw, want in KINDS[kind].items():
        monkeypatch.setenv(name, raw)
        got = _outcome(lambda: read_of(name))
        if got != _expected(want):
            wrong.append(f"{name}={raw!r}: got {got}, want {_expected(want)}")
    return wrong


def test_every_upstream_name_is_read_the_three_ways():
    assert envs.upstream_names() == tuple(NAMES)
    assert list(envs.environment_variables)[: len(NAMES)] == NAMES  # upstream's order, then this package's
    assert set(envs.registry()) <= set(envs.environment_variables)  # Ray copies ours to its workers too
    assert set(NAMES) <= set(dir(envs))
    for name in envs.environment_variables:
        assert envs.describe(name)


@pytest.mark.parametrize("name,default,kind", UPSTREAM, ids=NAMES)
def test_upstream_variable_default_and_parsing(name, default, kind, clean_env):
    """The committed table: the value when unset, and every sample of its kind, through all three readers."""
    readers = {"envs.NAME": lambda n: getattr(envs, n), "envs.get": envs.get,
               "environment_variables": lambda n: envs.environment_variables[n]()}
    for how, read in readers.items():
        clean_env.delenv(name, raising=False)
        assert _outcome(lambda: read(name)) == _expected(default), how  # noqa: B023 - called at once
        if kind != "ulysses":
            assert _check_samples(read, name, kind, clean_env) == [], how


def test_doc_lists_upstream_variables_with_their_defaults():
    """docs/env_vars.md's section of upstream's variables: every name, in order, with its unset value."""
    doc = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "env_vars.md").read_text()
    section = doc.split("## Upstream FastVideo's variables")[1].split("\n## ")[0]
    rows = [line.split(" | ") for line in section.splitlines() if line.startswith("| `")]
    assert [row[0].strip("| `") for row in rows] == NAMES
    for (_, default, _), row in zip(UPSTREAM, rows, strict=True):
        shown = "None" if default is None else f"`{str(default).replace(HOME, '~')}`"
        assert row[2] == shown, row[0]


def test_precompiled_wheel_location_counts(clean_env):
    clean_env.setenv("FASTVIDEO_PRECOMPILED_WHEEL_LOCATION", "/wheels/x.whl")
    assert bool(envs.FASTVIDEO_USE_PRECOMPILED) is True and envs.get("FASTVIDEO_USE_PRECOMPILED") is True


def test_xdg_roots_move_the_defaults(clean_env):
    clean_env.setenv("XDG_CACHE_HOME", "/xdg/cache")
    clean_env.setenv("XDG_CONFIG_HOME", "~/cfg")
    assert envs.FASTVIDEO_CACHE_ROOT == "/xdg/cache/fastvideo"
    assert envs.FASTVIDEO_CONFIG_ROOT == f"{HOME}/cfg/fastvideo"
    assert envs.get_default_cache_root() == "/xdg/cache" and envs.maybe_convert_int("3") == 3
    assert envs.maybe_convert_int(None) is None


def test_sample_check_catches_another_parsing(clean_env):
    """Negative control: a flag parsed as ``bool(raw)`` (so ``"0"`` is True) fails the not-zero samples."""
    wrong = _check_samples(lambda n: bool(os.environ.get(n, "0")), "FASTVIDEO_FA4", "not_zero", clean_env)
    assert wrong and any("'0'" in w for w in wrong)


def test_upstream_variables_assign_as_upstream_and_ours_refuse(monkeypatch):
    """Upstream's module stores an assigned attribute, which then answers ``envs.NAME``; so does this one for
    upstream's names. This package's agreed settings refuse (``tests/test_envs.py``)."""
    # Assigned and deleted by hand: how pytest's monkeypatch restores a module attribute that only __getattr__
    # answered differs between pytest releases.
    monkeypatch.setenv("FASTVIDEO_ATTENTION_BACKEND", "FLASH_ATTN")
    assert "FASTVIDEO_ATTENTION_BACKEND" not in vars(envs)
    envs.FASTVIDEO_ATTENTION_BACKEND = "TORCH_SDPA"
    try:
        assert envs.FASTVIDEO_ATTENTION_BACKEND == "TORCH_SDPA"
    finally:
        del envs.FASTVIDEO_ATTENTION_BACKEND
    assert "FASTVIDEO_ATTENTION_BACKEND" not in vars(envs)
    assert envs.FASTVIDEO_ATTENTION_BACKEND == "FLASH_ATTN"  # read from the environment again
    with pytest.raises(AttributeError, match="cannot be assigned"):
        envs.FASTVIDEO_ULYSSES_A2A = "auto"


def test_added_readers_are_answered_as_upstream(monkeypatch):
    monkeypatch.setitem(envs.environment_variables, "FASTVIDEO_EXTRA_TEST", lambda: 42)
    assert envs.FASTVIDEO_EXTRA_TEST == 42 and envs.get("FASTVIDEO_EXTRA_TEST") == 42
    monkeypatch.undo()
    with pytest.raises(AttributeError, match="FASTVIDEO_EXTRA_TEST"):
        envs.FASTVIDEO_EXTRA_TEST  # noqa: B018


def test_upstream_variables_are_not_validated_with_ours(monkeypatch):
    """Upstream parses its variables where they are used: a bad one raises there, not in the SP agreement."""
    monkeypatch.setenv("FASTVIDEO_CONFIGURE_LOGGING", "yes")
    values, errors = envs.read_all()
    assert errors == [] and "FASTVIDEO_CONFIGURE_LOGGING" not in values
    with pytest.raises(ValueError):
        envs.FASTVIDEO_CONFIGURE_LOGGING  # noqa: B018


def test_override_and_get_take_upstream_names(monkeypatch):
    monkeypatch.delenv("FASTVIDEO_STAGE_LOGGING", raising=False)
    with envs.override(FASTVIDEO_STAGE_LOGGING="1"):
        assert envs.get("FASTVIDEO_STAGE_LOGGING") is True
    assert envs.get("FASTVIDEO_STAGE_LOGGING") is False


# --------------------------------------------------------------------------------------- against upstream's file


def _upstream_envs():
    path = upstream_tree.path("envs.py")
    spec = importlib.util.spec_from_file_location("upstream_fastvideo_envs", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # upstream's envs.py imports only os and typing
    return module


def _same(a, b) -> bool:
    if a[0] == "value" and b[0] == "value" and a[1] is float and b[1] is float and math.isnan(a[2]):
        return math.isnan(b[2])
    return a == b


def test_live_names_match_upstream():
    up = _upstream_envs()
    assert list(up.environment_variables) == NAMES, "the committed table no longer matches upstream's envs.py"
    assert sorted(up.__dir__()) == sorted(NAMES)


def test_live_every_value_matches_upstream(clean_env):
    """Each upstream variable, unset and with every sample value, read by upstream's module and by this one."""
    up = _upstream_envs()
    wrong = []
    for name in NAMES:
        if name == "FASTVIDEO_ULYSSES_A2A":
            continue  # the documented difference: test_live_ulysses_route_differs_only_where_documented
        for raw in [None, *ALL_SAMPLES]:
            if raw is None:
                clean_env.delenv(name, raising=False)
            else:
                clean_env.setenv(name, raw)
            ours, theirs = _outcome(lambda: getattr(envs, name)), _outcome(lambda: getattr(up, name))  # noqa: B023
            if not _same(ours, theirs):
                wrong.append(f"{name}={raw!r}: ours {ours}, upstream {theirs}")
        clean_env.delenv(name, raising=False)
    clean_env.setenv("FASTVIDEO_PRECOMPILED_WHEEL_LOCATION", "/w.whl")
    assert envs.FASTVIDEO_USE_PRECOMPILED == up.FASTVIDEO_USE_PRECOMPILED
    assert wrong == []


def test_live_unknown_names_raise_as_upstream():
    up = _upstream_envs()
    for module in (up, envs):
        with pytest.raises(AttributeError, match="FASTVIDEO_NO_SUCH"):
            module.FASTVIDEO_NO_SUCH  # noqa: B018


def test_live_ulysses_route_differs_only_where_documented(clean_env):
    """Valid spellings read the same; an empty value is ``off`` here (upstream: ``""``, which its readers treat as
    off); an invalid one raises here and passes through upstream (whose readers treat it as off)."""
    up = _upstream_envs()
    name = "FASTVIDEO_ULYSSES_A2A"
    for raw in (None, "off", "auto", " AUTO ", "Off\n"):
        if raw is None:
            clean_env.delenv(name, raising=False)
        else:
            clean_env.setenv(name, raw)
        assert envs.FASTVIDEO_ULYSSES_A2A == up.FASTVIDEO_ULYSSES_A2A
    clean_env.setenv(name, "")
    assert (envs.FASTVIDEO_ULYSSES_A2A, up.FASTVIDEO_ULYSSES_A2A) == ("off", "")
    clean_env.setenv(name, "on")
    assert up.FASTVIDEO_ULYSSES_A2A == "on"
    with pytest.raises(ValueError, match="choose one of off, auto"):
        envs.FASTVIDEO_ULYSSES_A2A  # noqa: B018
