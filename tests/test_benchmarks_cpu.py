"""CPU smoke tests of the benchmarks: each script runs under torchrun over gloo at a toy size.

They check that the scripts run end to end, write the JSON fields the docs promise, and find zero
wrong elements (the fused pipeline over ``GlooPlanTransport`` against the NCCL route). Timings on
CPU mean nothing and are not checked. Every run gets a clean environment (no ambient
``FASTVIDEO_*`` variable leaks in) and a hard timeout.
"""

from __future__ import annotations

import importlib.util
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


@pytest.mark.timeout(120)
def test_lineup_skew_script(tmp_path: Path) -> None:
    out = tmp_path / "skew.json"
    cmd = [sys.executable, str(BENCH / "measure_lineup_skew.py"), "--iters", "40", "--warmup", "5", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["lineup"] for r in rows] == ["gloo", "shm"] and rows[0]["ran"] == "gloo"
    assert rows[1]["ran"] in ("shm", "gloo")  # shm where the built library loads, else the fallback, named
    assert all(r["iters"] == 40 and 0 <= r["median_us"] <= r["p90_us"] <= r["max_us"] for r in rows)


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


@pytest.mark.timeout(60)
def test_a2a_compare_revs_tree_libraries_need_each_trees_build(tmp_path: Path) -> None:
    """--tree-libraries runs each tree on its own loader and build, and refuses, naming the build command, a
    tree without one (before any run)."""
    tree_a = tmp_path / "rev_a"
    shutil.copytree(ROOT / "fastvideo", tree_a / "fastvideo", ignore=shutil.ignore_patterns("__pycache__"))
    cmd = [sys.executable, str(BENCH / "benchmark_ulysses_a2a.py"), "--compare-revs", str(tree_a), str(ROOT),
           "--tree-libraries", "--rounds", "1", "--", "--device", "cpu", "--geometry", "toy", "--quick"]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=50)
    assert proc.returncode != 0 and "--tree-libraries" in proc.stderr and "build_lib.py --out build/kernel" in \
        proc.stderr, proc.stdout[-2000:] + proc.stderr[-2000:]
    _bench_module()  # benchmarks/ on sys.path
    import benchmark_ulysses_a2a

    assert "--tree-libraries" not in benchmark_ulysses_a2a.child_argv(cmd[2:])


