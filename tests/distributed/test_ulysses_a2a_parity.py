"""GPU parity cases: the native gate under pytest. They skip cleanly without 2 GPUs; the gate's own
refusal to run on fewer than 2 GPUs is checked everywhere (it must exit non-zero, never pass)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch

GATE = pathlib.Path(__file__).with_name("check_ulysses_h3_native.py")
ROOT = GATE.parents[2]
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NCCL_NVLS_ENABLE": "0", **extra}
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        env.pop(key, None)
    return env


def test_gate_refuses_to_pass_without_two_gpus():
    if GPUS >= 2:
        pytest.skip("this host has 2+ GPUs; the refusal path is for smaller hosts")
    proc = subprocess.run([sys.executable, str(GATE)], env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "needs 2+ GPUs" in proc.stderr and "nothing was checked" in proc.stderr


@pytest.mark.gpu
@pytest.mark.skipif(GPUS < 2, reason="needs 2+ CUDA GPUs")
@pytest.mark.parametrize("route", ["off", "auto"])
def test_native_gate_quick(route, tmp_path):
    """The gate forces each check's route itself; the ambient route must not change its verdict."""
    out = tmp_path / "gate.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={min(GPUS, 8)}",
           str(GATE), "--quick", "--json", str(out)]
    proc = subprocess.run(cmd, env=_env(FASTVIDEO_ULYSSES_A2A=route), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert " 0 failed" in proc.stdout
