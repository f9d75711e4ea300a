"""Revision comparison: one case, identical argv, against two exported trees, interleaved A/B, B/A, A/B, ...

    python benchmarks/benchmark_ulysses_a2a.py --compare-revs /tmp/rev_a /tmp/rev_b --nproc 2 --rounds 2 \\
        --json compare.json -- --geometry h3-32k

This benchmark code runs against each tree's ``fastvideo`` (``FASTVIDEO_BENCH_TREE``; cwd = the tree), so both
revisions are measured the same way. Each round runs both trees, in the order that alternates from round to round
(``timing.rotated``): a tree that always ran second would carry whatever the first run leaves behind (clocks, caches,
a warm driver) as its own difference. A case that takes turns (``Case.takes_turns``), at one rank per run, runs
both trees of a round together instead, their rows in alternation (``harness.turns``): A's row k next to B's, so
the shared host's swings over a run's minute land on both alike rather than on whichever ran then. Each run's
output goes to ``<out>/<label><round>.log``. Per row key the medians of the case's metric across rounds, B/A, and
each tree's spread across its rounds (max - min: what a single row's difference is read against), with each lane's
median spread, and the median of the row's per-round differences B - A (``round_differences``: the pair a round's
interleaving makes); a case that saves outputs (``--save-outputs``, round 0) has them compared bit for bit. Exit
status 1 when any output differs. After each round but the last the JSON is written with ``complete: false``, so a
comparison stopped by a time limit keeps its finished rounds; ``merge`` (``--compare-merge``) compares the rounds of
several comparisons as one.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import io
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.harness import report, timing, turns
from benchmarks.harness.cli import child_argv
from benchmarks.harness.tree import LIBRARY_NAME, TREE_ENV


def tree_environment(tree: Path, own_library: bool) -> dict[str, str]:
    """The environment a run against ``tree`` adds: with ``own_library``, its own loader and kernel build (which
    must exist: refused with the build command otherwise, before any run)."""
    if not own_library:
        return {}
    lib = tree / "build" / "kernel" / LIBRARY_NAME
    if not lib.is_file():
        raise SystemExit(f"--tree-libraries: {lib} is missing; build it with "
                         f"`cd {tree} && python3 fastvideo-kernel/build_lib.py --out build/kernel`")
    path = os.pathsep.join(p for p in (str(tree / "fastvideo-kernel"), os.environ.get("PYTHONPATH")) if p)
    return {"FASTVIDEO_KERNEL_LIBRARY": str(lib), "PYTHONPATH": path}


def within(a: float, b: float, bound: tuple[float, float]) -> bool:
    """Whether ``b`` is no worse than ``a`` by more than max(``bound[0]``, ``bound[1]`` % of ``a``): a metric where
    lower is better. Pure."""
    return b <= a + max(bound[0], bound[1] / 100 * abs(a))


def ratio(a: float, b: float) -> float | None:
    """``b / a`` where ``a`` is positive, else None: a ratio to a non-positive A (a CPU run's overhead, a
    difference of two noisy times, can centre at or below zero) says nothing. Pure."""
    return b / a if a > 0 else None


def run_failures(name: str, code: int, run: dict) -> list[str]:
    """Why run ``name`` (exit status ``code``, its JSON document ``run``) failed, or []: a non-zero exit, a row
    whose output was wrong, a failure the case reported, a run that did not finish. Pure."""
    header = run.get("header", {})
    why = [f"{name} exited {code}"] if code else []
    wrong = sum(1 for row in run.get("rows", []) if (row.get("wrong") or 0) > 0)
    if wrong:
        why.append(f"{name}: {wrong} row(s) with wrong output")
    why += [f"{name}: {failure}" for failure in header.get("failures") or []]
    if not header.get("complete", True):  # (a tree older than the key: complete)
        why.append(f"{name} did not complete")
    return why


def one_sided(med_a: dict, med_b: dict) -> tuple[list, list]:
    """The row keys with a metric in A only and in B only. Pure."""
    return sorted(set(med_a) - set(med_b), key=str), sorted(set(med_b) - set(med_a), key=str)


def within_counts(rows: list[dict], lane, mark: str = "within") -> dict[str, list[int]]:
    """Per lane (``lane(row)``), ``[rows within, rows]`` of rows whose ``mark`` is not None. Pure."""
    counts: dict[str, list[int]] = {}
    for row in rows:
        if row.get(mark) is not None:
            count = counts.setdefault(lane(row), [0, 0])
            count[0] += bool(row[mark])
            count[1] += 1
    return counts


def run_values(run: dict, metric: str, key: tuple[str, ...]) -> list[tuple[tuple, float]]:
    """One run's ``(row key, metric)`` pairs in row order, rows without the metric left out (a skipped row has none;
    a 0 is a value). Pure."""
    return [(tuple(row.get(k) for k in key), row[metric]) for row in run["rows"] if row.get(metric) is not None]


def round_differences(runs: dict[str, list[dict]], metric: str, key: tuple[str, ...]) -> dict[tuple, list[float]]:
    """Per row key, B - A of ``metric`` in each round where both runs measured the row: A's run i and B's run i are
    round i, which ran together (in turns) or back to back, so a swing of the host over the round lands on both and
    cancels in its difference, as it cannot in a difference of the two trees' medians. Pure."""
    diffs: dict[tuple, list[float]] = collections.defaultdict(list)
    for run_a, run_b in zip(runs["A"], runs["B"]):
        values_b = dict(run_values(run_b, metric, key))
        for row_key, value in run_values(run_a, metric, key):
            if row_key in values_b:
                diffs[row_key].append(values_b[row_key] - value)
    return diffs


