"""``scripts/setup_env.sh`` and ``scripts/run_tests.sh`` on a python used as it is, as on a GPU host without a
package registry: nothing is installed, and every step whose tool that python lacks is skipped with a note that
names it, never silently. The python here is this one behind a shim that hides some packages (a
``sitecustomize`` makes the import system report them missing), the way a host python lacks them."""

from __future__ import annotations

import functools
import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The small test file the command is pointed at (FASTVIDEO_PYTEST_ARGS), and how many tests it holds: counted, so
# that the assertions below follow the file as it grows.
TARGET = "tests/test_rotary_embedding.py"
# The modules scripts/setup_env.sh checks for, by import name (its table's keys).
DEV_MODULES = re.findall(r'"(\w+)": "[\w-]+"', (ROOT / "scripts" / "setup_env.sh").read_text())


@functools.cache
def _target_count() -> int:
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", TARGET],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    match = re.search(r"^(\d+) tests? collected", done.stdout, re.M)
    assert match, done.stdout[-2000:]
    return int(match.group(1))


def _ran_target(stdout: str) -> bool:
    """Whether a pytest session in ``stdout`` ran every test of TARGET, none failing (skips allowed: its upstream
    comparisons skip where no unpacked upstream wheel is at hand)."""
    for line in stdout.splitlines():
        counts = dict((kind, int(n)) for n, kind in re.findall(r"(\d+) (passed|skipped|failed|error)", line))
        if counts.get("passed") and not counts.get("failed") and not counts.get("error"):
            return counts["passed"] + counts.get("skipped", 0) == _target_count()
    return False
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
    env.pop("CI", None)  # a host python, not CI's (the tests that need CI set it)
    return python, env


def _stand_ins(tmp_path: pathlib.Path, env: dict[str, str], modules=DEV_MODULES) -> list[str]:
    """Empty stand-ins (run as a module, each does nothing) for those of ``modules`` this python lacks (a GPU
    host's has no ruff), on the shim's path, so that scripts/setup_env.sh's module check finds them where a test
    is about a later step; returns their names (FASTVIDEO_TEST_HIDE hides them again)."""
    lacking = [module for module in modules if importlib.util.find_spec(module) is None]
    tools = tmp_path / "stand-ins"
    for module in lacking:
        (tools / module).mkdir(parents=True)
        for name in ("__init__.py", "__main__.py"):
            (tools / module / name).write_text("")
    if lacking:
        env["PYTHONPATH"] = f"{env['PYTHONPATH']}{os.pathsep}{tools}"
    return lacking


