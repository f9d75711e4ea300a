"""The per-call vote's cost: ``GlooVote.exchange`` (12 x int64 all-gather over gloo) and ``ShmVote.exchange``
(the same-host shared-memory vote) on the run's ranks (gloo, CPU; ``--nproc N`` for N ranks).

Each rank times every exchange (``perf_counter_ns`` around the call) after a warm-up; per vote kind the worst
rank's median and p90, and every rank's. ``--vote shm|both`` needs the kernel library (the tree's development
build is used where one exists: ``scripts/build_kernel.sh 2.28.9 build/kernel``). Every exchange's gathered rows
are checked: ``wrong`` counts fields that differ from what their rank sent.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import ClassVar

from benchmarks.harness import report, stats, timing
from benchmarks.harness.case import Case, Context


def measure(rank: int, iters: int, warmup: int, kind: str) -> dict:
    """(median us, p90 us, wrong fields) of ``iters`` exchanges over ``kind`` ("gloo" or "shm") on this rank."""
    from fastvideo.distributed.parallel_state import get_sp_group
    from fastvideo.distributed.ulysses.vote import GlooVote, ShmVote, load_vote_library

    sp = get_sp_group()
    gloo = GlooVote(sp.ranks, timeout_s=60.0)
    vote = gloo
    if kind == "shm":
        vote, why = ShmVote.create(gloo, sp.rank_in_group, load_vote_library())
        if vote is None:
            gloo.destroy()
            return {"skipped": f"shared-memory vote unavailable: {why}"}
    fields = [rank, 0, 0, 0, 1, 3, 16, 12, 8, 0, 0, 0]
    samples, wrong = [], 0
    for i in range(warmup + iters):
        fields[1] = i
        t0 = time.perf_counter_ns()
        rows = vote.exchange(fields)
        if i >= warmup:
            samples.append(time.perf_counter_ns() - t0)
        # Every rank's row must be what that rank sent: its rank id and this call's sequence number.
        got = rows.tolist()
        wrong += sum(int(got[r][0] != r) + int(got[r][1] != i) for r in range(len(got)))
    samples.sort()
    if vote is not gloo:
        vote.destroy()
    gloo.destroy()
    return {"median_us": statistics.median(samples) / 1e3, "p90_us": stats.quantile(samples, 0.9) / 1e3,
            "wrong": wrong}


class VoteCostCase(Case):
    name = "vote_cost"
    summary = "the per-call vote's exchange: gloo all-gather and the same-host shared-memory vote"
    backend = "gloo"
    key = ("vote",)
    metric = "median_us"
    defaults: ClassVar[dict] = {"iters": 2000, "warmup": 200}
    quick: ClassVar[dict] = {"iters": 50, "warmup": 5}
    columns = (
        report.Column("vote", "vote"),
        report.Column("sp_size", "ranks"),
        report.Column("median_us", "median us", fmt=".1f"),
        report.Column("p90_us", "p90 us", fmt=".1f"),
        report.Column("per_rank_text", "per rank median/p90 us", width=24),
    )

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--vote", choices=("gloo", "shm", "both"), default=None,
                            help="the channels (default: both, one that cannot run here skipped with the reason); "
                                 "one named here that cannot run fails the run")

    def run(self, ctx: Context) -> None:
        import os

        args = ctx.args
        if ctx.world < 2:
            raise SystemExit("vote_cost needs >= 2 ranks (--nproc 2)")
        ctx.header.update(cpus=os.cpu_count(), load_average=list(os.getloadavg()))
        kinds = ("gloo", "shm") if args.vote in (None, "both") else (args.vote,)
        ctx.progress.total = len(kinds)
        for kind in kinds:
            results = timing.gather(measure(ctx.rank, args.iters, args.warmup, kind))
            skipped = next((r["skipped"] for r in results if "skipped" in r), None)
            if skipped:
                ctx.unavailable(f"--vote {kind}", skipped, named=args.vote is not None)
                ctx.skip(skipped, vote=kind)
                continue
            ctx.add_row({"vote": kind, "sp_size": ctx.world, "median_us": max(r["median_us"] for r in results),
                         "p90_us": max(r["p90_us"] for r in results),
                         "per_rank": [{"median_us": r["median_us"], "p90_us": r["p90_us"]} for r in results],
                         "per_rank_text": " ".join(f"{r['median_us']:.0f}/{r['p90_us']:.0f}" for r in results),
                         "wrong": sum(r["wrong"] for r in results),
                         "wrong_oracle": "each gathered row's rank id and sequence number vs what that rank sent"})
            ctx.advance(kind)


CASE = VoteCostCase()
