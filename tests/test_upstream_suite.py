"""Upstream FastVideo 0.2.1's own test suite passes on the overlay: every test that passes on pure upstream
(``tests/overlay/upstream_suite.py``; docs/fastvideo_migration.md, "Upstream's own suite").

The runner's selection of upstream's files runs on pure upstream and on the overlay in processes of their own (the
pinned wheel and the overlay's cached install, outside the tree); the test prints one line per test and
``overlay passes N of M that pass on pure upstream``, and fails unless N = M. The negative control runs upstream's
tests of ``fastvideo.attention.layer.get_attn_backend`` on an overlay without it: they must fail there. The
tooling's own tests (the comparison, the outcome plugin, the CPU-rank patches) need no overlay.

Where the overlay cannot be built for want of a download (no network and no wheel folder) the runner's tests skip,
naming what is missing; under ``CI=true`` they fail instead.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.ci import ci
from tests.overlay import build
from tests.overlay import upstream_suite as suite

CI = ci()
# Two chains of runs at once (each: pure upstream, first on a machine, then the overlay, and for the plain files the
# negative control), each run bounded by the runner; the suite's per-test limit (pytest-timeout) is far shorter.
TIMEOUT_S = 3 * suite.TIMEOUT_S + 300
pytestmark = [pytest.mark.timeout(TIMEOUT_S)] if importlib.util.find_spec("pytest_timeout") else []


@contextlib.contextmanager
def _unless_missing_download():
    """Skip (fail under CI) where the overlay cannot be built for want of a download."""
    try:
        yield
    except build.MissingDownload as exc:
        why = f"the upstream overlay cannot be built here: {exc}"
        if CI:
            pytest.fail(f"{why} (CI=true: a missing download fails here instead of skipping)")
        pytest.skip(why)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[suite.Result, Path]:
    """Pure upstream, the overlay and the negative control (``suite.run``), and where their logs are."""
    out = tmp_path_factory.mktemp("upstream-suite")
    with _unless_missing_download():
        result = suite.run(out, control=True)
    print(f"pure upstream's outcomes: {'from the cache' if result.pure_cached else 'run now'}; {result.seconds}")
    return result, out


# Minutes on a 2-core machine: placed at the head of a worker's first chunk (tests/conftest.py), so it starts at once.
@pytest.mark.slow
def test_upstream_suite_passes_on_the_overlay(runs):
    result, out = runs
    suite.check_selection(result.pure)
    report = result.report
    print("\n".join(report.lines))
    assert report.counted > 0 and report.passed == report.counted, "\n".join(
        [*suite.failing_lines(report), report.summary, f"logs: {out}"])


@pytest.mark.slow
def test_a_broken_overlay_fails_the_runner(runs):
    """Negative control: without upstream's module-level ``get_attn_backend`` the overlay fails upstream's tests that
    patch it, and only those; the runner reports N < M."""
    report = runs[0].control
    print("\n".join(report.lines))
    assert 0 < report.passed < report.counted
    failed = {line.split("::")[1].split("[")[0] for line in suite.failing_lines(report)}
    assert failed == {"test_minimax_h3_varlen_flag_reaches_resolved_backend_impl"}, report.lines


# ---------------------------------------------------------------------------------------------------
# The tooling itself (no overlay needed)


def test_compare_counts_what_passes_on_pure_upstream():
    pure = {"a.py::t1": "passed", "a.py::t2": "passed", "a.py::t3": "skipped", "b.py::t4": "failed",
            "b.py::t5": "passed"}
    report = suite.compare(pure, {"a.py::t1": "passed", "a.py::t2": "failed"})
    assert (report.passed, report.counted) == (1, 3)
    assert report.lines[-1] == "overlay passes 1 of 3 that pass on pure upstream"
    assert suite.failing_lines(report) == ["FAIL a.py::t2: overlay failed", "FAIL b.py::t5: overlay missing"]
    assert "--   a.py::t3: upstream skipped, not counted (not run on the overlay)" in report.lines
    assert len(report.lines) == len(pure) + 1


def test_selection_check_names_every_file_without_a_passing_test():
    passing = {f"{suite.TESTS / f}::t": "passed" for f in (*suite.FILES, *suite.RANK_FILES)}
    suite.check_selection(passing)
    first, last = suite.FILES[0], suite.RANK_FILES[-1]
    passing.update({f"{suite.TESTS / first}::t": "skipped", f"{suite.TESTS / last}::t": "failed"})
    with pytest.raises(suite.RunnerError, match="no longer fits") as info:
        suite.check_selection(passing)
    assert first in str(info.value) and last in str(info.value)


def test_broken_overlay_refuses_a_file_it_does_not_fit(tmp_path):
    (tmp_path / "fastvideo" / "attention").mkdir(parents=True)
    (tmp_path / "fastvideo" / "attention" / "layer.py").write_text("x = 1\n")
    with pytest.raises(suite.RunnerError, match="cannot break"):
        suite.broken_overlay(tmp_path)


def test_outcome_plugin_records_each_outcome(tmp_path):
    (tmp_path / "test_kinds.py").write_text(textwrap.dedent("""
        import pytest

        @pytest.fixture
        def broken():
            raise RuntimeError("setup")

        @pytest.fixture
        def broken_after():
            yield
            raise RuntimeError("teardown")

        def test_ok(): pass
        def test_bad(): assert False
        def test_skip(): pytest.skip("no")
        def test_setup(broken): pass
        def test_teardown(broken_after): pass
        @pytest.mark.xfail
        def test_xfail(): assert False
        """))
    (tmp_path / "test_unimportable.py").write_text("import no_such_module_here\n")
    out = tmp_path / "outcomes.json"
    env = {**os.environ, "PYTHONPATH": str(suite.SUITE_PATH), "FASTVIDEO_UPSTREAM_SUITE_OUTCOMES": str(out)}
    subprocess.run([sys.executable, "-m", "pytest", "-q", "--continue-on-collection-errors", "-p", "no:cacheprovider",
                    "-p", "fv_suite_outcomes",
                    "-c", os.devnull, "--rootdir", str(tmp_path), str(tmp_path)], cwd=tmp_path, env=env,
                   capture_output=True, timeout=120)
    got = json.loads(out.read_text())
    assert got == {"test_kinds.py::test_ok": "passed", "test_kinds.py::test_bad": "failed",
                   "test_kinds.py::test_skip": "skipped", "test_kinds.py::test_setup": "error",
                   "test_kinds.py::test_teardown": "error", "test_kinds.py::test_xfail": "skipped",
                   "test_unimportable.py": "error"}


PROBE = """
import json, sys, torch, torch.distributed as dist
import fastvideo.platforms as platforms
out = {"count": torch.cuda.device_count(), "own_count": torch.cuda.device_count.__module__ == "torch.cuda",
       "device": str(torch.device("cuda:1")), "is_device": isinstance(torch.device("cuda", 1), torch.device),
       "cuda_plugin": platforms.cuda_platform_plugin()}