def test_setup_uses_the_python_as_it_is_and_lists_what_it_lacks(tmp_path):
    python, env = _shim(tmp_path, "ruff clang_format matplotlib")
    _stand_ins(tmp_path, env, [m for m in DEV_MODULES if m not in ("ruff", "clang_format", "matplotlib")])
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
    env["FASTVIDEO_PYTEST_ARGS"] = TARGET
    env["CUDA_VISIBLE_DEVICES"] = ""  # a machine without GPUs, also where this test runs on a GPU host
    proc = subprocess.run(["bash", "scripts/run_tests.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "== ruff: SKIPPED, not installed" in proc.stdout
    assert "== clang-format (csrc/): SKIPPED, not installed" in proc.stdout
    assert "== kernel build: SKIPPED (FASTVIDEO_SKIP_KERNEL_BUILD=1" in proc.stdout
    assert _ran_target(proc.stdout) and "failed" not in proc.stdout
    workers = min(12, max(2, len(os.sched_getaffinity(0)) // 2))  # the default: one per 2 cores, 2 to 12
    assert f"== pytest -n {workers} --dist worksteal (ambient-marked tests" in proc.stdout
    assert "the GPUs hidden" not in proc.stdout  # no GPU: one session
    assert proc.stdout.splitlines()[-1].startswith(
        "== done; NOT RUN here: ruff, clang-format, kernel build, per-test timeouts (pytest-timeout)")


@pytest.mark.parametrize("ci", ["true", "1"])
def test_under_ci_a_missing_nvcc_or_clang_format_executable_fails(tmp_path, ci):
    """CI has nvcc and clang-format's executable beside its python: where either is missing (the module check of
    ``setup_env.sh`` passes, the executable is not there; nvcc is not on PATH) the test command fails before any
    test, naming it, for every spelling of CI the command reads as CI. The control: the same machine without CI
    skips them and says so (the skip test above, and the nvcc one here)."""
    python, env = _shim(tmp_path, "")
    stand_ins = _stand_ins(tmp_path, env)  # the module check passes: the executables are this test's subject
    env.update(CI=ci, PYTEST_ADDOPTS="-p no:timeout", FASTVIDEO_PYTEST_ARGS=TARGET, CUDA_VISIBLE_DEVICES="")
    env.pop("FASTVIDEO_SKIP_KERNEL_BUILD")
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if not (pathlib.Path(p) / "nvcc").exists())
    proc = subprocess.run(["bash", "scripts/run_tests.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 1 and "== pytest" not in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"CI={ci} but no clang-format beside {python}" in proc.stderr, proc.stderr[-2000:]
    (python.parent / "clang-format").write_text("#!/bin/sh\nexit 0\n")  # clang-format there: nvcc's turn
    (python.parent / "clang-format").chmod(0o755)
    proc = subprocess.run(["bash", "scripts/run_tests.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 1 and f"CI={ci} but nvcc is not on PATH" in proc.stderr, proc.stderr[-2000:]
    assert "== pytest" not in proc.stdout
    # Without CI; no ninja: no hot-path extension build here either.
    env.update(FASTVIDEO_TEST_HIDE=" ".join(["ninja", *stand_ins]))
    env.pop("CI")
    env.pop("PYTEST_ADDOPTS")
    proc = subprocess.run(["bash", "scripts/run_tests.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and _ran_target(proc.stdout), proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "== kernel build: SKIPPED, nvcc not found" in proc.stdout and "kernel build (no nvcc)" in proc.stdout


def test_under_ci_a_missing_tool_fails_instead_of_skipping(tmp_path):
    """The control of the skip above: CI can install every tool, so there a missing one fails the command."""
    _, env = _shim(tmp_path, "ruff clang_format pytest_timeout")
    env.update(CI="true", PYTEST_ADDOPTS="-p no:timeout", FASTVIDEO_PYTEST_ARGS=TARGET)
    proc = subprocess.run(["bash", "scripts/run_tests.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 1 and "CI=true but" in proc.stderr
    assert all(tool in proc.stderr for tool in ("ruff", "clang-format", "pytest-timeout"))
    assert "passed" not in proc.stdout


def test_negative_control_without_pytest_the_test_command_fails(tmp_path):
    _, env = _shim(tmp_path, "pytest")
    proc = subprocess.run(["bash", "scripts/run_tests.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 1 and "pytest is not installed" in proc.stderr


# ------------------------------------------------------------------------------------- offline kernel builds


def _offline(tmp_path: pathlib.Path, hidden: str = "") -> dict[str, str]:
    """This python as on a host without a package registry: ``pip download`` fails as pip does there; an
    nvidia-nccl-cu13 2.28.9 is installed (headers, library, metadata), as a GPU host's torch brings one; the NCCL
    cache is empty and no wheel is carried."""
    _, env = _shim(tmp_path, hidden)
    python = pathlib.Path(env["FASTVIDEO_PYTHON"])
    python.write_text(
        '#!/bin/sh\nif [ "$1" = -m ] && [ "$2" = pip ] && [ "$3" = download ]; then\n'
        '  echo "ERROR: No matching distribution found for $*" >&2; exit 1\nfi\n'
        f'exec "{sys.executable}" "$@"\n')
    site = tmp_path / "site"
    nccl = site / "nvidia" / "nccl"
    (nccl / "include").mkdir(parents=True)
    (nccl / "lib").mkdir()
    (nccl / "include" / "nccl.h").write_text(
        "#define NCCL_MAJOR 2\n#define NCCL_MINOR 28\n#define NCCL_PATCH 9\n")
    (nccl / "include" / "nccl_device.h").write_text("")
    (nccl / "lib" / "libnccl.so.2").write_text("")
    meta = site / "nvidia_nccl_cu13-2.28.9.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: nvidia-nccl-cu13\nVersion: 2.28.9\n")
    env["PYTHONPATH"] = f"{site}{os.pathsep}{env['PYTHONPATH']}"
    env.update(PYTHON=str(python), FASTVIDEO_KERNEL_CACHE=str(tmp_path / "cache"),
               FASTVIDEO_WHEEL_DIR=str(tmp_path / "whl"))
    for name in ("CI", "NCCL_HOME", "FASTVIDEO_SKIP_KERNEL_BUILD"):
        env.pop(name, None)
    return env


def _nccl_home(env: dict[str, str], version: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "scripts/build_kernel.sh", "--print-nccl-home", version], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_offline_the_installed_nccl_serves_its_own_version(tmp_path):
    env = _offline(tmp_path)
    proc = _nccl_home(env, "2.28.9")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"NCCL_HOME={tmp_path / 'site' / 'nvidia' / 'nccl'}" in proc.stdout
    assert "from the installed nvidia-nccl-cu13" in proc.stdout and "fetching" not in proc.stdout


def test_offline_another_version_is_unavailable_with_a_note_naming_it(tmp_path):
    """Exit 3 (the test command's 'skip'), naming the package, the places looked in and the installed version.
    Control: the installed 2.28.9 is not taken for 2.30.7."""
    proc = _nccl_home(_offline(tmp_path), "2.30.7")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "UNAVAILABLE offline: nvidia-nccl-cu13==2.30.7" in proc.stderr
    assert "the installed nvidia-nccl-cu13 is 2.28.9" in proc.stderr and str(tmp_path / "whl") in proc.stderr
    assert "NCCL_HOME=" not in proc.stdout


def test_offline_under_ci_a_missing_download_fails(tmp_path):
    env = _offline(tmp_path)
    env["CI"] = "true"
    proc = _nccl_home(env, "2.30.7")
    assert proc.returncode == 1 and "FAILED under CI, which must download it" in proc.stderr


def test_offline_a_carried_wheel_is_used(tmp_path):
    import zipfile

    env = _offline(tmp_path)
    (tmp_path / "whl").mkdir()
    with zipfile.ZipFile(tmp_path / "whl" / "nvidia_nccl_cu13-2.30.7-py3-none-manylinux_2_27_x86_64.whl", "w") as z:
        z.writestr("nvidia/nccl/include/nccl_device.h", "")
        z.writestr("nvidia/nccl/lib/libnccl.so.2", "")
    proc = _nccl_home(env, "2.30.7")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"NCCL_HOME={tmp_path / 'cache' / 'nccl-2.30.7' / 'nvidia' / 'nccl'}" in proc.stdout
    assert "fetching" not in proc.stdout


def _packed_tree(tmp_path: pathlib.Path, name: str, minor: int) -> None:
    """A stand-in for what scripts/build_nccl.sh packs (include/, lib/), at NCCL 2.MINOR.7, as .whl/upstream/NAME."""
    import io
    import tarfile

    folder = tmp_path / "whl" / "upstream"
    folder.mkdir(parents=True, exist_ok=True)
    files = {"include/nccl.h": f"#define NCCL_MAJOR 2\n#define NCCL_MINOR {minor}\n#define NCCL_PATCH 7\n",
             "include/nccl_device.h": "", "lib/libnccl.so.2": ""}
    with tarfile.open(folder / name, "w:xz") as tar:
        for path, text in files.items():
            info = tarfile.TarInfo(path)
            info.size = len(text.encode())
            tar.addfile(info, io.BytesIO(text.encode()))


def test_offline_a_carried_packed_tree_is_used_and_its_version_checked(tmp_path):
    env = _offline(tmp_path)
    _packed_tree(tmp_path, "nccl-2.30.7-sm90.tar.xz", 30)
    proc = _nccl_home(env, "2.30.7")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"NCCL_HOME={tmp_path / 'cache' / 'nccl-2.30.7-packed'}" in proc.stdout
    assert "from the packed tree" in proc.stdout and "fetching" not in proc.stdout
    again = _nccl_home(env, "2.30.7")  # unpacked once: the second run takes the cache
    assert again.returncode == 0 and "unpacked in" in again.stdout
    # Control: an archive whose headers are another version than its name says is refused, naming both.
    other = tmp_path / "other"
    other.mkdir()
    env = _offline(other)
    _packed_tree(other, "nccl-2.30.7-sm90.tar.xz", 29)
    bad = _nccl_home(env, "2.30.7")
    assert bad.returncode == 1 and "is NCCL 2.29.7, not 2.30.7" in bad.stderr, bad.stdout + bad.stderr
    assert not (other / "cache" / "nccl-2.30.7-packed").exists()


def _fake_nvcc(tmp_path: pathlib.Path, env: dict[str, str]) -> None:
    """An nvcc on PATH, so the test command reaches its kernel build step (it must not get as far as compiling)."""
    bin_dir = tmp_path / "nvcc-bin"
    bin_dir.mkdir()
    (bin_dir / "nvcc").write_text("#!/bin/sh\necho 'fake nvcc: nothing compiles here' >&2\nexit 1\n")
    (bin_dir / "nvcc").chmod(0o755)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"


def _ci_tools(tmp_path: pathlib.Path, env: dict[str, str]) -> None:
    """Every dev tool for the shim python, found as scripts/setup_env.sh looks for them (a module of the python;
    clang-format also an executable beside it): this python's own where it has them, else stand-ins that pass."""
    bin_dir = pathlib.Path(env["FASTVIDEO_PYTHON"]).parent
    lacking = _stand_ins(tmp_path, env)
    clang_format = pathlib.Path(sys.executable).parent / "clang-format"
    if "clang_format" not in lacking and clang_format.exists():
        (bin_dir / "clang-format").symlink_to(clang_format)
    else:
        (bin_dir / "clang-format").write_text("#!/bin/sh\nexit 0\n")
        (bin_dir / "clang-format").chmod(0o755)


def test_the_test_command_offline_skips_the_build_it_cannot_download_and_says_so(tmp_path):
    env = _offline(tmp_path, "ruff clang_format ninja")
    _fake_nvcc(tmp_path, env)
    env.update(FASTVIDEO_KERNEL_NCCL_VERSIONS="2.30.7", FASTVIDEO_PYTEST_ARGS=TARGET)
    proc = subprocess.run(["bash", "scripts/run_tests.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "== kernel build against NCCL 2.30.7: SKIPPED, its headers are not available here" in proc.stdout
    assert _ran_target(proc.stdout)
    assert "kernel build against NCCL 2.30.7 (nvidia-nccl-cu13==2.30.7 unavailable offline)" in \
        proc.stdout.splitlines()[-1]
    # The control: CI can download, so there it is a failure, not a skip. CI has every tool (a missing one fails
    # first, tested above): nothing hidden, and ruff and clang-format present as in CI's venv (stand-ins that pass
    # where this python lacks them, as a GPU host's does: the step under test comes after theirs).
    env.update(CI="true", FASTVIDEO_TEST_HIDE="")
    _ci_tools(tmp_path, env)
    proc = subprocess.run(["bash", "scripts/run_tests.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 1 and "FAILED under CI" in proc.stderr and not _ran_target(proc.stdout)


FAKE_GPU = '''
import os

if os.environ.get("FASTVIDEO_TEST_FAKE_GPU") == "1":
    import torch

    def _visible() -> bool:  # one GPU, hidden as CUDA hides it
        return os.environ.get("CUDA_VISIBLE_DEVICES") != ""

    torch.cuda.is_available = _visible
    torch.cuda.device_count = lambda: 1 if _visible() else 0
'''


def _one_gpu_host(tmp_path: pathlib.Path) -> dict[str, str]:
    """The environment of a shim python (without ruff and clang-format) whose torch reports one GPU, visible, with
    two pytest workers: run_tests.sh's two-session path, the GPU's library left to the command to find."""
    _, env = _shim(tmp_path, "ruff clang_format")
    (tmp_path / "hide" / "sitecustomize.py").write_text(HIDE + FAKE_GPU)
    env.update(FASTVIDEO_TEST_FAKE_GPU="1", FASTVIDEO_PYTEST_WORKERS="2")
    env.pop("CUDA_VISIBLE_DEVICES", None)  # the GPU visible, also where this test runs with a host's GPUs hidden
    env.pop("FASTVIDEO_KERNEL_LIBRARY", None)
    return env


def test_on_a_gpu_host_the_gpu_tests_run_first_in_a_serial_session(tmp_path):
    """A python whose torch reports one GPU (a stand-in: torch.cuda answers as a one-GPU host's, and as a host with
    the GPUs hidden under CUDA_VISIBLE_DEVICES=''): the tests marked gpu run first, serially, then every other test
    on workers with the GPUs hidden; a session that collects nothing is fine when the other collected tests.
    Control: without the stand-in, one session (test_the_test_command_skips_what_the_python_lacks_and_says_so)."""
    env = _one_gpu_host(tmp_path)
    env["FASTVIDEO_PYTEST_ARGS"] = TARGET
    proc = subprocess.run(["bash", "scripts/run_tests.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    gpu = proc.stdout.index("== pytest, serial, the GPUs visible: the tests marked gpu")
    assert proc.stdout.index("== pytest -n 2 --dist worksteal, the GPUs hidden: every test not marked gpu") > gpu
    # The GPU session loads the libraries the command builds, not an installed wheel's.
    built = ROOT / "build" / "kernel" / "libfastvideo_ulysses_a2a.so"
    assert (f"(kernel library: {built}, this command's build)" if built.is_file() else
            "(kernel library: none built here") in proc.stdout
    # the first session deselects them
    assert _ran_target(proc.stdout) and f"{_target_count()} deselected" in proc.stdout


TINY_CONFTEST = """
def pytest_addoption(parser):
    parser.addoption("--ulysses-ambient", default="")
    parser.addoption("--progress-every", type=float, default=0.0)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: takes every GPU")
"""


@pytest.mark.parametrize("with_gpu_test", [False, True])
def test_on_a_gpu_host_the_whole_suite_without_a_gpu_test_fails(tmp_path, with_gpu_test):
    """The whole suite on a GPU host (no FASTVIDEO_PYTEST_ARGS): a GPU session that collects nothing means the host
    ran none of what only it can, and fails the command, saying so. The command runs from a copy of its scripts
    beside a suite of one test (the real suite is too long to run here); control: the same suite with a test marked
    gpu passes (a named subset with none is test_on_a_gpu_host_the_gpu_tests_run_first_in_a_serial_session's)."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    for name in ("run_tests.sh", "setup_env.sh", "ci.sh"):
        (repo / "scripts" / name).write_text((ROOT / "scripts" / name).read_text())
    (repo / "tests").mkdir()
    (repo / "tests" / "conftest.py").write_text(TINY_CONFTEST)
    (repo / "tests" / "test_one.py").write_text(
        "import pytest\n\n\ndef test_cpu():\n    pass\n" +
        ("\n\n@pytest.mark.gpu\ndef test_gpu():\n    pass\n" if with_gpu_test else ""))
    env = _one_gpu_host(tmp_path)
    env["PYTEST_ADDOPTS"] = "-p no:cacheprovider"
    env.pop("FASTVIDEO_PYTEST_ARGS", None)  # the whole suite
    proc = subprocess.run(["bash", "scripts/run_tests.sh"], cwd=repo, env=env, capture_output=True, text=True,
                          timeout=300)
    assert "== pytest, serial, the GPUs visible: the tests marked gpu" in proc.stdout, proc.stdout[-3000:]
    if with_gpu_test:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "collected no tests" not in proc.stdout + proc.stderr
    else:
        assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "pytest collected no tests marked gpu in the whole suite: failing" in proc.stderr


@pytest.mark.parametrize("value,expected", [("", False), ("0", False), ("false", False), ("False", False),
                                            ("true", True), ("1", True), ("yes", True), ("TRUE", True)])
def test_ci_reads_alike_in_the_scripts_and_the_tests(monkeypatch, value, expected):
    """One reading of CI (tests/ci.py and scripts/ci.sh's ``_fv_ci``, which the scripts source), so that no script
    or test treats a value as CI that another treats as a developer's machine."""
    from tests.ci import ci

    monkeypatch.setenv("CI", value)
    shell = subprocess.run(["bash", "-c", "source scripts/ci.sh; _fv_ci"], cwd=ROOT,
                           env={**os.environ, "CI": value}, capture_output=True, text=True, timeout=30)
    assert ci() is expected and (shell.returncode == 0) is expected, (value, shell.returncode, shell.stderr)
