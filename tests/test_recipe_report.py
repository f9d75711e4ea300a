"""The training recipes' closing table and plot (``examples/sp_recipes/report.py``) on synthetic run records:
routes named with the backend that carried them, the noise note only where two runs took the same route, the
resumed run labelled and checked, warm-up steps out of the timings and the time axis. Each with a negative
control (the same check on records where it must come out the other way)."""

from __future__ import annotations

import copy
import importlib.util

import pytest

from sp_recipes import report

NCCL_OFF = {"kind": "nccl", "calls": None, "fused": None, "reasons": [], "source": "switch off: no helper"}
NCCL_DECLINED = {"kind": "nccl", "calls": 8, "fused": 0, "reasons": ["transport_missing"], "source": "helper stats"}
FUSED = {"kind": "fused", "calls": 8, "fused": 8, "reasons": [], "source": "helper stats"}


def _run(switch: str, route: dict, *, backend: str = "gloo", times=(1900.0, 100.0, 110.0, 105.0, 120.0),
         first: int = 1, resumed_from: int | None = None) -> dict:
    steps = [{"step": first + i, "loss": 1.0 / (first + i), "step_ms": t, "route": dict(route)}
             for i, t in enumerate(times)]
    return {"switch": switch, "backend": backend, "device": "cpu" if backend == "gloo" else "cuda", "model": "m",
            "world_size": 2, "sp_size": 2, "dp_size": 1, "torch": "2.x", "steps": steps,
            "resumed_from": {"path": "ckpt", "step": resumed_from} if resumed_from is not None else None}


def test_a_gloo_run_is_never_named_nccl():
    assert report.route_name("nccl", "gloo") == "gloo all_to_all (NCCL-route code path)"
    assert report.route_name("nccl", "nccl") == "NCCL all_to_all (NCCL route)"  # control: over NCCL it is NCCL
    lines, _ = report.closing_table([_run("off", NCCL_OFF), _run("auto", NCCL_DECLINED)])
    routes = [line for line in lines if line.startswith("  off:") or line.startswith("  auto:")]
    assert routes == ["  off: gloo all_to_all (NCCL-route code path) (switch off: no helper)",
                      "  auto: gloo all_to_all (NCCL-route code path), 0/40 calls fused, declined: transport_missing"]
    assert "backend gloo on cpu" in lines[0]
    with pytest.raises(ValueError, match="unknown route kind 'nccl-ish'"):
        report.route_name("nccl-ish", "gloo")


def test_same_route_runs_get_the_noise_note_with_their_spreads():
    lines, ok = report.closing_table([_run("off", NCCL_OFF), _run("auto", NCCL_DECLINED, times=(2000, 300, 310,
                                                                                              305, 320))])
    assert ok
    notes = [line for line in lines if line.startswith("note: ")]
    assert len(notes) == 1, lines
    assert "off, auto took the same route (gloo all_to_all (NCCL-route code path))" in notes[0]
    assert "is noise" in notes[0]
    # each run's spread: median (min-max, IQR) over the steps after the warm-up
    assert "off 107.5 (100.0-120.0, IQR 103.8-112.5)" in notes[0]
    assert "auto 307.5 (300.0-320.0, IQR 303.8-312.5)" in notes[0]


def test_negative_control_runs_on_different_routes_get_no_noise_note():
    lines, ok = report.closing_table([_run("off", NCCL_OFF, backend="nccl"), _run("auto", FUSED, backend="nccl")])
    assert ok and not [line for line in lines if line.startswith("note: ")], lines
    assert "  auto: fused transport (NCCL device API), 40/40 calls fused" in lines


def test_the_resumed_run_is_labelled_and_checked_against_its_uninterrupted_run():
    off, auto = _run("off", NCCL_OFF), _run("auto", NCCL_DECLINED)
    resumed = _run("auto", NCCL_DECLINED, times=(900.0, 100.0, 101.0), first=3, resumed_from=2)
    lines, ok = report.closing_table([off, auto], resumed=resumed)
    assert ok
    assert any(line.startswith("auto (resumed from step 2)") and line.endswith("identical to auto") for line in lines)
    assert any(line.startswith("resumed: the auto run restarted from its step 2 checkpoint (ckpt); steps 3-5 "
                               "identical to the uninterrupted run") for line in lines)
    assert lines[-1] == "OK: the same losses on every route, and on resume"
    # Negative control: one resumed loss a few ulps off fails the check and the verdict.
    bad = copy.deepcopy(resumed)
    bad["steps"][-1]["loss"] += 2.0 ** -40
    lines, ok = report.closing_table([off, auto], resumed=bad)
    assert not ok and lines[-1] == "FAIL: the losses differ"
    assert any("DIFFER from the uninterrupted run" in line for line in lines)


def test_negative_control_a_differing_loss_fails_the_table():
    auto = _run("auto", NCCL_DECLINED)
    auto["steps"][2]["loss"] += 1e-12
    lines, ok = report.closing_table([_run("off", NCCL_OFF), auto])
    assert not ok and any(line.startswith("auto ") and line.endswith("DIFFER from off") for line in lines)


def test_warmup_steps_are_left_out_of_the_timings_and_the_time_axis():
    run = _run("off", NCCL_OFF)  # step 1 takes 1900 ms, the others 100-120
    assert report.spread([s["step_ms"] for s in report.timed_steps(run, 1)])["max"] == 120.0
    losses, times = report.plot_series(run, warmup=1)
    assert [s for s, _ in losses] == [1, 2, 3, 4, 5] and [s for s, _ in times] == [2, 3, 4, 5]
    lines, _ = report.closing_table([run], warmup=1)
    assert "steps after its first 1 (warm-up, left out)" in lines[1]
    assert "1900.0" not in "\n".join(lines)
    # Negative control: with no warm-up left out the first step is in both.
    assert report.spread([s["step_ms"] for s in report.timed_steps(run, 0)])["max"] == 1900.0
    assert [s for s, _ in report.plot_series(run, warmup=0)[1]] == [1, 2, 3, 4, 5]
    assert "1900.0" in "\n".join(report.closing_table([run], warmup=0)[0])


def test_a_run_with_no_step_after_its_warmup_is_shown_untimed():
    off = _run("off", NCCL_OFF)
    resumed = _run("off", NCCL_OFF, times=(900.0,), first=5, resumed_from=4)
    lines, ok = report.closing_table([off], resumed=resumed)
    assert ok and any("(no step after the warm-up: untimed)" in line for line in lines)


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib is not installed")
def test_the_plot_holds_every_run_the_resumed_one_labelled(tmp_path):
    resumed = _run("auto", NCCL_DECLINED, times=(900.0, 100.0, 101.0), first=3, resumed_from=2)
    note = report.write_plot([_run("off", NCCL_OFF), _run("auto", NCCL_DECLINED), resumed], tmp_path / "p.png")
    assert note == f"plot: {tmp_path / 'p.png'}"
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report.run_label(resumed) == "auto (resumed from step 2)"