@pytest.mark.timeout(150)
def test_dit_step_benchmark_cpu(tmp_path: Path) -> None:
    out, plot = tmp_path / "dit.json", tmp_path / "dit.png"
    blocks = 2
    proc = _torchrun("benchmark_dit_step.py", "--device", "cpu", "--hidden", "64", "--heads", "4", "--blocks",
                     str(blocks), "--tokens", "256", "--long-training", "auto,chunked", "--json", str(out),
                     "--plot", str(plot), "--save", str(tmp_path / "save"), timeout=140)
    data = _load(out)
    assert not data["failures"] and data["header"]["complete"]
    assert data["header"]["long_training"] == ["auto", "chunked"]
    share = data["a2a_share"][0]
    assert "train" in share and share["train"]["local_s"] > 0 and len(share["train"]["local_trial_s"]) == 3
    rows = data["rows"]
    # The LONG_TRAINING sweep: one auto variant per value; no-grad calls ignore it, so inference rows
    # only for the first value.
    assert [(r["route"], r["long_training"], r["kind"]) for r in rows] == [
        ("off", "auto", "infer"), ("off", "auto", "train"), ("auto", "auto", "infer"), ("auto", "auto", "train"),
        ("auto", "chunked", "train")]
    for row in rows:
        assert len(row["trial_s"]) >= 3
        assert row["route_ran"] == ("fused" if row["route"] == "auto" else "nccl")
        if row["kind"] == "infer":
            assert row["wrong"] == 0
            # The probe saw every call of one inference forward: one per op per block.
            assert row["in_step"]["counts"] == {"out/fwd": blocks, "qkv/fwd": blocks}
        else:
            assert row["grad_ok"] and row["grad_max_abs_diff"] <= row["grad_threshold"]
            # Training with checkpointing: forward, recompute and backward of each op per block.
            assert row["in_step"]["counts"] == {f"{op}/{ph}": blocks for op in ("qkv", "out")
                                                for ph in ("fwd_grad", "recompute", "bwd")}
        assert row["in_step"]["op_device_s"] > 0 and row["op_step_s"] > 0
        assert row["share"] == share[row["kind"]]["share"]
    for row in (r for r in rows if r["route"] == "auto"):
        # Plans per row from the helper history: every call of the row's trials is accounted for.
        assert sum(row["plans"].values()) == row["helper_calls"]["calls"] > 0
        assert all(": fused, original: 36 CTAs" in text for text in row["plans"])
        nccl = next(r for r in rows if r["route"] == "off" and r["kind"] == row["kind"])
        assert row["measured_gain"] == pytest.approx(1 - row["median_s"] / nccl["median_s"])
        # On a loaded CPU the step without the op can measure slower than with it (a negative share): the
        # benchmark then reports no ideal gain rather than a meaningless one (benchmark_dit_step.ideal_gain).
        if row["share"] < 0:
            assert row["ideal_gain"] is None
        else:
            assert row["ideal_gain"] == pytest.approx(row["share"] * (1 - row["op_step_s"] / nccl["op_step_s"]))
        assert row["memory"] is None and row["window_bytes"] > 0  # no CUDA memory stats on CPU
    ops = data["op_level"][0]
    assert set(ops["units_s"]) == {"off", "auto[auto]", "auto[chunked]"}
    assert set(ops["units_s"]["auto[chunked]"]["qkv"]) == {"grad", "fwdbwd"}
    assert all(v > 0 for per in ops["units_s"].values() for u in per.values() for v in u.values())
    # The estimate's step count is the procedure's (warm-up, rotated trials with the local stand-in,
    # check pass, calibration).
    bench = _bench_module()
    assert share["steps_run"] == dict(zip(("infer", "train"), bench.steps_per_tokens(2, 3, local=True)))
    verdicts = {v["target"]: v for v in data["verdicts"]}
    assert len(verdicts) == 7 and "# verdict:" in proc.stdout
    for target, v in verdicts.items():
        expected = "PASS" if target.startswith(("inference bit-identical", "gradients")) else "NOT MEASURED"
        assert v["verdict"] == expected, (target, v)
    if importlib.util.find_spec("matplotlib") is not None:
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and data["plot"]["path"] == str(plot)
    else:
        assert not plot.exists() and "matplotlib" in data["plot"]["skipped"]
    assert (tmp_path / "save" / "dit_rank1.safetensors").exists()


@pytest.mark.timeout(60)
def test_dit_step_benchmark_sp1(tmp_path: Path) -> None:
    out = tmp_path / "dit1.json"
    _torchrun("benchmark_dit_step.py", "--device", "cpu", "--hidden", "32", "--heads", "2", "--blocks", "1",
              "--tokens", "64", "--json", str(out), nproc=1)
    data = _load(out)
    assert not data["failures"] and "SP1" in data["a2a_share"][0]["note"]
    assert all(r["route_ran"].startswith("identity") for r in data["rows"])
    assert all(r["ideal_gain"] is None and r["gain_ok"] is None for r in data["rows"] if r["route"] == "auto")


# ---------------------------------------------------------------------------------------------- DiT: pure parts


def _bench_module():
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    import benchmark_dit_step

    return benchmark_dit_step


TRAIN_COUNTS = {"qkv/fwd_grad": 2, "qkv/recompute": 2, "qkv/bwd": 2, "out/fwd_grad": 2, "out/recompute": 2,
                "out/bwd": 2}
UNITS = {"qkv": {"nograd": 1.0, "grad": 1.5, "fwdbwd": 4.0}, "out": {"nograd": 0.5, "grad": 0.75, "fwdbwd": 2.0}}


def test_dit_step_op_seconds() -> None:
    b = _bench_module()
    # Each forward/backward pair is charged fwd+bwd, each recompute a grad forward.
    assert b.step_op_seconds(TRAIN_COUNTS, UNITS) == pytest.approx(2 * (4.0 + 1.5) + 2 * (2.0 + 0.75))
    assert b.step_op_seconds({"qkv/fwd": 4, "out/fwd": 4}, UNITS) == pytest.approx(4 * 1.0 + 4 * 0.5)
    assert b.step_op_seconds({"qkv/fwd_grad": 3, "qkv/bwd": 2}, UNITS) == pytest.approx(2 * 4.0 + 1.5)
    assert b.step_op_seconds(TRAIN_COUNTS, {"qkv": UNITS["qkv"]}) is None  # a time is missing
    assert b.step_op_seconds({"qkv/bwd": 1}, UNITS) is None  # a backward without its forward


