"""Upstream FastVideo 0.2.1's own test suite on pure upstream and on the overlay, side by side.

Test tooling, not product code: ``tests/test_upstream_suite.py`` runs it in the suite, and by hand

    python -m tests.overlay.upstream_suite [--negative-control] [--json FILE]

prints one line per test, then ``overlay passes N of M that pass on pure upstream`` (exit 1 unless N = M).

**What runs.** Upstream's test files (``FILES``, from the pinned wheel) that touch the SP layer,
``parallel_state`` / ``GroupCoordinator``, ``fastvideo.attention``, the all-to-all or ``FASTVIDEO_*`` variables and
need neither a GPU nor downloaded weights, and its two GPU-only Ulysses tests (``RANK_FILES``). Each side is a copy
set up by ``tests/overlay/build.py`` (pure: upstream alone; overlay: this tree's ``fastvideo/`` over it, so this
tree's edited copies of upstream's tests replace upstream's), run by pytest in processes of its own, with the GPUs
hidden, no ``FASTVIDEO_*`` variable of the caller's, and ``suite_path/`` first on
``PYTHONPATH``: its pytest plugin records each test's outcome by node id. The plain files and the rank files
(``GROUPS``) run as two concurrent chains, each pure upstream first, then the overlay on what passed there (and, for
the plain files, the negative control): the overlay's plain files run beside pure upstream's rank files, the
longest run. The runs write bytecode (into the cache, but for this tree's ``suite_path/``): upstream's
dependencies are compiled once per machine, not in each of the dozens of processes that import them. The rank
files, on a host with fewer than ``CPU_RANKS`` GPUs, run with ``FASTVIDEO_UPSTREAM_SUITE_CPU_RANKS`` set, so that
``suite_path/sitecustomize.py`` patches their device choice (CUDA -> CPU ranks over gloo, no ``set_device``, the
CUDA-count skip -> a cap of ``CPU_RANKS`` ranks) in the pytest process and in the ``torch.distributed.run``
children; with that many GPUs, as written. On CPU ranks the fault stages that need upstream's CUDA-only helper
(``CPU_RANK_SKIPS``: they would skip on pure upstream after a ``torchrun`` launch each) are deselected.

**What counts.** M is the number of tests that pass on pure upstream; the overlay runs exactly those (a test that
fails, skips or is deselected on pure upstream is listed, not run there) and N of them pass. Every file must
contribute a test that passes on pure upstream, or the selection no longer fits the wheel. Pure upstream's
outcomes depend only on the wheel, the pins, the python, torch, the selection and this tooling: they are kept in the
overlay's cache under a key of all of these (``upstream-suite/pure-KEY-GROUP.json``), so a machine runs them once.

**The negative control.** ``broken_overlay`` takes a module-level name that upstream's tests patch
(``fastvideo.attention.layer.get_attn_backend``) out of an overlay copy; upstream's tests of it must then fail there.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import fcntl
import hashlib
import inspect
import json
import os
import resource
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.overlay import build

HERE = Path(__file__).resolve().parent
SUITE_PATH = HERE / "suite_path"
TESTS = Path("fastvideo") / "tests"
# Upstream's files under fastvideo/tests/ (its CPU tests of the surfaces this package replaces or reads).
FILES = (
    "api/test_attention_selector_resolution.py",
    "api/test_attn_qat_infer_capability_gate.py",
    "attention/test_attention_metadata_base.py",
    "attention/test_attn_qat_infer_arch_gate.py",
    "attention/test_attn_qat_train_kernel.py",
    "attention/test_sdpa_head_sizes.py",
    "attention/test_sdpa_metadata_mask_contract.py",
    "attention/test_selector_role_override.py",
    "attention/test_video_sparse_attention_metadata.py",
    "attention/test_vsa_h3_metadata.py",
    "attention/test_vsa_h3_sm100a_route.py",
    "contract/test_profiler_regions.py",
    "encoders/test_minimax_h3_qwen3_vl_checkpoint_fp8.py",
    "encoders/test_minimax_h3_qwen3_vl_truncation.py",
    "hooks/test_activation_trace.py",
    "inference/lora/test_merge_lora_math.py",
    "inference/test_inference_regional_compile.py",
    "loader/test_text_encoder_unified_memory_offload.py",
    "pipelines/test_direct_pipeline_unified_memory.py",
    "stages/test_kandinsky5_attention_backend_guard.py",
    "stages/test_minimax_h3_vae_streaming.py",
    "stages/test_text_encoding.py",
    "transformers/test_minimax_h3_fusion_routing.py",
    "vaes/test_minimax_h3_parallel_vae.py",
    "vaes/test_minimax_h3_vae_compile.py",
    "worker/test_gpu_worker.py",
)
# Upstream's GPU-only Ulysses tests: torchrun children, on CPU ranks with the runner's patches where GPUs are few.
RANK_FILES = ("distributed/test_ulysses_a2a_parity.py", "distributed/test_ulysses_fault_injection.py")
CPU_RANKS = 2
# On CPU ranks pure upstream never creates its helper (its provider needs CUDA): these fault stages launch torchrun,
# report UNAVAILABLE and skip, so they count on neither side. The runner deselects them there (reported as such);
# with GPUs enough, they run.
CPU_RANK_SKIPS = tuple(
    f"{TESTS / RANK_FILES[1]}::test_rank_local_setup_failure_falls_back_group_wide[2-{rank}-{stage}]"
    for rank, stage in ((0, "capacity"), (0, "capture"), (0, "lifecycle"), (0, "post_registration"), (0, "teardown"),
                        (1, "allocation"), (1, "layout"), (1, "post_dev_comm")))
TIMEOUT_S = 1500  # one pytest process (a side's rank files launch torchrun up to 11 times, 10-40 s each)
TEST_TIMEOUT_S = 600  # one test, where pytest-timeout is installed
# The negative control: upstream's tests that patch fastvideo.attention.layer.get_attn_backend.
BROKEN_FILE = "transformers/test_minimax_h3_fusion_routing.py"
BREAK = (("def get_attn_backend(", "def _get_attn_backend_removed("),
         ("backend = get_attn_backend(", "backend = _get_attn_backend_removed("))


class RunnerError(RuntimeError):
    """A run did not complete (no outcomes written, a timeout), or the selection no longer fits the wheel."""


def gpu_ranks() -> bool:
    """Whether this host has the GPUs the rank files ask for (then they run as written)."""
    import torch

    return torch.cuda.device_count() >= CPU_RANKS


def _env(pythonpath: list[Path], outcomes: Path, ranks: bool) -> dict[str, str]:
    """A run's environment. Its processes write bytecode (``PYTHONDONTWRITEBYTECODE`` dropped), into the cache but
    for ``suite_path/`` (git-ignored ``__pycache__``): upstream's dependencies are compiled once per machine, not in
    each of the dozens of processes (pytest, ``torchrun``'s agents and ranks) that import them."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("FASTVIDEO_", "PYTEST_"))
           and k not in ("PYTHONPATH", "TORCH_DISTRIBUTED_DEBUG", "PYTHONDONTWRITEBYTECODE")}
    env.update(PYTHONPATH=os.pathsep.join(map(str, [SUITE_PATH, *pythonpath])), HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", FASTVIDEO_UPSTREAM_SUITE_OUTCOMES=str(outcomes))
    if not ranks:
        # Upstream's plain files default MASTER_PORT to fixed ports (os.environ.setdefault at import): a free one of
        # this run's own keeps two runs at once (the two sides' chains, pytest workers) off each other's port.
        env["MASTER_PORT"] = str(_free_port())
    if not (ranks and gpu_ranks()):
        env["CUDA_VISIBLE_DEVICES"] = ""
    if ranks and not gpu_ranks():
        env["FASTVIDEO_UPSTREAM_SUITE_CPU_RANKS"] = str(CPU_RANKS)
    return env


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_pytest(root: Path, pythonpath: list[Path], targets: list[str], out: Path, name: str, *,
               ranks: bool, deselect: tuple[str, ...] = ()) -> dict[str, str]:
    """Upstream's ``targets`` (paths or node ids under ``root``, less the node ids ``deselect``) in one pytest
    process: outcome by node id. Its output goes to ``out/NAME.log``; RunnerError where it wrote no outcomes."""
    out.mkdir(parents=True, exist_ok=True)
    outcomes, ini = out / f"{name}.json", out / f"{name}.ini"
    ini.write_text("[pytest]\n")  # not this repository's configuration, nor any other found above the copies
    outcomes.unlink(missing_ok=True)
    timeout = [f"--timeout={TEST_TIMEOUT_S}"] if _has_pytest_timeout() else []
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "--durations=10", "--continue-on-collection-errors", "-p",
           "no:cacheprovider", "-p", "no:randomly", "-p", "fv_suite_outcomes", "-c", str(ini), "--rootdir", str(root),
           *timeout, *[f"--deselect={t}" for t in deselect], *targets]
    try:
        proc = subprocess.run(cmd, cwd=root, env=_env(pythonpath, outcomes, ranks), capture_output=True, text=True,
                              timeout=TIMEOUT_S)
        output = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        output = f"{exc.stdout or ''}{exc.stderr or ''}\ntimed out after {TIMEOUT_S} s"
    (out / f"{name}.log").write_text(output)
    if not outcomes.exists():
        raise RunnerError(f"{name}: pytest wrote no outcomes ({out / name}.log):\n{output[-4000:]}")
    return json.loads(outcomes.read_text())


