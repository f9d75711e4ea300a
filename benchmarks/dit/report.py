"""The DiT step benchmark's printed tables and its plot. Pure: they read rows as the JSON holds them.

The verdicts against the targets are not here: ``benchmarks/check_results.py`` judges a run's JSON.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

OPS = ("qkv", "out")  # the step's two all-to-alls: packed QKV (mode 0) and the attention output (mode 1)


def _f(value, fmt: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, fmt)


def row_name(r: dict) -> str:
    long = f"[{r.get('long_training')}]" if r.get("route") == "auto" else ""
    return f"{r.get('tokens')} {r.get('route')}{long} {r.get('kind')}"


def share_line(share: dict) -> str:
    if "infer" not in share:
        return f"# a2a share at {share['tokens']} tokens: {share.get('note')}"
    i, t = share["infer"], share["train"]
    return (f"# a2a share at {share['tokens']} tokens (NCCL route): inference {i['share'] * 100:.1f}% "
            f"({i['nccl_s']:.4f} s vs {i['local_s']:.4f} s local), training {t['share'] * 100:.1f}% "
            f"({t['nccl_s']:.4f} s vs {t['local_s']:.4f} s local)")


def op_level_line(ops: dict) -> str:
    parts = []
    for key, per in ops["units_s"].items():
        cells = " ".join(f"{op} " + "/".join(_f(per[op].get(k), ".3f", 1e3) for k in ("nograd", "grad", "fwdbwd"))
                         for op in OPS if op in per)
        parts.append(f"{key}: {cells}")
    return (f"# op level at {ops['tokens']} tokens, ms per call (no-grad/grad fwd/fwd+bwd), the step's shapes: "
            + "; ".join(parts))


def step_table(rows: list[dict]) -> list[str]:
    out = [f"{'tokens':>7} {'route':>5} {'long':>7} {'kind':>5} {'ran':>8} {'median s':>9} {'min s':>8} {'max s':>8} "
           f"{'retries':>7} {'peak GiB':>8} {'grad diff':>10} {'thresh':>10} {'#wrong':>6}"]
    for r in rows:
        retries = "-" if r["alloc_retries_total"] is None else str(r["alloc_retries_total"])
        diff = f"{r['grad_max_abs_diff']:10.3g}" if "grad_max_abs_diff" in r else f"{'-':>10}"
        thresh = f"{r['grad_threshold']:10.3g}" if "grad_threshold" in r else f"{'-':>10}"
        out.append(f"{r['tokens']:>7} {r['route']:>5} {r['long_training']:>7} {r['kind']:>5} {r['route_ran'][:8]:>8} "
                   f"{r['median_s']:9.4f} {min(r['trial_s']):8.4f} {max(r['trial_s']):8.4f} {retries:>7} "
                   f"{_f(r['peak_mem_gib'], '.1f'):>8} {diff} {thresh} {r['wrong']:>6}")
    oracles = sorted({r["wrong_oracle"] for r in rows})
    return out + [f"# #wrong: {text}" for text in oracles]


def gain_table(rows: list[dict]) -> list[str]:
    """Auto rows against the NCCL row of the same tokens and kind (the measured quantities; no verdicts)."""
    nccl = {(r["tokens"], r["kind"]): r for r in rows if r["route"] == "off"}
    auto = [r for r in rows if r["route"] == "auto"]
    if not auto:
        return []
    out = ["", f"{'tokens':>7} {'long':>7} {'kind':>5} {'share%':>6} {'opN ms':>8} {'opF ms':>8} {'op x':>5} "
               f"{'ideal%':>6} {'meas%':>6} {'%ideal':>6} {'inN ms':>8} {'inF ms':>8} {'memF GiB':>8} {'limit':>6}"]
    for r in auto:
        n = nccl.get((r["tokens"], r["kind"]), {})
        mem = r.get("memory") or {}
        out.append(f"{r['tokens']:>7} {r['long_training']:>7} {r['kind']:>5} {_f(r.get('share'), '6.1f', 100)} "
                   f"{_f(n.get('op_step_s'), '8.2f', 1e3)} {_f(r.get('op_step_s'), '8.2f', 1e3)} "
                   f"{_f(r.get('op_speedup'), '5.2f')} {_f(r.get('ideal_gain'), '6.2f', 100)} "
                   f"{_f(r.get('measured_gain'), '6.2f', 100)} {_f(r.get('gain_fraction'), '6.0f', 100)} "
                   f"{_f((n.get('in_step') or {}).get('op_device_s'), '8.2f', 1e3)} "
                   f"{_f((r.get('in_step') or {}).get('op_device_s'), '8.2f', 1e3)} "
                   f"{_f(mem.get('fused_total_gib'), '.2f'):>8} {_f(mem.get('limit_gib'), '.2f'):>6}")
    return out


def detail_lines(rows: list[dict]) -> list[str]:
    out = []
    for r in rows:
        if r["route"] != "auto":
            continue
        for text, calls in (r.get("plans") or {}).items():
            out.append(f"#   plans {row_name(r)}: {text} x{calls}")
        mem = r.get("memory")
        if mem:
            where = "inside" if mem["window_in_peak"] else "outside torch's allocator, added"
            out.append(f"#   memory {row_name(r)}: fused peak {mem['fused_peak_gib']:.2f} GiB, window "
                       f"{mem['window_bytes']} B ({where}) -> {mem['fused_total_gib']:.2f} GiB; NCCL peak "
                       f"{mem['nccl_peak_gib']:.2f} + window = {mem['limit_gib']:.2f} GiB")
    return out


# ---------------------------------------------------------------------------------------------- plot


Point = tuple[int, float, float, float, bool]  # tokens, median s, min s, max s, activations offloaded


def plot_series(runs: Sequence[dict]) -> dict[str, dict[str, list[Point]]]:
    """kind -> series label -> [(tokens, median, min, max, offload)] from saved runs (``{"header", "rows"}``)."""
    out: dict[str, dict[str, list[Point]]] = {"infer": {}, "train": {}}
    for run in runs:
        header = run.get("header", {})
        attn = "sparse" if "flex" in str(header.get("attention", "")) else "dense"
        for r in run.get("rows", []):
            if r.get("kind") not in out or not r.get("trial_s"):
                continue
            route = "nccl" if r["route"] == "off" else f"fused long={r.get('long_training')}"
            # One line per route across token counts; offloaded points are marked in the JSON (offload).
            out[r["kind"]].setdefault(f"{attn}, {route}", []).append(
                (r["tokens"], r["median_s"], min(r["trial_s"]), max(r["trial_s"]), bool(r.get("offload"))))
    return {k: {label: sorted(points) for label, points in v.items()} for k, v in out.items()}


def write_plot(runs: Sequence[dict], path: str) -> dict:
    """Step time per route against tokens (inference and training panels); matplotlib where installed.

    Returns ``{"path": path or None, "skipped": reason or None}``: without matplotlib the plot is
    skipped with a note, never an error (the JSON holds every number the plot shows).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on the GPU hosts
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return {"path": None, "skipped": f"matplotlib not installed ({exc}); the JSON has the numbers"}
    series = plot_series(runs)
    # One colour per series in both panels (NCCL lines first).
    labels = sorted({label for per in series.values() for label in per}, key=lambda t: ("fused" in t, t))
    colour = {label: f"C{i % 10}" for i, label in enumerate(labels)}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, kind in zip(axes, ("infer", "train")):
        for label in (t for t in labels if t in series[kind]):
            points = series[kind][label]
            xs = [p[0] for p in points]
            ys = [p[1] for p in points]
            err = [[p[1] - p[2] for p in points], [p[3] - p[1] for p in points]]
            ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=label, color=colour[label])
            for p in points:
                if p[4]:
                    ax.annotate("offload", (p[0], p[1]), fontsize=6, textcoords="offset points", xytext=(3, -9))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens (global)")
        ax.set_ylabel("step time, median of trials (s)")
        ax.set_title("inference forward" if kind == "infer" else "training step")
        ax.grid(True, which="both", alpha=0.3)
        if series[kind]:
            ax.legend(fontsize=7)
    header = runs[0].get("header", {}) if runs else {}
    title = (f"DiT step, {header.get('gpu')} SP{header.get('sp_size')}, {header.get('blocks')} blocks, hidden "
             f"{header.get('hidden')}, commit {str(header.get('commit'))[:12]}")
    if str(header.get("device", "")).startswith("cpu"):
        title += " (CPU smoke: timings mean nothing)"
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return {"path": str(path), "skipped": None}