def test_dit_step_engine_restriction() -> None:
    """--engine keeps the table (table) or one engine's rows; for H200 the ce rows come first, the sm rows after."""
    from fastvideo.distributed.ulysses.policy import TUNED_TABLE

    bench = _bench_module()
    assert bench.restrict_engine(TUNED_TABLE, "table") == tuple(TUNED_TABLE)
    sm, ce = bench.restrict_engine(TUNED_TABLE, "sm"), bench.restrict_engine(TUNED_TABLE, "ce")
    assert sm and ce and all(r.engine == "sm" for r in sm) and all(r.engine == "ce" for r in ce)
    assert len(sm) + len(ce) == len(TUNED_TABLE)
    assert {r.heads for r in ce if r.gpu == "H200"} == {r.heads for r in sm if r.gpu == "H200"} == {40, 56}


def test_dit_step_gain_arithmetic() -> None:
    b = _bench_module()
    assert b.ideal_gain(0.10, 0.6, 1.0) == pytest.approx(0.04)
    assert b.ideal_gain(None, 0.6, 1.0) is None and b.ideal_gain(0.1, 0.6, 0.0) is None
    assert b.ideal_gain(-0.3, 2.0, 1.0) is None  # a negative (noise) share never makes a positive ideal
    assert b.measured_gain(0.95, 1.0) == pytest.approx(0.05) and b.measured_gain(1.0, None) is None
    ideal = 0.04
    ok, why = b.gain_check(b.GAIN_FRACTION * ideal, ideal)
    assert ok is True and "of ideal" in why  # exactly 85%: meets the target
    ok, why = b.gain_check(0.84 * ideal, ideal)  # negative control: just below
    assert ok is False and "<" in why
    assert b.gain_check(-0.02, ideal) == (False, b.gain_check(-0.02, ideal)[1])
    assert b.gain_check(0.01, -0.01)[0] is None and b.gain_check(0.01, 0.0)[0] is None  # nothing to gain
    assert b.gain_check(None, ideal)[0] is None


def test_dit_step_memory_check() -> None:
    b = _bench_module()
    gib = 2**30
    # The native window lives outside torch's allocator: the fused peak gets it added.
    assert b.memory_check(10.0, 10.0, gib, window_in_peak=False)["ok"]
    bad = b.memory_check(10.25, 10.0, gib, window_in_peak=False)  # negative control: 0.25 GiB more in torch
    assert not bad["ok"] and bad["fused_total_gib"] == pytest.approx(11.25) and bad["limit_gib"] == 11.0
    assert b.memory_check(10.9, 10.0, gib, window_in_peak=True)["ok"]  # window already in the peak
    assert not b.memory_check(11.1, 10.0, gib, window_in_peak=True)["ok"]
    assert b.memory_check(None, 10.0, gib, window_in_peak=False) is None


def _row(route: str, kind: str, tokens: int = 131072, long: str = "auto", **fields) -> dict:
    row = {"tokens": tokens, "route": route, "kind": kind, "long_training": long, "alloc_retries_total": 0,
           "memory": {"ok": True}, "wrong": 0 if kind == "infer" else None, "gain_ok": True,
           "measured_gain": 0.06, "route_ran": "fused" if route == "auto" else "nccl"}
    if kind == "train":
        row.pop("wrong")
        row["grad_ok"] = True
    row.update(fields)
    return row


def _verdicts(rows: list[dict], **kw) -> dict[str, dict]:
    return {v["target"]: v for v in _bench_module().verdicts(rows, **kw)}


