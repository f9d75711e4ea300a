"""``doctor`` from an installed wheel: the package built with ``pip wheel``, installed into a fresh venv, and run
from a directory outside the checkout with the checkout nowhere on ``sys.path``.

Torch and the other dependencies come from this interpreter's site-packages, named alone in a ``.pth`` file of
the fresh venv (its own ``.pth`` files, such as an editable install of this checkout, are not processed there).
Negative control: the probe asserts where ``fastvideo`` was imported from, so a run that found the checkout
would fail; and doctor, which once located the repository from its own file, must not name a development build
or a source directory that an installed wheel does not have.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.ci import ci

ROOT = Path(__file__).resolve().parents[1]


def _run(*argv: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=300, **kw)


def _backend_missing() -> str | None:
    """Why this interpreter cannot build the wheel without a download (pyproject's ``setuptools>=77``: the SPDX
    ``license`` string), or None."""
    try:
        version = importlib.metadata.version("setuptools")
    except importlib.metadata.PackageNotFoundError:
        return "setuptools is not installed"
    major = version.split(".")[0]
    return None if major.isdigit() and int(major) >= 77 else f"setuptools {version} is older than the build's >=77"


def test_doctor_runs_from_a_wheel_in_a_fresh_venv_outside_the_checkout(tmp_path):
    missing = _backend_missing()
    if missing:  # the suite's rule for a missing tool: a note here, a failure under CI
        why = f"{missing}: pip install 'setuptools>=77' to build this package's wheel"
        if ci():
            pytest.fail(why)
        pytest.skip(why)
    source = tmp_path / "source"  # a copy: building in the checkout would leave build/ and *.egg-info in the tree
    shutil.copytree(ROOT / "fastvideo", source / "fastvideo", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    built = _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
                 "-w", str(tmp_path / "dist"), str(source))
    assert built.returncode == 0, built.stdout + built.stderr
    wheel = next((tmp_path / "dist").glob("fastvideo-*.whl"))
    venv = tmp_path / "venv"
    made = _run(sys.executable, "-m", "venv", "--without-pip", str(venv))
    assert made.returncode == 0, made.stderr
    python = venv / "bin" / "python"
    site = Path(_run(str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip())
    installed = _run(sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target", str(site),
                     str(wheel))
    assert installed.returncode == 0, installed.stdout + installed.stderr
    (site / "dependencies.pth").write_text(str(Path(sysconfig.get_paths()["purelib"]).resolve()) + "\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FASTVIDEO_KERNEL_LIBRARY")}

    program = "import json, sys, fastvideo; print(fastvideo.__file__); print(json.dumps(sys.path))"
    probe = _run(str(python), "-c", program, cwd=elsewhere, env=env)
    assert probe.returncode == 0, probe.stderr
    where, path = probe.stdout.splitlines()
    assert Path(where).resolve().is_relative_to(site.resolve()), where
    assert str(ROOT) not in json.loads(path), path

    doctor = _run(str(python), "-m", "fastvideo.distributed.ulysses", "doctor", cwd=elsewhere, env=env)
    out = doctor.stdout
    assert doctor.returncode == 0 and "Traceback" not in doctor.stderr, out + doctor.stderr
    assert "development build: -  [none: this package is installed, not run from a checkout]" in out, out
    assert "fastvideo-kernel:" not in out and "build/kernel" not in out, out  # no checkout path to advise
    assert str(ROOT) not in out.replace(str(Path(sysconfig.get_paths()["purelib"]).resolve()), ""), out
    assert any(ln.startswith("fused      blocked at ") for ln in out.splitlines()), out
