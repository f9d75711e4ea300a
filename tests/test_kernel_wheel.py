"""``gpu_kernel_wheel`` (``scripts/gpu_lib.sh``) installs the kernel wheel built from this tree, never keeps one
installed earlier, and proves it (``scripts/check_kernel_wheel.py``), on CPU with a stand-in python.

The stand-in (``FAKE_PYTHON``) answers ``-m pip wheel`` with a wheel of a toy ``fastvideo_kernel`` marked ``tree``,
``-m pip install`` by unpacking it into its site folder (or, as pip's "already satisfied" would, by doing nothing),
and the development build by writing a library; anything else runs the real python with that site folder on
``PYTHONPATH``. The site starts with an ``old`` build that loads: a host where an earlier run installed another
tree's kernel.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WHEEL_NAME = "fastvideo_kernel-0.1.0-cp311-cp311-linux_x86_64.whl"
LIB = "libfastvideo_ulysses_a2a.so"

LOADER = '''import os
from pathlib import Path

BUILD = {build!r}
LIBRARY_NAME = {lib!r}


def library_path():
    return Path(os.environ.get("FASTVIDEO_KERNEL_LIBRARY") or Path(__file__).resolve().parent / "lib" / LIBRARY_NAME)


def load():
    if not library_path().is_file():
        raise OSError(f"no kernel library at {{library_path()}}")
    return library_path()
'''

FAKE_PYTHON = '''#!{python}
"""The host's python, for gpu_kernel_wheel: pip wheel, pip install, the development build; the rest runs for real."""
import os
import shutil
import sys
import zipfile
from pathlib import Path

site = Path(os.environ["FAKE_SITE"])
args = sys.argv[1:]
with open(os.environ["FAKE_LOG"], "a") as log:
    log.write(" ".join(args) + "\\n")
if args[:3] == ["-m", "pip", "wheel"]:
    out = Path(args[args.index("--wheel-dir") + 1])
    out.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(out / {wheel!r}, "w") as wheel:
        wheel.writestr("fastvideo_kernel/__init__.py", {tree_loader!r})
        wheel.writestr("fastvideo_kernel/lib/{lib}", b"tree library")
        wheel.writestr("fastvideo_kernel-0.1.0.dist-info/RECORD", "")
    sys.exit(0)
if args[:3] == ["-m", "pip", "install"]:
    if os.environ.get("FAKE_PIP_KEEPS") == "1":  # pip leaving the installed version in place
        print("Requirement already satisfied: fastvideo-kernel")
        sys.exit(0)
    shutil.rmtree(site / "fastvideo_kernel", ignore_errors=True)
    zipfile.ZipFile(args[-1]).extractall(site)
    sys.exit(0)
if args[:1] == ["fastvideo-kernel/build_lib.py"]:
    out = Path(args[args.index("--out") + 1])
    out.mkdir(parents=True, exist_ok=True)
    (out / {lib!r}).write_bytes(b"dev library")
    sys.exit(0)