def test_dit_step_verdicts() -> None:
    rows = [_row("off", "infer"), _row("off", "train"), _row("auto", "infer"), _row("auto", "train"),
            _row("auto", "train", long="chunked", measured_gain=0.02)]
    found = _verdicts(rows, sparse=True)
    verdict = {t: v["verdict"] for t, v in found.items()}
    assert verdict["step gain >= 0.85 x ideal gain, every auto row"] == "PASS"
    assert verdict["128k sparse: fused >= 3% faster per training step [long=auto]"] == "PASS"
    assert verdict["128k sparse: fused >= 3% faster per training step [long=chunked]"] == "FAIL"  # 2% < 3%
    assert verdict["128k sparse: fused >= 5% faster per inference step [long=auto]"] == "PASS"
    assert all(found[t]["verdict"] == "PASS" for t in found if not t.startswith("128k"))
    # Negative controls: one row misses each target.
    worse = [dict(r) for r in rows]
    worse[2].update(gain_ok=False, wrong=3, memory={"ok": False}, alloc_retries_total=1, measured_gain=0.04)
    worse[3].update(grad_ok=False)
    bad = _verdicts(worse, sparse=True)
    assert bad["step gain >= 0.85 x ideal gain, every auto row"]["verdict"] == "FAIL"
    assert "131072 auto[auto] infer" in bad["step gain >= 0.85 x ideal gain, every auto row"]["detail"]
    assert bad["128k sparse: fused >= 5% faster per inference step [long=auto]"]["verdict"] == "FAIL"
    for target in ("peak memory <= NCCL route's + window, every auto row", "0 allocator retries, every row",
                   "inference bit-identical to the NCCL route", "gradients within the calibrated threshold"):
        assert bad[target]["verdict"] == "FAIL", target
    # Not measured: a CPU run, a dense run (128k targets), a row with nothing to gain.
    cpu = _verdicts(rows, sparse=True, timing_not_measured="CPU run")
    assert [v["verdict"] for v in cpu.values()].count("NOT MEASURED") == 5
    dense = _verdicts(rows, sparse=False)
    assert dense["128k sparse: fused >= 3% faster per training step"]["verdict"] == "NOT MEASURED"
    unknown = [dict(r, gain_ok=None) if r["route"] == "auto" else r for r in rows]
    assert _verdicts(unknown, sparse=True)["step gain >= 0.85 x ideal gain, every auto row"]["verdict"] == \
        "NOT MEASURED"
    assert _verdicts([], sparse=True)["128k sparse: fused >= 3% faster per training step"]["verdict"] == \
        "NOT MEASURED"


def test_dit_step_reason_candidates() -> None:
    b = _bench_module()
    nccl = {"median_s": 1.0, "trial_s": [0.99, 1.0, 1.01], "op_step_s": 0.10,
            "in_step": {"op_device_s": 0.10, "op_host_s": 0.001}}
    fused = {"median_s": 0.99, "trial_s": [0.985, 0.99, 0.995], "op_step_s": 0.05, "share": 0.08,
             "measured_gain": 0.01, "route_ran": "mixed", "helper_calls": {"declines": {"window": 6}},
             "plans": {}, "in_step": {"op_device_s": 0.07, "op_host_s": 0.004}, "alloc_retries_total": 2}
    text = "\n".join(b.reason_candidates(fused, nccl))
    assert "not every call ran fused (mixed)" in text and "window" in text
    assert "fused 70.00 vs 50.00 ms (+20.00)" in text  # slower inside the step than isolated
    assert "rest of the step (step - op in step): +20.00 ms" in text  # (0.99 - 0.07) - (1.0 - 0.10)
    assert "share-implied NCCL op time 80.00 ms vs its in-step time 100.00 ms" in text
    assert "allocator retries on the fused route: 2" in text
    assert "noise as large as the gain" in text  # 2% spread vs a 1% gain


def test_dit_step_prints_a_missed_target(capsys: pytest.CaptureFixture[str]) -> None:
    b = _bench_module()
    nccl = _row("off", "train", median_s=1.0, trial_s=[1.0] * 3, op_step_s=0.1, in_step={"op_device_s": 0.1})
    fused = _row("auto", "train", median_s=0.99, trial_s=[0.99] * 3, op_step_s=0.05, in_step={"op_device_s": 0.07},
                 share=0.08, ideal_gain=0.04, measured_gain=0.01, gain_fraction=0.25, window_bytes=2**30,
                 plans={"qkv backward: nccl (window)": 2},
                 memory=b.memory_check(10.5, 10.0, 2**30, window_in_peak=False))
    fused["gain_ok"], fused["gain_check"] = b.gain_check(0.01, 0.04)
    fused["reason_candidates"] = b.reason_candidates(fused, nccl)
    b.print_gain_table([nccl, fused])
    b.print_details([nccl, fused])
    out = capsys.readouterr().out
    assert "  NO" in out and "plans 131072 auto[auto] train: qkv backward: nccl (window) x2" in out
    assert "memory 131072 auto[auto] train: fused peak 10.50 GiB, window 1073741824 B" in out and "> NCCL peak" in out
    assert "gain below target" in out and "rest of the step" in out


