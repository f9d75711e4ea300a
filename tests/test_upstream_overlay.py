"""Upstream FastVideo 0.2.1 with this tree's ``fastvideo/`` copied over it runs its own SP tests and its Wan DiT
under sequence parallelism (docs/fastvideo_migration.md, "The overlay").

The overlay is built by ``tests/overlay/build.py`` (the pinned wheel, sha256-checked; the pinned dependencies;
a cached install, a fresh copy of this tree's files per run) and every upstream process runs in a subprocess on
its ``PYTHONPATH``, so this tree's own ``fastvideo`` (imported by the suite) never mixes with the overlay's.

* Upstream's own SP tests (``fastvideo/tests/distributed/test_sp_*.py`` from the wheel), changed only by the
  named patches of ``tests/overlay/upstream_tests.py`` (device CPU, no CUDA skip, torchrun as a module, the CPU
  attention backend), on gloo with the GPUs hidden. They read ``FASTVIDEO_ULYSSES_A2A`` from the environment their
  ranks inherit, so they are marked ambient and run under each value.
* Wan parity (``tests/overlay/wan_parity.py``): forward and backward at SP = 2 and 3 against one process, under
  ``off``, ``auto`` and the CPU plan transport (the fused route's code path), on an even and a padded sequence;
  each run asserts the route its all-to-alls took, and a run with one exchange corrupted must fail.

Where the overlay cannot be built for want of a download (no network and no wheel folder), the tests skip, naming
what is missing; under CI (``CI=true``) they fail instead.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import pickle
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.ci import ci
from tests.overlay import build as overlay_build
from tests.overlay import upstream_tests

ROOT = Path(__file__).resolve().parents[1]
CI = ci()
# Upstream's tests launch torchrun twice (1 process, then 2) and import upstream in each: about a minute on an idle
# 2-core machine, several on a loaded one. The first test in a worker also builds the overlay.
TIMEOUT_S = 900
# Upstream's tests that run in the suite; the rest run where FASTVIDEO_OVERLAY_ALL_TESTS=1 (scripts/gpu_overlay.sh):
# each costs one to three minutes of a 2-core machine.
SUITE_TESTS = ("test_sp_wan.py",)
# Parity tolerance on outputs and gradients: TOL_FACTOR times the calibration unit, which is the larger of (a) the
# largest difference between one-process runs on one thread and on two (the same sums blocked differently) and
# (b) one float32 ulp at the largest magnitude compared. Repeated one-process runs on one thread are bit-equal
# (asserted). Measured on the 2-core machine: (a) 1.7e-8 for the gradients, 0 for the outputs; (b) 6e-8;
# SP = 2 and 3 under every route: outputs bit-equal, gradients within 1.2e-7 (2 ulps); the corrupted exchange
# moves the gradients by 1e-3 and the output by 4e-2.
TOL_FACTOR = 16
CALLS_PER_STEP = 8  # 2 blocks x (q/k/v in, out) x (forward, backward): every one recorded by the helper

# The suite's per-test limit (pytest-timeout, where installed) is too short for the first test of a worker.
pytestmark = [pytest.mark.timeout(TIMEOUT_S)] if importlib.util.find_spec("pytest_timeout") else []


def _unavailable(why: str):
    if CI:
        pytest.fail(f"{why} (CI=true: a missing download fails here instead of skipping)")
    pytest.skip(why)


@pytest.fixture(scope="module")
def overlay() -> overlay_build.Overlay:
    try:
        return overlay_build.build_overlay()
    except overlay_build.MissingDownload as exc:
        _unavailable(f"the upstream overlay cannot be built here: {exc}")


# An exception's first line in a subprocess's output: the class name (qualified or not) and its message, under the
# prefixes that torchrun ("[rank0]: ") and pytest ("E   ") put before a nested process's lines.
_PREFIX = re.compile(r"^(?:\[(?:default)?rank\d+\]:\s?|E\s+)*")
_EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Failure)(?::|$)")
HEAD_FRAMES = 6  # the innermost traceback lines kept above each exception's first line
HEADS = 12  # distinct exceptions reported by their first lines
HEAD_CHARS = 2000  # per line: a dispatcher error's first line lists every backend


def _failure_report(output: str, tail: int = 8000) -> str:
    """A failed subprocess's output for an assertion message: the first line of every distinct exception raised in
    it (each once, in order of appearance, with the traceback lines just above it; a message that does not fit
    the tail keeps its head), then the last ``tail`` characters."""
    lines = [_PREFIX.sub("", line) for line in output.splitlines()]
    heads: list[str] = []
    seen: set[str] = set()
    for i, line in enumerate(lines):
        if not _EXCEPTION.match(line) or line in seen or len(heads) >= HEADS:
            continue
        seen.add(line)
        above = []
        for prev in reversed(lines[max(0, i - HEAD_FRAMES):i]):
            if not prev.startswith(" "):  # the traceback's frames are indented; stop at anything else
                break
            above.insert(0, prev)
        heads.append("\n".join(x[:HEAD_CHARS] for x in (*above, line)))
    digest = "\n\n".join(heads) if heads else "(no exception line found)"
    return f"exceptions, first lines:\n{digest}\n\n--- the last {tail} characters ---\n{output[-tail:]}"


def _env(overlay: overlay_build.Overlay) -> dict[str, str]:
    env = overlay.env()
    env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU and gloo, also on a GPU host
    env.pop("PYTEST_ADDOPTS", None)
    env.pop("PYTEST_XDIST_WORKER", None)
    return env


# ---------------------------------------------------------------------------------------------------
# The tooling itself (no overlay needed)


def test_wheel_folder_check_names_each_problem(tmp_path):
    problems = overlay_build.check_wheel_dir(tmp_path)
    assert f"{overlay_build.UPSTREAM_WHEEL} is missing" in problems
    for name, version in overlay_build._pins().items():
        assert f"no wheel for {name}=={version}" in problems
    # A pure pin shipped compiled, a wrong upstream hash: each named.
    (tmp_path / "einops-0.8.2-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"x")
    (tmp_path / overlay_build.UPSTREAM_WHEEL).write_bytes(b"not the wheel")
    problems = overlay_build.check_wheel_dir(tmp_path)
    assert any("einops-0.8.2-cp311" in p and "pure-python" in p for p in problems), problems
    assert any("sha256" in p for p in problems), problems


def test_patches_refuse_an_upstream_test_they_do_not_fit():
    with pytest.raises(upstream_tests.PatchError, match="cpu-device"):
        upstream_tests.patched_source("import argparse\nSP_WORLD_SIZE = 2\n", "test_sp_wan.py")


def test_stand_in_imports_any_name_and_refuses_calls(tmp_path):
    overlay_build.write_stand_in(tmp_path, "torchvision_standin_probe")
    code = ("import torchvision_standin_probe.transforms.v2.functional as F\n"
            "from torchvision_standin_probe.transforms import InterpolationMode\n"
            "assert InterpolationMode.BICUBIC is InterpolationMode.BICUBIC\n"
            "try:\n    F.resize(1)\nexcept RuntimeError as e:\n    print('refused:', e)\n")
    proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(tmp_path)},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "refused: torchvision_standin_probe.transforms.v2.functional.resize is not available" in proc.stdout


def test_failure_report_keeps_the_head_of_an_error_beyond_the_tail():
    frames = "".join(f"[rank0]:   File \"m.py\", line {i}, in f{i}\n" for i in range(3))
    head = "[rank0]: NotImplementedError: Could not run 'ns::op' with arguments from the 'CPU' backend."
    listing = "[rank0]: listing\n" * 2000
    output = (f"[rank0]: Traceback (most recent call last):\n{frames}{head}\n{listing}"
              f"[rank1]: Traceback (most recent call last):\n{frames}{head.replace('[rank0]', '[rank1]')}\n"
              "E       RuntimeError: sp worker failed with code 1\n" + "tail line\n" * 1000)
    report = _failure_report(output, tail=500)
    plain = head.removeprefix("[rank0]: ")
    assert plain not in output[-500:]  # the negative control: the tail alone loses it
    assert report.count(plain) == 1 and '  File "m.py", line 2, in f2\n' + plain in report
    assert "\nRuntimeError: sp worker failed with code 1\n" in report and report.endswith(output[-500:])
    assert "no exception line found" in _failure_report("all quiet\n")


# ---------------------------------------------------------------------------------------------------
# Upstream's own SP tests


def _upstream_test_names() -> tuple[str, ...]:
    return upstream_tests.TESTS if os.environ.get("FASTVIDEO_OVERLAY_ALL_TESTS") == "1" else SUITE_TESTS


@pytest.mark.slow
@pytest.mark.ambient("FASTVIDEO_ULYSSES_A2A")
@pytest.mark.parametrize("test_name", _upstream_test_names())
def test_upstream_sp_test_on_the_overlay(overlay, test_name, tmp_path, ulysses_ambient):
    path, counts = upstream_tests.write_patched(overlay.root, test_name, tmp_path / "patched")
    print(f"{test_name}: patches applied {counts}; FASTVIDEO_ULYSSES_A2A={ulysses_ambient['FASTVIDEO_ULYSSES_A2A']}")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", str(path)],
                          cwd=tmp_path, env=_env(overlay), capture_output=True, text=True, timeout=TIMEOUT_S - 60)
    out = proc.stdout + proc.stderr
    print(f"{test_name}: exit {proc.returncode} in {time.monotonic() - t0:.0f} s\n{out[-6000:]}")
    # Exit 0 and exactly one test passed: no test collected (exit 5) or a skip does not pass.
    assert proc.returncode == 0, f"upstream's {test_name} failed (exit {proc.returncode}):\n{_failure_report(out)}"
    summary = out.strip().splitlines()[-1]
    assert re.search(r"\b1 passed\b", summary) and "skipped" not in summary, summary


# ---------------------------------------------------------------------------------------------------
# Wan parity, per route


@pytest.fixture(scope="module")
def parity(overlay) -> dict:
    # One run per pytest session: pytest-xdist workers share it through a file named by the session's id (each
    # worker would otherwise run it again), under a lock; a new session runs it anew.
    session = os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"pid{os.getpid()}"
    folder = overlay_build.cache_dir() / "parity"
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.iterdir():  # earlier sessions' results
        if time.time() - old.stat().st_mtime > 86400:
            old.unlink(missing_ok=True)
    out = folder / f"{session}.pkl"
    with open(folder / f"{session}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not out.exists():
            proc = subprocess.run([sys.executable, str(ROOT / "tests" / "overlay" / "wan_parity.py"), "--out",
                                   str(out)], cwd=folder, env=_env(overlay), capture_output=True, text=True,
                                  timeout=TIMEOUT_S - 60)
            print(proc.stdout[-4000:])
            output = proc.stdout + proc.stderr
            assert proc.returncode == 0, (f"the Wan parity run failed (exit {proc.returncode}):\n"
                                          f"{_failure_report(output)}")
    with open(out, "rb") as f:
        return pickle.load(f)


def _max_diff(a: dict, b: dict) -> tuple[float, float]:
    """(output, gradient) max absolute differences of two steps."""
    assert a["grads"].keys() == b["grads"].keys(), sorted(set(a["grads"]) ^ set(b["grads"]))
    return (float(np.abs(a["out"] - b["out"]).max()),
            max(float(np.abs(a["grads"][k] - b["grads"][k]).max()) for k in a["grads"]))


def _tolerances(data: dict) -> dict:
    """Per step: (output, gradient) tolerances calibrated from the one-process runs (see TOL_FACTOR)."""
    tol = {}
    for key, ref in data["reference"]["steps"].items():
        repeat = _max_diff(ref, data["reference_repeat"]["steps"][key])
        assert repeat == (0.0, 0.0), f"one process is not deterministic on one thread: {key} {repeat}"
        threads = _max_diff(ref, data["reference_threads"]["steps"][key])
        ulp_out = float(np.spacing(np.float32(np.abs(ref["out"]).max())))
        ulp_grad = float(np.spacing(np.float32(max(np.abs(g).max() for g in ref["grads"].values()))))
        tol[key] = (TOL_FACTOR * max(threads[0], ulp_out), TOL_FACTOR * max(threads[1], ulp_grad))
    return tol


def _check(data: dict, world: int, route: str) -> list[str]:
    """Every parity failure of one run (empty when it matches one process within the tolerances)."""
    tol = _tolerances(data)
    failures = []
    rank0 = data["runs"][(world, route)][0]
    for key, ref in data["reference"]["steps"].items():
        out_diff, grad_diff = _max_diff(ref, rank0["steps"][key])
        if out_diff > tol[key][0]:
            failures.append(f"{key}: output differs by {out_diff:.3g} > {tol[key][0]:.3g}")
        if grad_diff > tol[key][1]:
            failures.append(f"{key}: gradients differ by {grad_diff:.3g} > {tol[key][1]:.3g}")
    return failures


def _assert_route(data: dict, world: int, route: str) -> None:
    """The route every all-to-all of the run took, on every rank, from the helper's own record."""
    for rank, res in enumerate(data["runs"][(world, route)]):
        where = f"SP={world} {route} rank {rank}"
        assert res["route_setting"] == ("off" if route == "off" else "auto"), (where, res["route_setting"])
        for key, step in res["steps"].items():
            if route == "off":
                # No helper exists: the op takes the NCCL route (gloo here) and records nothing.
                assert res["helper"] is None and not res["enabled"] and step["routes"] == [], (where, key, res)
            elif route == "auto":
                # A CPU job: the op's helper declined at construction, every call recorded on the NCCL route.
                assert res["helper"]["construction"] == "transport_missing", (where, res["helper"])
                assert step["routes"] == ["nccl"] * CALLS_PER_STEP, (where, key, step["routes"])
            else:
                assert res["helper"]["construction"] == "ok", (where, res["helper"])
                assert step["routes"] == ["fused"] * CALLS_PER_STEP, (where, key, step["routes"])
        if route in ("host", "corrupt"):
            assert res["helper"]["fused"] == res["helper"]["calls"] == CALLS_PER_STEP * len(res["steps"]), res


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("route", ["off", "auto", "host"])
def test_wan_sp_matches_one_process(parity, world, route):
    _assert_route(parity, world, route)
    failures = _check(parity, world, route)
    assert not failures, f"SP={world} {route} differs from one process:\n" + "\n".join(failures)
    assert {key[1] for key in parity["reference"]["steps"]} == {"even", "padded"}


def test_wan_corrupted_exchange_fails_parity(parity):
    """Negative control: the same run with rank 0's first fused exchange of each step off by one in one element."""
    _assert_route(parity, 2, "corrupt")
    failures = _check(parity, 2, "corrupt")
    steps = parity["reference"]["steps"]
    assert len(failures) >= len(steps), f"a corrupted exchange passed the parity check: {failures}"
    assert all(any(str(key) in f for f in failures) for key in steps), failures
