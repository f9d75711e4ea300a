"""The main job (README's first command) runs to OK on 2 gloo ranks, and refuses bad geometry clearly."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "FASTVIDEO_ULYSSES_A2A"):
        env.pop(key, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "fastvideo.entrypoints.sp_attention_demo", "--device", "cpu", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=ROOT)


def test_demo_prints_ok_for_both_routes():
    proc = _run("--seq", "96", "--hidden", "64", "--heads", "4")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[-1] == "OK"
    rows = [line for line in lines if line.startswith(("off->", "auto->"))]
    assert len(rows) == 6 and all(row.endswith("OK") for row in rows)
    # On CPU there is no fused transport: auto must say it took the NCCL route and why.
    assert all("auto->nccl (transport_missing)" in row for row in rows if row.startswith("auto"))


def test_demo_rejects_heads_not_divisible_by_sp_size():
    proc = _run("--heads", "3", "--hidden", "48", "--seq", "96")
    assert proc.returncode != 0
    assert "--heads=3 must be divisible by the SP size 2" in proc.stderr
