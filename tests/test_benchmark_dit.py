"""The DiT step benchmark's pure parts: the op time per step, the gain arithmetic and the memory footprint
(``benchmarks/dit/runner.py``), the targets and verdicts (``benchmarks/check_results.py``), the tables and the plot
(``benchmarks/dit/report.py``) and the estimate (``benchmarks/dit/estimate.py``). Every target has a negative
control: a row that just misses it fails it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from benchmarks import check_results
from benchmarks.dit import estimate, report, runner

TRAIN_COUNTS = {"qkv/fwd_grad": 2, "qkv/recompute": 2, "qkv/bwd": 2, "out/fwd_grad": 2, "out/recompute": 2,
                "out/bwd": 2}
UNITS = {"qkv": {"nograd": 1.0, "grad": 1.5, "fwdbwd": 4.0}, "out": {"nograd": 0.5, "grad": 0.75, "fwdbwd": 2.0}}


def test_op_seconds_per_step() -> None:
    # Each forward/backward pair is charged fwd+bwd, each recompute a grad forward.
    assert runner.step_op_seconds(TRAIN_COUNTS, UNITS) == pytest.approx(2 * (4.0 + 1.5) + 2 * (2.0 + 0.75))
    assert runner.step_op_seconds({"qkv/fwd": 4, "out/fwd": 4}, UNITS) == pytest.approx(4 * 1.0 + 4 * 0.5)
    assert runner.step_op_seconds({"qkv/fwd_grad": 3, "qkv/bwd": 2}, UNITS) == pytest.approx(2 * 4.0 + 1.5)
    assert runner.step_op_seconds(TRAIN_COUNTS, {"qkv": UNITS["qkv"]}) is None  # a time is missing
    assert runner.step_op_seconds({"qkv/bwd": 1}, UNITS) is None  # a backward without its forward


def test_engine_restriction() -> None:
    """--engine keeps the table (table) or one engine's rows; for H200 both engines have rows for H = 40 and 56."""
    from fastvideo.distributed.ulysses.policy import TUNED_TABLE

    assert runner.restrict_engine(TUNED_TABLE, "table") == tuple(TUNED_TABLE)
    sm, ce = runner.restrict_engine(TUNED_TABLE, "sm"), runner.restrict_engine(TUNED_TABLE, "ce")
    assert sm and ce and all(r.engine == "sm" for r in sm) and all(r.engine == "ce" for r in ce)
    assert len(sm) + len(ce) == len(TUNED_TABLE)
    assert {r.heads for r in ce if r.gpu == "H200"} == {r.heads for r in sm if r.gpu == "H200"} == {40, 56}


def test_gain_arithmetic_and_the_gain_target() -> None:
    assert runner.ideal_gain(0.10, 0.6, 1.0) == pytest.approx(0.04)
    assert runner.ideal_gain(None, 0.6, 1.0) is None and runner.ideal_gain(0.1, 0.6, 0.0) is None
    assert runner.ideal_gain(-0.3, 2.0, 1.0) is None  # a negative (noise) share never makes a positive ideal
    assert runner.measured_gain(0.95, 1.0) == pytest.approx(0.05) and runner.measured_gain(1.0, None) is None
    ideal = 0.04
    ok, why = check_results.gain_check(check_results.GAIN_FRACTION * ideal, ideal)
    assert ok is True and "of ideal" in why  # exactly 85%: meets the target
    ok, why = check_results.gain_check(0.84 * ideal, ideal)  # negative control: just below
    assert ok is False and "<" in why
    assert check_results.gain_check(-0.02, ideal)[0] is False
    assert check_results.gain_check(0.01, -0.01)[0] is None and check_results.gain_check(0.01, 0.0)[0] is None
    assert check_results.gain_check(None, ideal)[0] is None


def test_memory_footprint_and_its_target() -> None:
    gib = 2**30
    # The native window lives outside torch's allocator: the fused peak gets it added.
    same = runner.memory_use(10.0, 10.0, gib, window_in_peak=False)
    assert check_results.memory_ok(same) is True
    bad = runner.memory_use(10.25, 10.0, gib, window_in_peak=False)  # negative control: 0.25 GiB more in torch
    assert check_results.memory_ok(bad) is False
    assert bad["fused_total_gib"] == pytest.approx(11.25) and bad["limit_gib"] == 11.0
    assert check_results.memory_ok(runner.memory_use(10.9, 10.0, gib, window_in_peak=True))  # window in the peak
    assert not check_results.memory_ok(runner.memory_use(11.1, 10.0, gib, window_in_peak=True))
    assert runner.memory_use(None, 10.0, gib, window_in_peak=False) is None and check_results.memory_ok(None) is None