def _has_pytest_timeout() -> bool:
    import importlib.util

    return importlib.util.find_spec("pytest_timeout") is not None


GROUPS = {"plain": FILES, "ranks": RANK_FILES}  # a pytest process each, per side


def run_group(side: build.Overlay, out: Path, group: str, select: list[str] | None = None) -> dict[str, str]:
    """One ``GROUPS`` entry of upstream's selection on one side (``select``: only these node ids) in one pytest
    process; the rank files' with ``ranks``, on CPU ranks less ``CPU_RANK_SKIPS`` (each reported ``deselected``)."""
    paths = [str(TESTS / f) for f in GROUPS[group]]
    targets = paths if select is None else [t for t in select if t.split("::")[0] in paths]
    if not targets:
        return {}
    ranks = group == "ranks"
    skips = CPU_RANK_SKIPS if ranks and not gpu_ranks() else ()
    outcomes = run_pytest(side.root, list(side.pythonpath), targets, out, group, ranks=ranks, deselect=skips)
    return {**outcomes, **{t: "deselected" for t in skips if select is None}}


def _key() -> str:
    """What pure upstream's outcomes depend on: the wheel, the pins, the python, torch, the selection, how a side is
    run (the code of the functions that run it, the patches and the plugin) and whether the rank files get GPUs."""
    import torch

    run = [inspect.getsource(fn) for fn in (run_group, run_pytest, _env, _has_pytest_timeout)]
    patches = [p.read_text() for p in sorted(SUITE_PATH.glob("*.py"))]
    parts = [build.UPSTREAM_SHA256, sorted(build._pins().items()), list(sys.version_info[:2]), torch.__version__,
             GROUPS, str(TESTS), CPU_RANKS, CPU_RANK_SKIPS, TEST_TIMEOUT_S, TIMEOUT_S,
             "gpu" if gpu_ranks() else f"cpu{CPU_RANKS}", run, patches]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]