def spread(values: list[float]) -> float | None:
    """The spread of a row's per-round values, max - min, or None for fewer than two rounds. Pure."""
    return max(values) - min(values) if len(values) > 1 else None


def lane_spreads(rows: list[dict], metric: str, lane) -> dict[str, list[float]]:
    """Per lane (``lane(row)``), ``[A, B]``: the median over its rows of the spread across rounds of A's and of
    B's ``metric`` (``spread``); lanes without a spread (one round) left out. Pure."""
    acc: dict[str, list[list[float]]] = {}
    for row in rows:
        a, b = row[f"a_{metric}_spread"], row[f"b_{metric}_spread"]
        if a is not None and b is not None:
            pair = acc.setdefault(lane(row), [[], []])
            pair[0].append(a)
            pair[1].append(b)
    return {name: [statistics.median(a), statistics.median(b)] for name, (a, b) in acc.items()}


def compare_saved(dir_a: str | Path, dir_b: str | Path) -> list[dict]:
    """Bit-for-bit comparison of two ``--save-outputs`` directories, per rank file and tensor."""
    from safetensors import safe_open

    from benchmarks.harness.oracle import count_bitwise_diff

    results = []
    for file_a in sorted(Path(dir_a).glob("rank*.safetensors")):
        file_b = Path(dir_b) / file_a.name
        if not file_b.exists():
            results.append({"file": file_a.name, "key": None, "identical": False, "note": "missing in B"})
            continue
        with safe_open(str(file_a), "pt") as fa, safe_open(str(file_b), "pt") as fb:
            meta_a, meta_b = fa.metadata() or {}, fb.metadata() or {}
            for key in sorted(set(meta_a) | set(meta_b)):
                entry = {"file": file_a.name, "key": key}
                if key not in meta_a or key not in meta_b:
                    entry.update(identical=False, note="present in one revision only")
                elif key in fa.keys() and key in fb.keys():
                    diff = count_bitwise_diff(fa.get_tensor(key), fb.get_tensor(key))
                    entry.update(identical=diff == 0, wrong=diff, how="tensor")
                else:
                    entry.update(identical=meta_a[key] == meta_b[key], how="sha256")
                results.append(entry)
    return results


