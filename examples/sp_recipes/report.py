"""The closing table and the plot of the training recipes' runs (``run.json`` records): pure functions, no torch.

    lines, ok = closing_table(runs, resumed=resumed_run, warmup=1)
    note = write_plot(runs + [resumed_run], path, warmup=1)

A run record (written by ``examples/sp_recipes/loop.py``) names its switch (``FASTVIDEO_ULYSSES_A2A``), the
process-group backend, and per step the loss, the step time and the route its all-to-alls took, as the Ulysses
helper recorded it (``route_probe.py``). What the output says, and why:

- the route is named with the backend that carried it: over gloo the NCCL route's code path runs gloo's
  all-to-all (``gloo all_to_all (NCCL-route code path)``), never "nccl";
- timings are the median and the min-max and interquartile range over the steps after the first ``warmup`` of
  each launch (lazy set-up: the first step can take several times a steady one); when two runs took the same
  route, the table says that their timing difference is noise, and gives each run's spread;
- a resumed run is labelled as resumed (from which step) and checked against the run it resumed;
- the plot's time axis leaves the warm-up steps out (its title says how many); the loss axis keeps every step.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["closing_table", "plot_series", "route_kind", "route_name", "run_label", "spread", "step_route_text",
           "timed_steps", "write_plot"]

Run = dict[str, Any]


def route_name(kind: str, backend: str) -> str:
    """What carried a step's all-to-alls, in words: ``kind`` is a step record's ``route["kind"]``."""
    if kind == "nccl":
        if backend == "nccl":
            return "NCCL all_to_all (NCCL route)"
        return f"{backend} all_to_all (NCCL-route code path)"
    if kind == "fused":
        return "fused transport (NCCL device API)"
    if kind == "mixed":
        return f"mixed: fused transport and {route_name('nccl', backend)}"
    if kind == "identity":
        return "none (SP1: the all-to-all is the identity)"
    raise ValueError(f"route_name: unknown route kind {kind!r} (nccl, fused, mixed or identity)")


def step_route_text(route: dict[str, Any], backend: str) -> str:
    """One step's route for its progress line: the name, the helper's call counts, and why it declined."""
    text = route_name(route["kind"], backend)
    if route.get("calls") is None:
        text += f" ({route['source']})"
    else:
        text += f", {route['fused']}/{route['calls']} calls fused"
    if route.get("reasons"):
        text += f", declined: {', '.join(route['reasons'])}"
    return text


def route_kind(run: Run) -> str:
    """The run's route kind: every step's, or ``mixed`` if its steps took different routes."""
    kinds = {s["route"]["kind"] for s in run["steps"]}
    return kinds.pop() if len(kinds) == 1 else "mixed"


def _route_summary(run: Run) -> str:
    kind = route_kind(run)
    text = route_name(kind, run["backend"])
    calls = [s["route"].get("calls") for s in run["steps"]]
    if all(c is not None for c in calls):
        fused = sum(s["route"]["fused"] for s in run["steps"])
        text += f", {fused}/{sum(calls)} calls fused"
    else:
        text += f" ({run['steps'][0]['route']['source']})"
    reasons = sorted({r for s in run["steps"] for r in s["route"].get("reasons") or ()})
    if reasons:
        text += f", declined: {', '.join(reasons)}"
    return text


def run_label(run: Run) -> str:
    """``off``, ``auto``, or ``auto (resumed from step 15)``."""
    resumed = run.get("resumed_from")
    return f"{run['switch']} (resumed from step {resumed['step']})" if resumed else run["switch"]


def timed_steps(run: Run, warmup: int) -> list[dict[str, Any]]:
    """The run's steps after its first ``warmup`` (each launch pays lazy set-up on its first steps)."""
    return run["steps"][warmup:]


def spread(times: Sequence[float]) -> dict[str, float]:
    """Median, min, max and the interquartile range of ``times`` (at least one)."""
    if not times:
        raise ValueError("spread: no timed steps (the run has no steps after its warm-up; run more steps)")
    ordered = sorted(times)
    if len(ordered) >= 2:
        q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
    else:
        q1 = q3 = ordered[0]
    return {"median": statistics.median(ordered), "min": ordered[0], "max": ordered[-1], "q1": q1, "q3": q3}


def _losses(run: Run) -> dict[int, float]:
    return {s["step"]: s["loss"] for s in run["steps"]}


def _span(lo: float, hi: float) -> str:
    return f"{lo:.1f}-{hi:.1f}"


def _fmt_spread(s: dict[str, float]) -> str:
    return f"{s['median']:.1f} ({s['min']:.1f}-{s['max']:.1f}, IQR {s['q1']:.1f}-{s['q3']:.1f})"


