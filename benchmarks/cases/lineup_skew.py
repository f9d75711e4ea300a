"""How far apart the ranks leave each line-up the harness uses before a timed iteration (``lineup.barrier``).

One line-up kind after the other (``gloo``, then ``shm`` where the kernel library loads, else its gloo fallback,
named in ``ran``) on the run's ranks (gloo, CPU; ``--nproc N``). Each rank reads the host's monotonic clock
(``perf_counter``, one clock for every process of a host) right before and right after each line-up; the exit
skew of an iteration is the latest rank's exit minus the earliest's. What the first rank out spends waiting for
the last inside a timed collective is billed to that collective by a rank-max timing, so this is the line-up's
share of every host-to-completion number. ``wrong`` counts violations of the line-up's property: a rank that
left before the last rank entered (``lineup.violations``).
"""

from __future__ import annotations

import statistics
import time
from typing import ClassVar

from benchmarks.harness import lineup, report, stats, timing
from benchmarks.harness.case import Case, Context


class LineupSkewCase(Case):
    name = "lineup_skew"
    summary = "exit skew of the gloo and shared-memory line-ups (the share of every rank-max timing)"
    backend = "gloo"
    key = ("lineup",)
    metric = "median_us"
    defaults: ClassVar[dict] = {"iters": 3000, "warmup": 100}
    quick: ClassVar[dict] = {"iters": 40, "warmup": 5}
    columns = (
        report.Column("lineup", "line-up"),
        report.Column("ran", "ran"),
        report.Column("median_us", "median us", fmt=".1f"),
        report.Column("p90_us", "p90 us", fmt=".1f"),
        report.Column("max_us", "max us", fmt=".0f"),
    )

    def run(self, ctx: Context) -> None:
        args = ctx.args
        if ctx.world < 2:
            raise SystemExit("lineup_skew needs >= 2 ranks (--nproc 2)")
        ctx.progress.total = 2
        for kind in ("gloo", "shm"):
            lineup.close()
            lineup.choose(kind if kind == "gloo" else "auto")
            entries, exits = [], []
            for _ in range(args.warmup + args.iters):
                entries.append(time.perf_counter())
                lineup.barrier()
                exits.append(time.perf_counter())
            ran = lineup.describe()
            gathered = timing.gather((entries[args.warmup:], exits[args.warmup:]))
            all_entries, all_exits = [g[0] for g in gathered], [g[1] for g in gathered]
            skew = sorted((max(col) - min(col)) * 1e6 for col in zip(*all_exits, strict=True))
            ctx.add_row({"lineup": kind, "ran": ran["kind"], "why_not_shm": ran["why_not_shm"],
                         "median_us": statistics.median(skew), "p90_us": stats.quantile(skew, 0.9),
                         "max_us": skew[-1], "iters": len(skew),
                         "wrong": len(lineup.violations(all_entries, all_exits)),
                         "wrong_oracle": "line-up property: (iteration, rank) where a rank left before the last "
                                         "rank entered"})
            ctx.advance(kind)
        lineup.close()
        lineup.choose(args.lineup)


CASE = LineupSkewCase()
