"""CPU smoke tests of the benchmarks: each script runs under torchrun over gloo at a toy size.

They check that the scripts run end to end, write the JSON fields the docs promise, and find zero
wrong elements (the fused pipeline over ``GlooPlanTransport`` against the NCCL route). Timings on
CPU mean nothing and are not checked. Every run gets a clean environment (no ambient
``FASTVIDEO_*`` variable leaks in) and a hard timeout.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
HEADER_FIELDS = {"date", "gpu", "sp_size", "torch", "nccl", "commit", "argv", "native_library"}


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FASTVIDEO_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def _torchrun(script: str, *args: str, nproc: int = 2, timeout: float = 90) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(BENCH / script), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)
    tail = f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}\n{tail}"
    return proc


def _load(path: Path) -> dict:
    data = json.loads(path.read_text())
    assert HEADER_FIELDS <= set(data["header"]), set(data["header"])
    return data


@pytest.mark.timeout(120)
def test_a2a_benchmark_cpu(tmp_path: Path) -> None:
    out = tmp_path / "a2a.json"
    _torchrun("benchmark_ulysses_a2a.py", "--device", "cpu", "--geometry", "toy", "--geometry", "2,64,4,8",
              "--quick", "--overlap", "--require-fused", "--json", str(out),
              "--save-outputs", str(tmp_path / "outputs"))
    data = _load(out)
    assert data["header"]["sp_size"] == 2
    rows = data["rows"]
    assert len(rows) == 2 * 2 * 2  # geometries x modes x routes
    for row in rows:
        for field in ("geometry", "mode", "route", "median_ms", "p10_ms", "p90_ms", "vote_us", "transfer_ms",
                      "fabric_fraction", "wrong", "route_ran", "plan", "gbps"):
            assert field in row, (field, row)
        assert row["wrong"] == 0
        assert row["p10_ms"] <= row["median_ms"] <= row["p90_ms"]
        assert row["route_ran"] == ("fused" if row["route"] == "auto" else "nccl")
        assert row["gemm_slowdown"] is None and "CUDA" in row["overlap_note"]
    assert all(row["plan"] for row in rows if row["route"] == "auto")
    assert (tmp_path / "outputs" / "rank0.safetensors").exists()


@pytest.mark.timeout(60)
def test_a2a_benchmark_sp1(tmp_path: Path) -> None:
    out = tmp_path / "sp1.json"
    _torchrun("benchmark_ulysses_a2a.py", "--device", "cpu", "--quick", "--json", str(out), nproc=1)
    rows = _load(out)["rows"]
    assert rows and all(r["wrong"] == 0 and r["route_ran"].startswith("identity") for r in rows)


@pytest.mark.timeout(180)
def test_a2a_compare_revs(tmp_path: Path) -> None:
    tree_a = tmp_path / "rev_a"
    shutil.copytree(ROOT / "fastvideo", tree_a / "fastvideo", ignore=shutil.ignore_patterns("__pycache__"))
    (tree_a / "COMMIT").write_text("test-export\n")
    out = tmp_path / "cmp.json"
    cmd = [sys.executable, str(BENCH / "benchmark_ulysses_a2a.py"), "--compare-revs", str(tree_a), str(ROOT),
           "--rounds", "1", "--nproc", "2", "--compare-out", str(tmp_path / "runs"), "--json", str(out), "--",
           "--device", "cpu", "--geometry", "toy", "--quick", "--modes", "0"]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["header"]["commit_a"] == "test-export"
    assert {(r["geometry"], r["route"]) for r in data["rows"]} == {("toy", "off"), ("toy", "auto")}
    assert all(r["ratio_b_over_a"] > 0 for r in data["rows"])
    assert data["outputs"] and all(o["identical"] for o in data["outputs"])
    run_a = json.loads((tmp_path / "runs" / "A0.json").read_text())
    assert Path(run_a["header"]["fastvideo_tree"]) == tree_a.resolve()


@pytest.mark.timeout(120)
def test_dit_step_benchmark_cpu(tmp_path: Path) -> None:
    out = tmp_path / "dit.json"
    _torchrun("benchmark_dit_step.py", "--device", "cpu", "--hidden", "64", "--heads", "4", "--blocks", "2",
              "--tokens", "256", "--json", str(out), "--save", str(tmp_path / "save"))
    data = _load(out)
    assert not data["failures"]
    assert data["a2a_share"] and "train" in data["a2a_share"][0]
    rows = data["rows"]
    assert {(r["route"], r["kind"]) for r in rows} == {(a, b) for a in ("off", "auto") for b in ("infer", "train")}
    for row in rows:
        assert len(row["trial_s"]) >= 3 and row["long_training"] == "auto"
        assert row["route_ran"] == ("fused" if row["route"] == "auto" else "nccl")
        if row["kind"] == "infer":
            assert row["wrong"] == 0
        else:
            assert row["grad_ok"] and row["grad_max_abs_diff"] <= row["grad_threshold"]
    assert (tmp_path / "save" / "dit_rank1.safetensors").exists()


@pytest.mark.timeout(60)
def test_dit_step_benchmark_sp1(tmp_path: Path) -> None:
    out = tmp_path / "dit1.json"
    _torchrun("benchmark_dit_step.py", "--device", "cpu", "--hidden", "32", "--heads", "2", "--blocks", "1",
              "--tokens", "64", "--json", str(out), nproc=1)
    data = _load(out)
    assert not data["failures"] and "SP1" in data["a2a_share"][0]["note"]
    assert all(r["route_ran"].startswith("identity") for r in data["rows"])


@pytest.mark.timeout(120)
def test_tune_cpu(tmp_path: Path) -> None:
    out = tmp_path / "tune.json"
    proc = _torchrun("tune_ulysses_a2a.py", "--device", "cpu", "--quick", "--json", str(out))
    data = _load(out)
    assert data["rows"] and all(r["wrong"] == 0 for r in data["rows"])
    assert data["best"] and data["tuned_rows"]
    assert "meaningless" in proc.stdout
    namespace: dict = {}
    exec("import torch\nfrom fastvideo.distributed.ulysses.policy import TunedRow\nT = (\n"
         + "\n".join(data["tuned_rows"]) + "\n)", namespace)
    assert namespace["T"][0].heads == 8