def _row(route: str, kind: str, tokens: int = 131072, long: str = "auto", **fields) -> dict:
    row = {"tokens": tokens, "route": route, "kind": kind, "long_training": long, "alloc_retries_total": 0,
           "memory": runner.memory_use(10.0, 10.0, 2**30, window_in_peak=False), "wrong": 0,
           "measured_gain": 0.06, "ideal_gain": 0.06, "route_ran": "fused" if route == "auto" else "nccl",
           "wrong_oracle": "the NCCL route's"}
    if kind == "train":
        row["grad_ok"] = True
    row.update(fields)
    return row


def _verdicts(rows: list[dict], **kw) -> dict[str, dict]:
    return {v["target"]: v for v in check_results.dit_verdicts(rows, **kw)}


def test_dit_verdicts_and_their_negative_controls() -> None:
    rows = [_row("off", "infer"), _row("off", "train"), _row("auto", "infer"), _row("auto", "train"),
            _row("auto", "train", long="chunked", measured_gain=0.02, ideal_gain=0.02)]
    found = _verdicts(rows, sparse=True)
    verdict = {t: v["verdict"] for t, v in found.items()}
    assert verdict["step gain >= 0.85 x ideal gain, every auto row"] == "PASS"
    assert verdict["128k sparse: fused >= 3% faster per training step [long=auto]"] == "PASS"
    assert verdict["128k sparse: fused >= 3% faster per training step [long=chunked]"] == "FAIL"  # 2% < 3%
    assert verdict["128k sparse: fused >= 5% faster per inference step [long=auto]"] == "PASS"
    assert all(found[t]["verdict"] == "PASS" for t in found if not t.startswith("128k"))
    # Negative controls: one row misses each target.
    worse = [dict(r) for r in rows]
    worse[2].update(measured_gain=0.04, ideal_gain=0.06, wrong=3, alloc_retries_total=1,
                    memory=runner.memory_use(10.5, 10.0, 2**30, window_in_peak=False))
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
    nothing = [dict(r, ideal_gain=-0.01) if r["route"] == "auto" else r for r in rows]
    assert _verdicts(nothing, sparse=True)["step gain >= 0.85 x ideal gain, every auto row"]["verdict"] == \
        "NOT MEASURED"
    assert _verdicts([], sparse=True)["128k sparse: fused >= 3% faster per training step"]["verdict"] == \
        "NOT MEASURED"


def test_a2a_verdicts() -> None:
    rows = [{"geometry": "g", "mode": 0, "route": "nccl", "sp_size": 2, "wrong": 0, "host_overhead_us": None},
            {"geometry": "g", "mode": 0, "route": "fused", "sp_size": 2, "wrong": 0, "route_ran": "fused",
             "host_overhead_us": 25.0}]
    assert [v["verdict"] for v in check_results.a2a_verdicts(rows)] == ["PASS", "PASS", "PASS"]
    slow = [rows[0], dict(rows[1], host_overhead_us=31.0, route_ran="mixed", wrong=1)]
    assert [v["verdict"] for v in check_results.a2a_verdicts(slow)] == ["FAIL", "FAIL", "FAIL"]
    assert check_results.a2a_verdicts(rows, timing_not_measured="CPU")[2]["verdict"] == "NOT MEASURED"


def test_reason_candidates() -> None:
    nccl = {"median_s": 1.0, "trial_s": [0.99, 1.0, 1.01], "op_step_s": 0.10,
            "in_step": {"op_device_s": 0.10, "op_host_s": 0.001}}
    fused = {"median_s": 0.99, "trial_s": [0.985, 0.99, 0.995], "op_step_s": 0.05, "share": 0.08,
             "measured_gain": 0.01, "route_ran": "mixed", "helper_calls": {"declines": {"window": 6}},
             "plans": {}, "in_step": {"op_device_s": 0.07, "op_host_s": 0.004}, "alloc_retries_total": 2}
    text = "\n".join(runner.reason_candidates(fused, nccl))
    assert "not every call ran fused (mixed)" in text and "window" in text
    assert "fused 70.00 vs 50.00 ms (+20.00)" in text  # slower inside the step than isolated
    assert "rest of the step (step - op in step): +20.00 ms" in text  # (0.99 - 0.07) - (1.0 - 0.10)
    assert "share-implied NCCL op time 80.00 ms vs its in-step time 100.00 ms" in text
    assert "allocator retries on the fused route: 2" in text
    assert "noise as large as the gain" in text  # 2% spread vs a 1% gain