def closing_table(runs: Sequence[Run], *, resumed: Run | None = None, warmup: int = 1) -> tuple[list[str], bool]:
    """The closing table's lines and whether every check held: every run's losses equal the first run's, and the
    resumed run's equal the uninterrupted run of its switch for the steps it ran."""
    if not runs:
        raise ValueError("closing_table: no runs")
    if warmup < 0:
        raise ValueError(f"closing_table: warmup={warmup} must be >= 0")
    ref = runs[0]
    ref_losses = _losses(ref)
    all_runs = [*runs, *([resumed] if resumed is not None else [])]
    lines = [f"{ref['model']}: {ref['world_size']} ranks, SP{ref['sp_size']} x DP{ref['dp_size']}, backend "
             f"{ref['backend']} on {ref['device']}, torch {ref['torch']}",
             f"ms/step: the slowest rank's step time, median, min-max and interquartile range over each run's "
             f"steps after its first {warmup} (warm-up, left out)"]
    lines.append(f"{'run':28s} {'steps':>7s} {'first loss':>11s} {'final loss':>11s}  {'median':>8s} "
                 f"{'min-max':>15s} {'IQR':>15s}  losses")
    ok = True
    rows: list[tuple[Run, dict[str, float]]] = []
    for run in all_runs:
        if run is resumed:
            base = next((r for r in runs if r["switch"] == run["switch"]), ref)
            mine = _losses(run)
            same = bool(mine) and all(_losses(base).get(k) == v for k, v in mine.items())
            verdict = f"identical to {base['switch']}" if same else f"DIFFER from {base['switch']}"
        else:
            same = _losses(run) == ref_losses
            verdict = "reference" if run is ref else (f"identical to {ref['switch']}" if same
                                                       else f"DIFFER from {ref['switch']}")
        ok &= same
        timed = [t["step_ms"] for t in timed_steps(run, warmup)]
        first, last = run["steps"][0], run["steps"][-1]
        head = (f"{run_label(run):28s} {first['step']:>3d}-{last['step']:<3d} {first['loss']:11.6f} "
                f"{last['loss']:11.6f}  ")
        if timed:
            s = spread(timed)
            rows.append((run, s))
            lines.append(head + f"{s['median']:8.1f} {_span(s['min'], s['max']):>15s} "
                         f"{_span(s['q1'], s['q3']):>15s}  {verdict}")
        else:
            lines.append(head + f"{'-':>8s} {'-':>15s} {'-':>15s}  {verdict} (no step after the warm-up: untimed)")
    lines.append("all-to-all route per run (from the Ulysses helper's records):")
    for run in all_runs:
        lines.append(f"  {run_label(run)}: {_route_summary(run)}")
    if resumed is not None:
        start = resumed["resumed_from"]["step"]
        mine = _losses(resumed)
        base = next((r for r in runs if r["switch"] == resumed["switch"]), ref)
        same = bool(mine) and all(_losses(base).get(k) == v for k, v in mine.items())
        lines.append(f"resumed: the {resumed['switch']} run restarted from its step {start} checkpoint "
                     f"({resumed['resumed_from']['path']}); steps {min(mine)}-{max(mine)} "
                     f"{'identical to' if same else 'DIFFER from'} the uninterrupted run")
    lines.extend(_noise_notes(rows))
    lines.append("OK: the same losses on every route, and on resume" if ok else "FAIL: the losses differ")
    return lines, ok


def _noise_notes(rows: list[tuple[Run, dict[str, float]]]) -> list[str]:
    """Runs that took the same route: their timing difference is noise; say so, with the spreads."""
    groups: dict[tuple[str, str], list[tuple[Run, dict[str, float]]]] = {}
    for run, s in rows:
        groups.setdefault((route_kind(run), run["backend"]), []).append((run, s))
    notes = []
    for (kind, backend), members in groups.items():
        if len(members) < 2:
            continue
        names = ", ".join(run_label(r) for r, _ in members)
        medians = [s["median"] for _, s in members]
        notes.append(f"note: {names} took the same route ({route_name(kind, backend)}): the same code moved the "
                     f"same bytes, so their step-time difference (medians {min(medians):.1f} to "
                     f"{max(medians):.1f} ms) is noise, not an effect of the switch; spreads, median (min-max, "
                     f"IQR) ms: " + "; ".join(f"{run_label(r)} {_fmt_spread(s)}" for r, s in members))
    return notes


def plot_series(run: Run, warmup: int) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """``(loss points, step-time points)`` of a run as plotted: every step's loss, the step times after the
    first ``warmup`` steps."""
    return ([(s["step"], s["loss"]) for s in run["steps"]],
            [(s["step"], s["step_ms"]) for s in timed_steps(run, warmup)])


def write_plot(runs: Sequence[Run], path: Path, *, warmup: int = 1) -> str:
    """Loss (every step) and step time (after each run's first ``warmup`` steps) per run, resumed runs labelled.
    Returns what happened: ``plot: PATH``, or why it was skipped."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib is not installed (pip install matplotlib, or the package's dev extras)"
    fig, (ax_loss, ax_time) = plt.subplots(1, 2, figsize=(12, 4.2))
    # Identical losses overlap: a wide pale line under a dashed one and markers for the resumed run show all three.
    styles = [{"linewidth": 4, "alpha": 0.4}, {"linewidth": 1.5, "linestyle": "--"},
              {"linewidth": 0, "marker": "o", "markersize": 4, "markerfacecolor": "none"}]
    for i, run in enumerate(runs):
        label, style = run_label(run), styles[i % len(styles)]
        losses, times = plot_series(run, warmup)
        ax_loss.plot(*zip(*losses), label=label, **style)
        if times:
            ax_time.plot(*zip(*times), label=label, **style)
    ax_loss.set(xlabel="step", ylabel="loss", title="loss per run (every step)")
    ax_time.set(xlabel="step", ylabel="ms (slowest rank)")
    ax_time.set_title(f"step time per run (warm-up left out: the first {warmup} step(s) of each run)", fontsize=10)
    for ax in (ax_loss, ax_time):
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    first = runs[0]
    by_route: dict[str, list[str]] = {}
    for run in runs:
        by_route.setdefault(route_name(route_kind(run), run["backend"]), []).append(run_label(run))
    routes = "; ".join(f"{', '.join(names)}: {name}" for name, names in by_route.items())
    fig.suptitle(f"{first['model']}: SP{first['sp_size']} x DP{first['dp_size']}, backend {first['backend']} on "
                 f"{first['device']}, torch {first['torch']}\nall-to-all route: {routes}", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot: {path}"
