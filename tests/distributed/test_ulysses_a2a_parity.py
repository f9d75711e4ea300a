"""The native gate under pytest. The GPU cases skip cleanly without 2 GPUs; everywhere, the gate's
refusal to run on fewer than 2 GPUs is checked (it must exit non-zero, never pass), and its own logic
runs as a CPU dry run (gloo ranks, CPU transport, sizes / 512) so a bug in the gate is found before a
multi-GPU host is spent on it."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import time

import pytest
import torch

from tests.distributed.conftest import script_env

GATE = pathlib.Path(__file__).with_name("check_ulysses_h3_native.py")
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def test_gate_refuses_to_pass_without_two_gpus():
    if GPUS >= 2:
        pytest.skip("this host has 2+ GPUs; the refusal path is for smaller hosts")
    proc = subprocess.run([sys.executable, str(GATE)], env=script_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "needs 2+ GPUs" in proc.stderr and "nothing was checked" in proc.stderr


@pytest.mark.parametrize("nproc", [2, 3])
def test_gate_logic_cpu_dry_run(nproc):
    """Every gate check over gloo with the CPU transport: SP2 in full, SP3 (padded heads) quick."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(GATE),
           "--cpu-dry-run", *(["--quick"] if nproc > 2 else [])]
    proc = subprocess.run(cmd, env=script_env(), capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert " 0 failed" in proc.stdout and "DRY RUN" in proc.stdout
    assert "PASS negative control" in proc.stdout and "PASS stress" in proc.stdout
    uneven = [line for line in proc.stdout.splitlines() if "PASS uneven parity" in line]
    assert len(uneven) == 4 and sum("copy-engine kind" in line for line in uneven) == 2, uneven
    for check in ("DistributedAttention vs its single-device reference", "upstream parity worker",
                  "negative control: uneven parity", "negative control: DistributedAttention",
                  "negative control: upstream worker"):
        assert f"PASS {check}" in proc.stdout, check


def test_gate_fails_fast_and_together_cpu_dry_run():
    """One rank alone sees a wrong result in stress round 3: every rank reports the failure at once (the
    verdict is agreed before the next round), the gate goes on to its next check and exits 1; on 2x H200
    before the gate agreed its failures, the other rank waited out the 300 s vote instead."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(GATE),
           "--cpu-dry-run", "--quick", "--inject-wrong-round", "3"]
    start = time.monotonic()
    proc = subprocess.run(cmd, env=script_env(FASTVIDEO_ULYSSES_A2A_VOTE_TIMEOUT_S="300"), capture_output=True,
                          text=True, timeout=240)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0, proc.stdout[-3000:]
    assert "FAIL stress" in proc.stdout and "rank 1: round 3" in proc.stdout and "(injected)" in proc.stdout
    assert "PASS negative control" in proc.stdout  # the gate went on after the failed check
    assert " 1 failed" in proc.stdout
    assert elapsed < 200, f"took {elapsed:.0f} s: a rank waited in a vote"


@pytest.mark.gpu
@pytest.mark.skipif(GPUS < 2, reason="needs 2+ CUDA GPUs")
@pytest.mark.parametrize("route", ["off", "auto"])
def test_native_gate_quick(route, tmp_path):
    """The gate forces each check's route itself; the ambient route must not change its verdict."""
    out = tmp_path / "gate.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={min(GPUS, 8)}",
           str(GATE), "--quick", "--json", str(out)]
    proc = subprocess.run(cmd, env=script_env(FASTVIDEO_ULYSSES_A2A=route), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert " 0 failed" in proc.stdout
