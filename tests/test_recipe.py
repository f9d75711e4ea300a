"""The main job, as the README runs it: ``scripts/run_demo.sh`` trains the video DiT recipe on 2 gloo ranks with
``FASTVIDEO_ULYSSES_A2A=off`` and ``=auto``, resumes the auto run from its middle checkpoint, asserts identical
losses in the closing table and writes the plot (or says why not, where matplotlib is missing). Short runs
(``--steps 4``); the compare step's assertion is checked to fail on a run whose loss differs."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def _env(out: pathlib.Path) -> dict[str, str]:
    env = {**os.environ, "FASTVIDEO_PYTHON": sys.executable, "FASTVIDEO_RECIPE_OUT": str(out),
           "FASTVIDEO_RECIPE_DEVICE": "cpu"}
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "FASTVIDEO_ULYSSES_A2A"):
        env.pop(key, None)
    return env


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    out = tmp_path_factory.mktemp("recipe")
    proc = subprocess.run(["bash", "scripts/run_demo.sh", "--steps", "4"], cwd=ROOT, env=_env(out),
                          capture_output=True, text=True, timeout=600)
    return proc, out


def test_the_readme_command_trains_both_routes_to_identical_losses(recipe):
    proc, out = recipe
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    assert "OK: every route trained to the same losses" in lines
    table = {line.split()[0]: line.split() for line in lines if line.split()[:1] in (["off"], ["auto"])}
    assert table["off"][1] == table["auto"][1] == "4" and table["auto"][5] == "identical"
    runs = {r: json.loads((out / r / "run.json").read_text()) for r in ("off", "auto")}
    assert [s["loss"] for s in runs["off"]["steps"]] == [s["loss"] for s in runs["auto"]["steps"]]
    assert (runs["off"]["sp_size"], runs["off"]["backend"], runs["off"]["device"]) == (2, "gloo", "cpu")
    # The route per step, from the helper's records: off has no helper; auto on CPU declined at construction.
    assert {s["route"] for s in runs["off"]["steps"]} == {"nccl"}
    assert {s["route"] for s in runs["auto"]["steps"]} == {"nccl 8/8 (transport_missing)"}
    assert "route nccl 8/8 (transport_missing)" in proc.stderr and "[auto] step 4/4" in proc.stderr  # the bar


def test_the_auto_run_resumes_from_its_middle_checkpoint(recipe):
    proc, out = recipe
    resumed = json.loads((out / "auto_resumed" / "run.json").read_text())
    assert resumed["resumed_from"]["step"] == 2 and resumed["resumed_from"]["path"].endswith("step_000002.safetensors")
    assert [s["step"] for s in resumed["steps"]] == [3, 4]
    assert "resumed auto run from the step 2 checkpoint: steps 3-4 identical to the uninterrupted run" in proc.stdout
    assert sorted(p.name for p in (out / "auto" / "checkpoints").iterdir()) == ["step_000002.safetensors",
                                                                                "step_000004.safetensors"]


def test_the_plot_is_written_or_its_absence_explained(recipe):
    proc, out = recipe
    png = out / "loss_and_step_time.png"
    if MATPLOTLIB:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"plot: {png}" in proc.stdout
    else:
        assert not png.exists()
        assert "plot skipped: matplotlib is not installed" in proc.stdout


def _compare(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fastvideo.sp_recipes.train_video_dit", "compare", *args], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)


def _tampered(path: pathlib.Path, to: pathlib.Path) -> pathlib.Path:
    run = json.loads(path.read_text())
    run["steps"][-1]["loss"] += 2.0 ** -40  # the last step's loss, a few ulps off
    to.write_text(json.dumps(run))
    return to


def test_negative_control_the_comparison_fails_when_a_loss_differs(recipe, tmp_path):
    _, out = recipe
    off, auto = str(out / "off" / "run.json"), str(out / "auto" / "run.json")
    proc = _compare(off, str(_tampered(out / "auto" / "run.json", tmp_path / "auto.json")))
    assert proc.returncode == 1 and "DIFFER" in proc.stdout and "FAIL: the losses differ" in proc.stdout
    resumed = _tampered(out / "auto_resumed" / "run.json", tmp_path / "resumed.json")
    proc = _compare(off, auto, "--resumed", str(resumed))
    assert proc.returncode == 1 and "DIFFER from the uninterrupted run" in proc.stdout


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.gpu
@pytest.mark.skipif(_gpus() < 2, reason="needs 2+ CUDA GPUs")
@pytest.mark.skipif(importlib.util.find_spec("fastvideo_kernel") is None,
                    reason="the kernel wheel is not installed (pip install --no-build-isolation ./fastvideo-kernel)")
def test_the_recipe_on_gpus_takes_the_fused_route_with_identical_losses(tmp_path):
    """One rank per GPU over NCCL (bf16, the small config): auto's every all-to-all fused, losses identical."""
    env = {**_env(tmp_path), "FASTVIDEO_RECIPE_DEVICE": "cuda", "NCCL_NVLS_ENABLE": "0"}
    proc = subprocess.run(["bash", "scripts/run_demo.sh", "--steps", "6"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "OK: every route trained to the same losses" in proc.stdout
    auto = json.loads((tmp_path / "auto" / "run.json").read_text())
    assert auto["backend"] == "nccl" and auto["sp_size"] == _gpus()
    assert all(s["calls"] > 0 and s["fused_calls"] == s["calls"] for s in auto["steps"]), auto["steps"]
