"""The upstream peer's loader (``benchmarks/cases/upstream_peer.py``) and the extension build's checks, on CPU:
each import line it points elsewhere must match exactly, or loading fails naming the line (a different upstream
file never runs in its place); the build refuses archives that are not the pinned ones and an NCCL too old."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.cases import upstream_peer

ROOT = Path(__file__).resolve().parents[1]


def test_each_substitution_applies_exactly(tmp_path):
    f = tmp_path / "comm_ops.py"
    f.write_text(f"import torch\n{upstream_peer.EXT_IMPORT}\n")
    out = upstream_peer._substituted(f, {upstream_peer.EXT_IMPORT: ("_ops = X", 1)})
    assert out == "import torch\n_ops = X\n"


def test_negative_control_a_file_without_the_line_is_refused(tmp_path):
    f = tmp_path / "comm_ops.py"
    f.write_text("from somewhere_else import _ops\n")
    with pytest.raises(RuntimeError, match="found 0 times, expected 1"):
        upstream_peer._substituted(f, {upstream_peer.EXT_IMPORT: ("_ops = X", 1)})
    f.write_text(f"{upstream_peer.EXT_IMPORT}\n{upstream_peer.EXT_IMPORT}\n")  # twice where once is expected
    with pytest.raises(RuntimeError, match="found 2 times, expected 1"):
        upstream_peer._substituted(f, {upstream_peer.EXT_IMPORT: ("_ops = X", 1)})


def test_a_missing_build_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"run scripts/build_upstream_comm\.py"):
        upstream_peer.load(tmp_path)


def _build(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "scripts/build_upstream_comm.py", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


def test_the_build_refuses_archives_that_are_not_the_pinned_ones(tmp_path):
    fake = tmp_path / "fastvideo_kernel-0.3.5.tar.gz"
    fake.write_bytes(b"not the sdist")
    proc = _build("--sdist", str(fake), "--wheel", str(fake), "--nccl-home", str(tmp_path), "--out", str(tmp_path))
    assert proc.returncode != 0 and "not the pinned f2c865cd" in proc.stderr
    proc = _build("--sdist", str(tmp_path / "absent.tar.gz"), "--wheel", str(fake), "--nccl-home", str(tmp_path),
                  "--out", str(tmp_path))
    assert proc.returncode != 0 and "does not exist (fetch it into .whl/" in proc.stderr