def pure_outcomes(out: Path, group: str) -> tuple[dict[str, str], bool]:
    """Pure upstream's outcomes for one group: from the cache, or run once (under a lock, so concurrent callers share
    one run). Returns them and whether they came from the cache."""
    path = build.cache_dir() / "upstream-suite" / f"pure-{_key()}-{group}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            return json.loads(path.read_text()), True
        outcomes = run_group(build.build_overlay(pure=True), out / "pure", group)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(outcomes, indent=0, sort_keys=True))
        tmp.rename(path)
        return outcomes, False


@dataclass
class Report:
    lines: list[str] = field(default_factory=list)
    passed: int = 0  # N
    counted: int = 0  # M

    @property
    def summary(self) -> str:
        return f"overlay passes {self.passed} of {self.counted} that pass on pure upstream"


def compare(pure: dict[str, str], overlay: dict[str, str]) -> Report:
    """One line per test of pure upstream's, then the summary: M counts those that pass on pure upstream, N those of
    them that pass on the overlay (one it did not report counts as missing)."""
    report = Report()
    for test in sorted(pure):
        if pure[test] != "passed":
            report.lines.append(f"--   {test}: upstream {pure[test]}, not counted (not run on the overlay)")
            continue
        got = overlay.get(test, "missing")
        report.counted += 1
        report.passed += got == "passed"
        report.lines.append(f"{'ok  ' if got == 'passed' else 'FAIL'} {test}: overlay {got}")
    report.lines.append(report.summary)
    return report


def check_selection(pure: dict[str, str]) -> None:
    """RunnerError naming every selected file none of whose tests passes on pure upstream."""
    idle = [f for f in (*FILES, *RANK_FILES)
            if not any(o == "passed" and t.split("::")[0] == str(TESTS / f) for t, o in pure.items())]
    if idle:
        raise RunnerError(f"no test of {idle} passes on pure upstream {build.UPSTREAM_VERSION}: the selection no "
                          "longer fits the wheel (update FILES)")


def broken_overlay(root: Path) -> None:
    """The negative control's damage, in an overlay copy (this tree's files there are copies, not links): upstream's
    module-level ``get_attn_backend`` taken out of ``fastvideo/attention/layer.py``."""
    path = root / "fastvideo" / "attention" / "layer.py"
    text = path.read_text()
    for old, new in BREAK:
        if old not in text:
            raise RunnerError(f"the negative control cannot break {path}: {old!r} is not in it")
        text = text.replace(old, new)
    path.write_text(text)