def compare(case, args, argv: list[str], entry: str, prefix: list[str]) -> int:
    """The parent of a revision comparison (plain python; starts every run itself). Returns the exit status."""
    if not case.key:
        raise SystemExit(f"--compare-revs: case {case.name} has no row key to compare by")
    tree_a, tree_b = (Path(d).resolve() for d in args.compare_revs)
    for tree in (tree_a, tree_b):
        if not (tree / "fastvideo").is_dir():
            raise SystemExit(f"--compare-revs: {tree} has no fastvideo/ package (export a tree with git archive)")
    extra_env = {tree_a: tree_environment(tree_a, args.tree_libraries),
                 tree_b: tree_environment(tree_b, args.tree_libraries)}
    work = Path(args.compare_out or tempfile.mkdtemp(prefix=f"{case.name}_revs_"))
    work.mkdir(parents=True, exist_ok=True)
    bench_args = child_argv(argv)
    nproc = args.nproc or 2
    print(f"# compare-revs ({case.name}): A={tree_a} B={tree_b} rounds={args.rounds} nproc={nproc} out={work}")
    print(f"# identical argv: {' '.join(bench_args)}")
    for label, tree in (("A", tree_a), ("B", tree_b)):
        if extra_env[tree]:
            print(f"# {label} runs its own loader and library: {extra_env[tree]['FASTVIDEO_KERNEL_LIBRARY']}")
    runs: dict[str, list[dict]] = {"A": [], "B": []}
    failed: list[str] = []  # why any run failed (run_failures): the comparison then fails too
    interleave = case.takes_turns and nproc == 1
    cpus: list[int] = []
    if interleave:
        if hasattr(os, "sched_setaffinity"):  # Linux; elsewhere the runs go where the scheduler puts them
            cpus = turns.shared_cpus(os.sched_getaffinity(0), args.turn_cpus)
        print(f"# each round runs A and B together, their rows in alternation (harness.turns), on CPUs "
              f"{cpus or 'as scheduled'}")
    turn_orders: list[str] = []

    def start(label: str, rnd: int, extra: dict[str, str]) -> subprocess.Popen:
        tree = tree_a if label == "A" else tree_b
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               entry, *prefix, *bench_args, "--json", str(work / f"{label}{rnd}.json")]
        if rnd == 0 and case.saves_outputs:
            cmd += ["--save-outputs", str(work / f"{label}_outputs")]
        env = dict(os.environ, **{TREE_ENV: str(tree)}, **extra_env[tree], **extra)
        print(f"# round {rnd} {label}: {' '.join(cmd)}", flush=True)
        pin = functools.partial(os.sched_setaffinity, 0, cpus) if cpus else None  # in the child, before exec
        with open(work / f"{label}{rnd}.log", "w") as log:  # a file, not a pipe: two runs at once never block
            return subprocess.Popen(cmd, env=env, cwd=str(tree), stdout=log, stderr=subprocess.STDOUT,
                                    preexec_fn=pin)

    def collect(label: str, rnd: int, proc: subprocess.Popen) -> None:
        code, out_json = proc.wait(), work / f"{label}{rnd}.json"
        if code not in (0, 1) or not out_json.is_file():  # 1: ran, and a row was wrong or a check failed
            print((work / f"{label}{rnd}.log").read_text()[-8000:])
            raise SystemExit(f"--compare-revs: run {label}{rnd} failed with exit code {code} "
                             f"(its output: {work / f'{label}{rnd}.log'})")
        runs[label].append(json.loads(out_json.read_text()))
        failed.extend(run_failures(f"{label}{rnd}", code, runs[label][-1]))

    outputs: list[dict] | None = None  # round 0's outputs compared once, whatever the checkpoints after it

    def summary(complete: bool) -> int:
        nonlocal outputs
        header = dict(runs["A"][0]["header"], compare_revs=[str(tree_a), str(tree_b)], bench_argv=bench_args,
                      argv=list(sys.argv), complete=complete, command=shlex.join(sys.orig_argv),
                      command_source="exact", interleaved=interleave)
        if interleave:
            header["turn_orders"] = turn_orders  # per round, the runs in the order they were given the turn
            header["turn_cpus"] = cpus  # the CPUs both runs were pinned to ([]: as scheduled)
        if outputs is None:
            outputs = compare_saved(work / "A_outputs", work / "B_outputs") if case.saves_outputs else []
        return summarize(case, args, runs, failed, header, outputs)

    for rnd in range(args.rounds):
        order = timing.rotated(("A", "B"), rnd)  # A first in even rounds, B first in odd ones
        if interleave:
            with turns.Conductor(work / f"turns{rnd}", order) as conductor:
                procs = {label: start(label, rnd, conductor.env(label)) for label in order}
                conductor.run(procs)
            turn_orders.append("".join(conductor.order))
            print(f"# round {rnd}: {len(conductor.order)} turns given, {turn_orders[-1][:24]}...", flush=True)
            for label in order:
                collect(label, rnd, procs[label])
        else:
            for label in order:
                collect(label, rnd, start(label, rnd, {}))
        if rnd + 1 < args.rounds:  # a comparison stopped later (a time limit) keeps the rounds it finished
            with contextlib.redirect_stdout(io.StringIO()):
                summary(complete=False)
    return summary(complete=True)