os.environ["PYTHONPATH"] = str(site)
os.execv(sys.executable, [sys.executable, *args])
'''


def _install(site: Path, build: str, library: bytes) -> None:
    """A ``fastvideo_kernel`` of ``build`` in ``site``, as pip leaves it."""
    (site / "fastvideo_kernel" / "lib").mkdir(parents=True)
    (site / "fastvideo_kernel" / "__init__.py").write_text(LOADER.format(build=build, lib=LIB))
    (site / "fastvideo_kernel" / "lib" / LIB).write_bytes(library)


@pytest.fixture
def host(tmp_path: Path) -> dict[str, str]:
    """The stand-in python, a site folder holding an old build that loads, and the environment to run with them."""
    site = tmp_path / "site"
    _install(site, "old", b"old library")
    python = tmp_path / "python"
    python.write_text(FAKE_PYTHON.format(python=sys.executable, wheel=WHEEL_NAME, lib=LIB,
                                         tree_loader=LOADER.format(build="tree", lib=LIB)))
    python.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FASTVIDEO_") and k != "PYTHONPATH"}
    return {**env, "PYTHON": str(python), "FAKE_SITE": str(site), "FAKE_LOG": str(tmp_path / "calls.log"),
            "WORK": str(tmp_path / "work"), "OUT": str(tmp_path / "work" / "out")}


def _kernel_wheel(env: dict[str, str]) -> tuple[subprocess.CompletedProcess, str, str]:
    """gpu_init then gpu_kernel_wheel: (the run, summary.txt, build.log)."""
    script = ('source scripts/gpu_lib.sh && gpu_init kernel-wheel && gpu_kernel_wheel; '
              'echo "library=${FASTVIDEO_KERNEL_LIBRARY:-} failed=$failed"')
    proc = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    logs = Path(env["WORK"]) / "logs"
    build = logs / "build.log"
    return proc, (logs / "summary.txt").read_text(), build.read_text() if build.exists() else ""


def test_an_installed_kernel_is_replaced_by_this_trees_wheel(host: dict[str, str]) -> None:
    """The old build loads, yet the wheel built from this tree is installed over it and checked."""
    proc, summary, build = _kernel_wheel(host)
    assert proc.returncode == 0, proc.stderr
    site = Path(host["FAKE_SITE"]) / "fastvideo_kernel"
    assert "BUILD = 'tree'" in (site / "__init__.py").read_text()
    assert (site / "lib" / LIB).read_bytes() == b"tree library"
    assert "already installed" not in summary
    for name in ("build kernel wheel", "install kernel wheel (this tree's)", "installed kernel is this tree's"):
        assert any(line.startswith(name) and "rc=0" in line for line in summary.splitlines()), summary
    assert "is the wheel built from this tree, byte for byte, and its library loads" in build
    assert proc.stdout.strip().endswith("library= failed=0")  # the installed wheel, no development build
    assert "-m pip install --force-reinstall --no-deps" in Path(host["FAKE_LOG"]).read_text()


def test_an_install_that_leaves_the_old_kernel_fails_naming_it(host: dict[str, str]) -> None:
    """Negative control: pip keeps the old build (as for a requirement it calls satisfied). The check names both
    files that differ, the script fails, and the run goes on with this tree's development build."""
    proc, summary, build = _kernel_wheel({**host, "FAKE_PIP_KEEPS": "1"})
    assert proc.returncode == 0, proc.stderr
    assert any(line.startswith("installed kernel is this tree's") and "rc=1" in line for line in summary.splitlines())
    assert "MISMATCH: fastvideo_kernel/__init__.py" in build and f"MISMATCH: fastvideo_kernel/lib/{LIB}" in build
    assert "is not the wheel built from this tree" in build
    work = Path(host["WORK"])
    assert proc.stdout.strip().endswith(f"library={work}/kernel/{LIB} failed=1")
    assert (work / "kernel" / LIB).read_bytes() == b"dev library"


def _wheel(path: Path, library: bytes) -> Path:
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr("fastvideo_kernel/__init__.py", LOADER.format(build="tree", lib=LIB))
        wheel.writestr(f"fastvideo_kernel/lib/{LIB}", library)
    return path


def _check(site: Path, wheel: Path, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("FASTVIDEO_")}
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "check_kernel_wheel.py"), str(wheel)],
                          env={**clean, "PYTHONPATH": str(site), **env}, capture_output=True, text=True, timeout=60)


def test_the_check_compares_every_file_and_the_library_load_opens(tmp_path: Path) -> None:
    site = tmp_path / "site"
    _install(site, "tree", b"tree library")
    wheel = _wheel(tmp_path / WHEEL_NAME, b"tree library")
    assert _check(site, wheel).returncode == 0
    (tmp_path / "other").mkdir()
    proc = _check(site, _wheel(tmp_path / "other" / WHEEL_NAME, b"another library"))
    assert proc.returncode == 1 and f"MISMATCH: fastvideo_kernel/lib/{LIB}" in proc.stdout
    assert "__init__.py" not in proc.stdout  # the loader matches: only the library is named
    # A library named by FASTVIDEO_KERNEL_LIBRARY is what load() opens: it must be the wheel's too.
    stray = tmp_path / "stray.so"
    stray.write_bytes(b"stray library")
    proc = _check(site, wheel, FASTVIDEO_KERNEL_LIBRARY=str(stray))
    assert proc.returncode == 1 and f"the library load() opens, {stray}" in proc.stdout
    broken = tmp_path / "broken" / "fastvideo_kernel"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('a broken install')\n")
    proc = _check(broken.parent, wheel)
    assert proc.returncode == 1 and "import fastvideo_kernel failed: a broken install" in proc.stdout