def test_dit_step_estimate() -> None:
    b = _bench_module()
    # The calibration point: the SP1 32k dense step measured on one H200 (0.460 s, 2.018 s).
    est = b.estimate_seconds(hidden=7168, heads=56, blocks=4, tokens=[32768], world=1, sparse=False, n_long=1,
                             trials=3, share=True, offload=lambda n: False, op_iters=10, op_warmup=2)
    point = est["per_tokens"][0]
    assert point["infer_s"] == pytest.approx(0.460, rel=0.01) and point["train_s"] == pytest.approx(2.018, rel=0.01)
    two = b.estimate_seconds(hidden=7168, heads=56, blocks=2, tokens=[32768, 131072], world=2, sparse=True,
                             n_long=2, trials=3, share=True, offload=lambda n: False, op_iters=10, op_warmup=2)
    small, large = two["per_tokens"]
    assert large["infer_s"] > 4 * small["infer_s"]  # attention grows with the square of the tokens
    assert (large["infer_steps"], large["train_steps"]) == b.steps_per_tokens(2, 3, local=True) == (13, 18)


def test_dit_step_plot_series_and_skip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    b = _bench_module()
    runs = [{"header": {"attention": "flex_attention (90% block-sparse)", "device": "cuda:0"},
             "rows": [_row("off", "train", tokens=t, median_s=t / 1e5, trial_s=[t / 1e5, t / 1e5 * 1.1],
                           offload=t > 131072) for t in (250000, 32768)]
             + [_row("auto", "infer", median_s=1.0, trial_s=[1.0])]}]
    series = b.plot_series(runs)
    assert [p[0] for p in series["train"]["sparse, nccl"]] == [32768, 250000]  # sorted by tokens
    assert series["train"]["sparse, nccl"][1][4] is True  # the offloaded point is marked
    assert list(series["infer"]) == ["sparse, fused long=auto"]
    # Without matplotlib: skipped with a note, no file, no error.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    result = b.write_plot(runs, str(tmp_path / "none.png"))
    assert result["path"] is None and "matplotlib" in result["skipped"] and not (tmp_path / "none.png").exists()


def test_dit_step_plot_written(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    b = _bench_module()
    runs = [{"header": {"attention": "sdpa", "device": "cpu"},
             "rows": [_row("off", "train", tokens=256, median_s=0.1, trial_s=[0.1, 0.12])]}]
    result = b.write_plot(runs, str(tmp_path / "p.png"))
    assert result["skipped"] is None and (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


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
    # Both engines were swept and held to exactness; the structured rows load back as the same TunedRows.
    assert {r["engine"] for r in data["rows"]} == {"sm", "ce"}
    assert [(r.engine, r.ctas, r.planes_per_chunk, r.row_chunks, r.source) for r in namespace["T"]] == [
        (d["engine"], d["ctas"], d["planes_per_chunk"], d["row_chunks"], d["source"]) for d in data["tuned_rows_data"]]

    # The benchmark runs the policy on exactly those rows (--tuned-from), and records them in its header.
    bench = tmp_path / "a2a.json"
    _torchrun("benchmark_ulysses_a2a.py", "--device", "cpu", "--quick", "--tuned-from", str(out), "--json", str(bench))
    result = _load(bench)
    assert result["header"]["tuned_from"]["rows"] == [repr(r) for r in namespace["T"]]
    chosen = namespace["T"][0]
    auto = [r for r in result["rows"] if r["route"] == "auto"]
    assert auto and all(r["route_ran"] == "fused" and r["wrong"] == 0 for r in auto)
    assert all(("copy engine" in r["plan"]) == (chosen.engine == "ce") for r in auto)