def summarize(case, args, runs: dict[str, list[dict]], failed: list[str], header: dict, outputs: list[dict]) -> int:
    """The comparison of ``runs`` (per tree label, each run's JSON document, one per round): per row key the
    metric's median over the rounds for A and B, B/A, the spreads, the median of the per-round differences B - A and
    ``--within``'s marks on both (``within``: B's median against A's; ``within_paired``: A's median plus that paired
    difference against A's), printed as a table and written to ``--json`` under ``header``; ``failed``: why any
    run failed, ``outputs``: ``compare_saved``'s answer. Returns the exit status (1 where a run failed, a row A
    measured is missing in B, or an output differs)."""

    def per_round(label: str) -> dict[tuple, list[float]]:
        acc: dict[tuple, list[float]] = collections.defaultdict(list)
        for run in runs[label]:
            for row_key, value in run_values(run, case.metric, case.key):
                acc[row_key].append(value)
        return acc

    rounds_a, rounds_b = per_round("A"), per_round("B")
    med_a, med_b = ({k: statistics.median(v) for k, v in acc.items()} for acc in (rounds_a, rounds_b))
    paired = {k: statistics.median(v) for k, v in round_differences(runs, case.metric, case.key).items()}
    commit_a, commit_b = runs["A"][0]["header"]["commit"], runs["B"][0]["header"]["commit"]
    print(f"# A commit {commit_a}   B commit {commit_b}   rounds {len(runs['A'])}")

    # Both revisions must be timed from the same line-up (a tree without the shared-memory vote lines up over
    # gloo, whose exit skew lands in every timed call): say so loudly where they differ.
    lineups = {label: sorted({(run["header"].get("lineup") or {}).get("kind", "unknown") for run in runs[label]})
               for label in runs}
    if lineups["A"] != lineups["B"]:
        print(f"# WARNING: the revisions lined up differently (A {lineups['A']}, B {lineups['B']}): the ratios "
              "carry the line-ups' skew difference; rerun with --lineup gloo for a like-for-like comparison")
    rows = []
    for key in sorted(set(med_a) & set(med_b), key=str):
        rows.append({**dict(zip(case.key, key)), f"a_{case.metric}": med_a[key], f"b_{case.metric}": med_b[key],
                     "ratio_b_over_a": ratio(med_a[key], med_b[key]), "wrong": None,
                     "wrong_oracle": "revision B's outputs vs A's",
                     "wrong_note": "outputs are compared per tensor in 'outputs'",
                     f"a_{case.metric}_spread": spread(rounds_a[key]),
                     f"b_{case.metric}_spread": spread(rounds_b[key]),
                     f"paired_diff_{case.metric}": paired.get(key)})
        if args.within:
            rows[-1]["within"] = within(med_a[key], med_b[key], args.within)
            rows[-1]["within_paired"] = None if key not in paired else within(
                med_a[key], med_a[key] + paired[key], args.within)
    columns = [report.Column(k, k, fmt="") for k in case.key] + [
        report.Column(f"a_{case.metric}", f"A {case.metric}"), report.Column(f"b_{case.metric}", f"B {case.metric}"),
        report.Column("ratio_b_over_a", "B/A"), report.Column(f"a_{case.metric}_spread", "A spread"),
        report.Column(f"b_{case.metric}_spread", "B spread"), report.Column(f"paired_diff_{case.metric}", "B-A paired")]
    if args.within:
        columns += [report.Column("within", "within", fmt=""), report.Column("within_paired", "paired within", fmt="")]
    for line in report.table_lines(columns, rows, key_columns=len(case.key)):
        print(line)
    spreads = lane_spreads(rows, case.metric, case.lane)
    if spreads:
        print("# spread across rounds (max - min of a row's rounds; each lane's median row): "
              + ", ".join(f"{lane} A {a:.3g} / B {b:.3g}" for lane, (a, b) in sorted(spreads.items())))
    counts: dict[str, list[int]] = {}
    paired_counts: dict[str, list[int]] = {}
    if args.within:
        counts = within_counts(rows, case.lane)
        paired_counts = within_counts(rows, case.lane, "within_paired")
        bound = f"max({args.within[0]:g}, {args.within[1]:g} % of A)"
        print(f"# B within {bound} of A: "
              + ", ".join(f"{lane} {n} of {total}" for lane, (n, total) in sorted(counts.items())))
        print(f"# paired by round (the median of each round's B - A) within {bound}: "
              + ", ".join(f"{lane} {n} of {total}" for lane, (n, total) in sorted(paired_counts.items())))
    different = [o for o in outputs if not o["identical"]]
    if case.saves_outputs:
        print(f"# outputs compared bit for bit: {len(outputs)} tensors, {len(different)} differ")
        for o in different:
            print(f"#   differs: {o}")
    # A row A measured and B did not is a measurement B lost; a row only B has (a newer tree's) is noted.
    only_a, only_b = one_sided(med_a, med_b)
    for label, keys in (("A", only_a), ("B", only_b)):
        for key in keys:
            print(f"# measured in {label} only: {dict(zip(case.key, key))}")
    failures = failed + [f"measured in A, not in B: {dict(zip(case.key, key))}" for key in only_a]
    for why in failures:
        print(f"# FAILED: {why}")
    header = dict(header, commit_a=commit_a, commit_b=commit_b, lineups=lineups, rounds=len(runs["A"]))
    for key in ("within_bound", "within_counts", "within_paired_counts", "round_spreads"):  # a merged comparison's
        header.pop(key, None)  # inputs had their own
    if args.within:
        header.update(within_bound=list(args.within), within_counts=counts, within_paired_counts=paired_counts)
    if spreads:
        header["round_spreads"] = spreads
    header.update(failures=failures, run_failures=failed)  # the runs' own failures: what a merge reads again
    report.write_json(args.json, report.document(header, rows, {"outputs": outputs, "runs": runs}))
    return 1 if failures or different or (case.saves_outputs and not outputs) else 0