def negative_control(pure: dict[str, str], out: Path) -> Report:
    """Upstream's tests of ``BROKEN_FILE`` that pass on pure upstream, run on a broken overlay: its report."""
    subset = {t: o for t, o in pure.items() if t.split("::")[0] == str(TESTS / BROKEN_FILE)}
    broken = build.build_overlay()
    broken_overlay(broken.root)
    return compare(subset, run_group(broken, out / "broken", "plain", [t for t, o in subset.items() if o == "passed"]))


@dataclass
class Result:
    pure: dict[str, str]  # pure upstream's outcome of every selected test
    report: Report  # the overlay's
    control: Report | None  # the negative control's, where run
    pure_cached: bool
    seconds: dict[str, float]


def _chain(group: str, out: Path, control: bool) -> tuple[dict[str, str], dict[str, str], Report | None, bool,
                                                           dict[str, float]]:
    """One group's runs in order: pure upstream (or its cached outcomes), the overlay on what passed there, and with
    ``control`` (the plain group, which holds ``BROKEN_FILE``) the negative control. Wall seconds per step."""
    t0 = time.monotonic()
    pure, cached = pure_outcomes(out, group)
    t1 = time.monotonic()
    overlay = run_group(build.build_overlay(), out / "overlay", group, [t for t, o in pure.items() if o == "passed"])
    t2 = time.monotonic()
    broken = negative_control(pure, out) if control and BROKEN_FILE in GROUPS[group] else None
    seconds = {f"{group}_pure_wall": t1 - t0, f"{group}_overlay_wall": t2 - t1}
    if broken is not None:
        seconds["control_wall"] = time.monotonic() - t2
    return pure, overlay, broken, cached, seconds


def run(out: Path, *, control: bool = False) -> Result:
    """Both sides, the comparison and with ``control`` the negative control. The groups run concurrently, each its
    own chain (pure upstream, then the overlay on what passed there): the overlay's plain files start as soon as pure
    upstream's are done, beside pure upstream's rank files. Seconds: wall per step, and the wall and child CPU time
    of the whole."""
    cpu0, t0 = _child_cpu(), time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(len(GROUPS)) as pool:
        chains = [pool.submit(_chain, group, out, control) for group in GROUPS]
        results = [chain.result() for chain in chains]
    pure = {t: o for r in results for t, o in r[0].items()}
    overlay = {t: o for r in results for t, o in r[1].items()}
    controls = [r[2] for r in results if r[2] is not None]
    seconds = {k: v for r in results for k, v in r[4].items()}
    seconds.update(wall=time.monotonic() - t0, cpu=_child_cpu() - cpu0)
    return Result(pure, compare(pure, overlay), controls[0] if controls else None, all(r[3] for r in results),
                  {k: round(v, 1) for k, v in seconds.items()})


def _child_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def failing_lines(report: Report) -> list[str]:
    return [line for line in report.lines if line.startswith("FAIL")]


def _header() -> dict:
    import platform

    import torch

    git = subprocess.run(["git", "-C", str(build.ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": git.stdout.strip() or "unknown",
            "python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
            "upstream": f"{build.UPSTREAM}=={build.UPSTREAM_VERSION} sha256 {build.UPSTREAM_SHA256}",
            "command": "python -m tests.overlay.upstream_suite " + " ".join(sys.argv[1:])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=build.cache_dir() / "upstream-suite" / "last",
                        help="where each pytest process's log and outcomes go")
    parser.add_argument("--negative-control", action="store_true", help="also run the broken overlay")
    parser.add_argument("--json", type=Path, help="write the lines, counts and timings here")
    args = parser.parse_args(argv)
    result = run(args.out, control=args.negative_control)
    check_selection(result.pure)
    print("\n".join(result.report.lines))
    record = {"header": _header(), "lines": result.report.lines, "passed": result.report.passed,
              "counted": result.report.counted,
              "pure_from_cache": result.pure_cached, "seconds": result.seconds,
              "rank_files": "as written" if gpu_ranks() else f"{CPU_RANKS} CPU ranks, the runner's patches"}
    ok = result.report.passed == result.report.counted
    if result.control is not None:
        control = result.control
        print("negative control (get_attn_backend taken out of the overlay's attention/layer.py):")
        print("\n".join(control.lines))
        record["negative_control"] = {"lines": control.lines, "passed": control.passed, "counted": control.counted}
        ok = ok and control.passed < control.counted
    print(json.dumps(result.seconds))
    if args.json:
        args.json.write_text(json.dumps(record, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