def test_tables_and_the_reasons_of_a_missed_target() -> None:
    nccl = _row("off", "train", median_s=1.0, trial_s=[1.0] * 3, op_step_s=0.1, in_step={"op_device_s": 0.1},
                grad_max_abs_diff=0.0, grad_threshold=0.0, peak_mem_gib=10.0)
    fused = _row("auto", "train", median_s=0.99, trial_s=[0.99] * 3, op_step_s=0.05, in_step={"op_device_s": 0.07},
                 share=0.08, ideal_gain=0.04, measured_gain=0.01, gain_fraction=0.25, window_bytes=2**30,
                 plans={"qkv backward: nccl (window)": 2}, grad_max_abs_diff=0.0, grad_threshold=0.0,
                 peak_mem_gib=10.5, memory=runner.memory_use(10.5, 10.0, 2**30, window_in_peak=False))
    fused["reason_candidates"] = runner.reason_candidates(fused, nccl)
    text = "\n".join(report.step_table([nccl, fused]) + report.gain_table([nccl, fused])
                     + report.detail_lines([nccl, fused]))
    assert "plans 131072 auto[auto] train: qkv backward: nccl (window) x2" in text
    assert "memory 131072 auto[auto] train: fused peak 10.50 GiB, window 1073741824 B" in text
    assert "NCCL peak 10.00 + window = 11.00 GiB" in text and "# #wrong: the NCCL route's" in text
    reasons = "\n".join(check_results.dit_reasons([nccl, fused]))
    assert "gain below target" in reasons and "rest of the step" in reasons
    fused.update(measured_gain=0.039)
    assert "gain below target" not in "\n".join(check_results.dit_reasons([nccl, fused]))  # 97% of ideal: met


def test_estimate() -> None:
    # The calibration point: the SP1 32k dense step measured on one H200.
    est = estimate.estimate_seconds(hidden=7168, heads=56, blocks=4, tokens=[32768], world=1, sparse=False, n_long=1,
                                    trials=3, share=True, offload=lambda n: False, op_iters=10, op_warmup=2)
    point = est["per_tokens"][0]
    assert point["infer_s"] == pytest.approx(0.460, rel=0.01) and point["train_s"] == pytest.approx(2.018, rel=0.01)
    two = estimate.estimate_seconds(hidden=7168, heads=56, blocks=2, tokens=[32768, 131072], world=2, sparse=True,
                                    n_long=2, trials=3, share=True, offload=lambda n: False, op_iters=10, op_warmup=2)
    small, large = two["per_tokens"]
    assert large["infer_s"] > 4 * small["infer_s"]  # attention grows with the square of the tokens
    assert (large["infer_steps"], large["train_steps"]) == estimate.steps_per_tokens(2, 3, local=True) == (13, 18)


def test_plot_series_and_skip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runs = [{"header": {"attention": "flex_attention (90% block-sparse)", "device": "cuda:0"},
             "rows": [_row("off", "train", tokens=t, median_s=t / 1e5, trial_s=[t / 1e5, t / 1e5 * 1.1],
                           offload=t > 131072) for t in (250000, 32768)]
             + [_row("auto", "infer", median_s=1.0, trial_s=[1.0])]}]
    series = report.plot_series(runs)
    assert [p[0] for p in series["train"]["sparse, nccl"]] == [32768, 250000]  # sorted by tokens
    assert series["train"]["sparse, nccl"][1][4] is True  # the offloaded point is marked
    assert list(series["infer"]) == ["sparse, fused long=auto"]
    # Without matplotlib: skipped with a note, no file, no error.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    result = report.write_plot(runs, str(tmp_path / "none.png"))
    assert result["path"] is None and "matplotlib" in result["skipped"] and not (tmp_path / "none.png").exists()


def test_plot_written(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    runs = [{"header": {"attention": "sdpa", "device": "cpu"},
             "rows": [_row("off", "train", tokens=256, median_s=0.1, trial_s=[0.1, 0.12])]}]
    result = report.write_plot(runs, str(tmp_path / "p.png"))
    assert result["skipped"] is None and (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