def merge(case, args) -> int:
    """``--compare-merge FILE...``: several ``--compare-revs`` JSONs of this case, made of the same two commits with
    the same benchmark argv (for example the parts of an A/B split over several device calls), compared as one run of
    all their rounds; nothing is run. Refused, naming the file, where one is no comparison of this case or
    differs from the first in its commits or argv; different hosts are printed as a warning (each round still pairs
    its A and B on one host). Returns ``summarize``'s exit status."""
    docs = []
    for name in args.compare_merge:
        try:
            doc = json.loads(Path(name).read_text())
        except (OSError, ValueError) as err:
            raise SystemExit(f"--compare-merge: cannot read {name}: {err}") from None
        header = doc.get("header") or {}
        if "runs" not in doc or "commit_a" not in header or header.get("case") != case.name:
            raise SystemExit(f"--compare-merge: {name} is not a --compare-revs JSON of case {case.name} (its case: "
                             f"{header.get('case')!r}; it needs the runs and commit_a a comparison writes)")
        docs.append((name, doc))
    first_name, first = docs[0]
    for name, doc in docs[1:]:
        for field in ("commit_a", "commit_b", "bench_argv"):
            if doc["header"].get(field) != first["header"].get(field):
                raise SystemExit(f"--compare-merge: {name}'s {field} {doc['header'].get(field)!r} differs from "
                                 f"{first_name}'s {first['header'].get(field)!r}: only comparisons of the same two "
                                 "commits with the same argv merge")
    for name, doc in docs:
        if not doc["header"].get("complete", True):
            print(f"# note: {name} stopped after {len(doc['runs']['A'])} round(s) (complete: false); they are merged")
    hosts = sorted({str(doc["header"].get("host")) for _, doc in docs})
    if len(hosts) > 1:
        print(f"# WARNING: the parts ran on different hosts ({', '.join(hosts)}): each round pairs A and B on one "
              "host, but the rounds' spread takes in the hosts' difference")
    print(f"# compare-merge ({case.name}): " + ", ".join(f"{name} ({len(doc['runs']['A'])} rounds)"
                                                         for name, doc in docs))
    runs = {label: [run for _, doc in docs for run in doc["runs"][label]] for label in ("A", "B")}
    failed = [f"{name}: {why}" for name, doc in docs
              for why in doc["header"].get("run_failures", doc["header"].get("failures", []))]
    outputs = [dict(o, part=name) for name, doc in docs for o in doc.get("outputs", [])]
    header = dict(first["header"], merged_from=[name for name, _ in docs], hosts=hosts, argv=list(sys.argv),
                  command=shlex.join(sys.orig_argv), command_source="exact", complete=True)
    if "turn_orders" in header:  # each part's rounds' orders, in the merged rounds' order
        header["turn_orders"] = [o for _, doc in docs for o in doc["header"].get("turn_orders", [])]
    return summarize(case, args, runs, failed, header, outputs)