from fastvideo.distributed.device_communicators import pynccl
try:
    pynccl.NCCLLibrary(None)
    out["nccl_library"] = True
except OSError:
    out["nccl_library"] = False
if out["device"] == "cpu":  # a patched worker
    torch.cuda.set_device(1)  # a no-op: unpatched, this raises on a machine without CUDA
    dist.init_process_group(backend="nccl", store=dist.HashStore(), rank=0, world_size=1)
    out["backend"] = dist.get_backend()
    dist.destroy_process_group()
    from fastvideo.platforms.cpu import CpuPlatform
    out["cuda_alike"] = CpuPlatform().is_cuda_alike()
    out["torch_device"] = CpuPlatform.get_torch_device() is torch.cuda
print(json.dumps(out))
"""


def _probe(tmp_path, script: str, *args: str, cap: bool) -> dict:
    """PROBE run as ``script`` (under ``tmp_path``, beside a stand-in of upstream's CPU platform module)."""
    platforms = tmp_path / "fastvideo" / "platforms"
    platforms.mkdir(parents=True, exist_ok=True)
    (tmp_path / "fastvideo" / "__init__.py").write_text("")
    # Upstream's CUDA probe asks NVML, which sees a host's GPUs even where the run hides them from CUDA.
    (platforms / "__init__.py").write_text("def cuda_platform_plugin():\n    return 'cuda'\n")
    (platforms / "cpu.py").write_text("class CpuPlatform:\n    def is_cuda_alike(self):\n        return False\n")
    # A GPU host has an NCCL library, which upstream's PyNccl would bind to the CPU device of a CPU-rank run.
    comms = tmp_path / "fastvideo" / "distributed" / "device_communicators"
    comms.mkdir(parents=True, exist_ok=True)
    for folder in (comms.parent, comms):
        (folder / "__init__.py").write_text("")
    (comms / "pynccl.py").write_text("class NCCLLibrary:\n    def __init__(self, path):\n        pass\n")
    path = tmp_path / script
    path.write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if k != "FASTVIDEO_UPSTREAM_SUITE_CPU_RANKS"}
    env.update(PYTHONPATH=os.pathsep.join([str(suite.SUITE_PATH), str(tmp_path)]), CUDA_VISIBLE_DEVICES="")
    if cap:
        env["FASTVIDEO_UPSTREAM_SUITE_CPU_RANKS"] = "2"
    proc = subprocess.run([sys.executable, str(path), *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_cpu_rank_patches_apply_to_the_ulysses_workers_only_with_the_variable(tmp_path):
    """Without the variable nothing changes; with it, a process is capped at 2 CUDA ranks, upstream's platform probe
    finds no CUDA (a GPU host's NVML would, the GPUs hidden) and its PyNccl no NCCL library (a GPU host has one, which
    PyNccl would bind to the CPU device), and a worker of upstream's Ulysses tests (``test_ulysses_*.py --worker``)
    gets the CPU for CUDA devices, a no-op ``set_device``, gloo for NCCL and a CUDA-like CPU platform; a worker of any
    other file is not patched (the control)."""
    plain = _probe(tmp_path, "test_ulysses_a2a_parity.py", "--worker-not", cap=False)
    assert (plain["own_count"], plain["device"], plain["cuda_plugin"], plain["nccl_library"]) == (
        True, "cuda:1", "cuda", True)
    capped = _probe(tmp_path, "probe.py", cap=True)
    assert (capped["count"], capped["device"], capped["cuda_plugin"], capped["nccl_library"]) == (2, "cuda:1", None,
                                                                                                  False)
    worker = _probe(tmp_path, "test_ulysses_fault_injection.py", "--worker", cap=True)
    assert worker == {"count": 0, "own_count": True, "device": "cpu", "is_device": True, "cuda_plugin": None,
                      "nccl_library": False, "backend": "gloo", "cuda_alike": True, "torch_device": True}
    other = _probe(tmp_path, "test_other.py", "--worker", cap=True)
    assert other == {**capped, "is_device": True}


def test_cpu_ranks_deselect_the_fault_stages_that_need_upstreams_cuda_helper(monkeypatch, tmp_path):
    """On CPU ranks pure upstream's run of the rank files deselects ``CPU_RANK_SKIPS`` and reports each
    ``deselected`` (not counted); the overlay's run (a selection) reports none; with GPUs enough nothing is
    deselected (the control)."""
    calls = []

    def fake_run_pytest(root, pythonpath, targets, out, name, *, ranks, deselect=()):
        calls.append(deselect)
        return {t: "passed" for t in targets if "::" in t}

    monkeypatch.setattr(suite, "run_pytest", fake_run_pytest)
    side = SimpleNamespace(root=tmp_path, pythonpath=())
    monkeypatch.setattr(suite, "gpu_ranks", lambda: False)
    pure = suite.run_group(side, tmp_path, "ranks")
    assert calls[-1] == suite.CPU_RANK_SKIPS and len(suite.CPU_RANK_SKIPS) == 8
    assert {t for t, o in pure.items() if o == "deselected"} == set(suite.CPU_RANK_SKIPS)
    kept = f"{suite.TESTS / suite.RANK_FILES[1]}::test_rank_local_setup_failure_falls_back_group_wide[2-0-capability]"
    assert suite.run_group(side, tmp_path, "ranks", [kept]) == {kept: "passed"}
    assert suite.compare(pure, {}).counted == 0  # deselected: not counted
    monkeypatch.setattr(suite, "gpu_ranks", lambda: True)
    assert suite.run_group(side, tmp_path, "ranks") == {} and calls[-1] == ()
    assert suite.run_group(side, tmp_path, "plain") == {} and calls[-1] == ()
