"""Judge a benchmark run's JSON against the project's targets: PASS / FAIL / NOT MEASURED, with the reason.

    python benchmarks/check_results.py dit.json [a2a.json ...] [--json verdicts.json]

The runs measure; this file holds the targets and says whether a run met them, so a target changes here without
touching a measurement, and an old run can be judged again. Per case (``header.case``):

* ``dit_step``: the measured step gain >= ``GAIN_FRACTION`` x the ideal gain in every auto row; at 128k tokens
  with sparse attention, fused >= ``TARGET_TRAIN_GAIN`` faster per training step and >= ``TARGET_INFER_GAIN`` per
  inference step (one verdict per LONG_TRAINING value); peak memory <= the NCCL row's + the window in every auto
  row; 0 allocator retries in every row; inference bit-identical; gradients within the calibrated threshold. Where
  a gain misses its target the run's reason candidates are printed. A CPU run's timing and memory targets are
  NOT MEASURED.
* ``a2a``: every row exact (``#wrong`` 0); every fused row at SP >= 2 ran the fused route on every call; the fused
  route's host overhead (host-to-completion - the transfer's device time) <= ``HOST_OVERHEAD_US``.
* any other case: every row exact.

Exit status: 1 when any verdict is FAIL, 2 when a file is not a valid run document, else 0.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import report

GAIN_FRACTION = 0.85  # measured step gain >= 85% of the ideal gain, every auto row
TARGET_TOKENS = 131072  # the 128k sparse rows
TARGET_TRAIN_GAIN = 0.03  # fused >= 3% faster per training step at 128k sparse
TARGET_INFER_GAIN = 0.05  # fused >= 5% faster per inference step at 128k sparse
HOST_OVERHEAD_US = 30.0  # the fused route's host overhead per call


def verdict(target: str, outcome: str, detail: str) -> dict:
    return {"target": target, "verdict": outcome, "detail": detail}


def every(rows: list[dict], judge, what: str) -> tuple[str, str]:
    """PASS if ``judge(row)`` is True in every row; FAIL naming the rows where it is False; NOT MEASURED naming the
    rows where it is None (FAIL wins)."""
    if not rows:
        return "NOT MEASURED", f"no rows for {what}"
    results = [(r, judge(r)) for r in rows]
    bad = [name(r) for r, ok in results if ok is False]
    unknown = [name(r) for r, ok in results if ok is None]
    if bad:
        also = f"; not measured in {', '.join(unknown)}" if unknown else ""
        return "FAIL", f"{what} fails in {', '.join(bad)}{also}"
    if unknown:
        return "NOT MEASURED", f"{what} not measured in {', '.join(unknown)}"
    return "PASS", f"{what} holds in every row ({len(rows)})"


def name(r: dict) -> str:
    if "tokens" in r:
        long = f"[{r.get('long_training')}]" if r.get("route") == "auto" else ""
        return f"{r.get('tokens')} {r.get('route')}{long} {r.get('kind')}"
    return " ".join(str(r.get(k)) for k in ("geometry", "mode", "route") if k in r) or "row"


# ---------------------------------------------------------------------------------------------- dit_step


def gain_check(measured: float | None, ideal: float | None, fraction: float = GAIN_FRACTION) -> tuple[bool | None, str]:
    """(ok, why): ok when measured >= fraction x ideal; None when it cannot be judged (nothing to gain)."""
    if measured is None or ideal is None:
        return None, "not measured (no share, a negative share, or no op time)"
    if ideal <= 0:
        return None, (f"ideal gain {ideal * 100:.2f}% <= 0: the fused op is not faster than the NCCL op on the "
                      "step's shapes (or the share is 0), so there is no gain to reach")
    ok = measured >= fraction * ideal
    return ok, (f"measured {measured * 100:.2f}% {'>=' if ok else '<'} {fraction:g} x ideal {ideal * 100:.2f}% "
                f"= {fraction * ideal * 100:.2f}% ({measured / ideal * 100:.0f}% of ideal)")


def memory_ok(memory: dict | None) -> bool | None:
    """The fused footprint (peak + the window where it is outside torch's allocator) <= the NCCL peak + window."""
    if not memory:
        return None
    return memory["fused_total_gib"] <= memory["limit_gib"]


def dit_verdicts(rows: list[dict], *, sparse: bool, timing_not_measured: str | None = None) -> list[dict]:
    """One verdict per DiT target (the 128k targets: one per LONG_TRAINING value that has a row).
    ``timing_not_measured``: why timings are no measurement here (a CPU run), or None on a GPU run."""
    auto = [r for r in rows if r.get("route") == "auto" and "skipped" not in r]
    out: list[dict] = []
    target = f"step gain >= {GAIN_FRACTION:g} x ideal gain, every auto row"
    if timing_not_measured:
        out.append(verdict(target, "NOT MEASURED", timing_not_measured))
    else:
        out.append(verdict(target, *every(auto, lambda r: gain_check(r.get("measured_gain"), r.get("ideal_gain"))[0],
                                          f"measured >= {GAIN_FRACTION:g} x ideal")))
    for kind, goal in (("train", TARGET_TRAIN_GAIN), ("infer", TARGET_INFER_GAIN)):
        step = "training" if kind == "train" else "inference"
        target = f"128k sparse: fused >= {goal * 100:g}% faster per {step} step"
        picked = [r for r in auto if r.get("tokens") == TARGET_TOKENS and r.get("kind") == kind]
        if timing_not_measured:
            out.append(verdict(target, "NOT MEASURED", timing_not_measured))
        elif not sparse:
            out.append(verdict(target, "NOT MEASURED", "dense attention in this run (the target is for sparse)"))
        elif not picked:
            out.append(verdict(target, "NOT MEASURED", f"no {TARGET_TOKENS}-token {kind} row in this run"))
        for r in picked if sparse and not timing_not_measured else []:
            gain = r.get("measured_gain")
            label = f"{target} [long={r.get('long_training')}]"
            if gain is None:
                out.append(verdict(label, "NOT MEASURED", "no measured gain (NCCL row missing)"))
            else:
                out.append(verdict(label, "PASS" if gain >= goal else "FAIL",
                                   f"measured gain {gain * 100:.2f}% vs {goal * 100:g}% ({r.get('route_ran')})"))
    target = "peak memory <= NCCL route's + window, every auto row"
    if timing_not_measured:
        out.append(verdict(target, "NOT MEASURED", timing_not_measured))
    else:
        out.append(verdict(target, *every(auto, lambda r: memory_ok(r.get("memory")),
                                          "fused peak (+ window outside torch) <= NCCL peak + window")))
    target = "0 allocator retries, every row"
    if timing_not_measured:
        out.append(verdict(target, "NOT MEASURED", timing_not_measured))
    else:
        out.append(verdict(target, *every(
            [r for r in rows if "skipped" not in r],
            lambda r: None if r.get("alloc_retries_total") is None else r["alloc_retries_total"] == 0,
            "0 num_alloc_retries")))
    out.append(verdict("inference bit-identical to the NCCL route", *every(
        [r for r in auto if r.get("kind") == "infer"], lambda r: None if r.get("wrong") is None else r["wrong"] == 0,
        "0 differing elements")))
    out.append(verdict("gradients within the calibrated threshold", *every(
        [r for r in auto if r.get("kind") == "train"], lambda r: r.get("grad_ok"), "max abs diff <= threshold")))
    return out


def dit_reasons(rows: list[dict]) -> list[str]:
    """The run's reason candidates for every auto row whose gain misses its target."""
    lines = []
    for r in rows:
        if r.get("route") != "auto":
            continue
        ok, why = gain_check(r.get("measured_gain"), r.get("ideal_gain"))
        if ok is False:
            lines.append(f"#   gain below target, {name(r)}: {why}; reason candidates:")
            lines += [f"#     - {text}" for text in r.get("reason_candidates", [])]
        elif why and ok:
            lines.append(f"#   gain {name(r)}: {why}")
    return lines


# ---------------------------------------------------------------------------------------------- a2a, others


def exact(rows: list[dict]) -> dict:
    return verdict("every row exact (#wrong 0)", *every(
        [r for r in rows if "skipped" not in r], lambda r: None if r.get("wrong") is None else r["wrong"] == 0,
        "0 wrong elements"))


def a2a_verdicts(rows: list[dict], *, timing_not_measured: str | None = None) -> list[dict]:
    fused = [r for r in rows if r.get("route") == "fused" and r.get("sp_size", 1) > 1]
    out = [exact(rows), verdict("every fused row ran the fused route", *every(
        fused, lambda r: None if "skipped" in r else r.get("route_ran") == "fused", "every call fused"))]
    target = f"fused host overhead <= {HOST_OVERHEAD_US:g} us per call"
    if timing_not_measured:
        out.append(verdict(target, "NOT MEASURED", timing_not_measured))
    else:
        out.append(verdict(target, *every(
            fused, lambda r: None if r.get("host_overhead_us") is None else r["host_overhead_us"] <= HOST_OVERHEAD_US,
            f"host_overhead_us <= {HOST_OVERHEAD_US:g}")))
    return out


def judge(doc: dict) -> tuple[list[dict], list[str]]:
    """(verdicts, extra lines to print) for one run document."""
    header, rows = doc["header"], doc["rows"]
    cpu = not str(header.get("device", "")).startswith("cuda")
    not_measured = "CPU run over gloo: timings and memory are not measurements" if cpu else None
    if header.get("case") == "dit_step":
        sparse = "flex" in str(header.get("attention", ""))
        return (dit_verdicts(rows, sparse=sparse, timing_not_measured=not_measured),
                [] if not_measured else dit_reasons(rows))
    if header.get("case") == "a2a":
        return a2a_verdicts(rows, timing_not_measured=not_measured), []
    return [exact(rows)], []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="run JSON files (--json of any case)")
    parser.add_argument("--json", help="write the verdicts here")
    args = parser.parse_args(argv)
    status, everything = 0, {}
    for path in args.runs:
        try:
            doc = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            print(f"{path}: unreadable: {exc}", file=sys.stderr)
            return 2
        problems = report.validate(doc)
        if problems:
            print(f"{path}: not a valid run document: {'; '.join(problems)}", file=sys.stderr)
            return 2
        found, lines = judge(doc)
        header = doc["header"]
        done = "complete" if header.get("complete") else "INCOMPLETE (stopped early)"
        print(f"# verdicts of {Path(path).name} ({header.get('case')}, {done}, commit {header.get('commit')}):")
        for v in found:
            print(f"# verdict: {v['verdict']:<12} {v['target']}: {v['detail']}")
        for line in lines:
            print(line)
        everything[path] = found
        if any(v["verdict"] == "FAIL" for v in found):
            status = 1
    if args.json:
        Path(args.json).write_text(json.dumps(everything, indent=2) + "\n")
    return status


if __name__ == "__main__":
    sys.exit(main())
