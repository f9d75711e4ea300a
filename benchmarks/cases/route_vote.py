"""What the per-call vote adds to a call that takes the NCCL route under ``auto``: a helper that declined at
construction (no transport: a CPU job, a host without the kernel library, ranks on several hosts), called through
the public op with checked mode at its default (every call votes) and with ``FASTVIDEO_ULYSSES_A2A_CHECKED=0``
(no vote), the NCCL route stubbed with an identity in both, so that the difference is the vote's host path alone
(the proposal, the exchange, the verdict).

Per vote channel (``--vote shm``: the same-host shared-memory vote, which needs the kernel library; ``gloo``:
the vote group, with each rank naming a host of its own, the stand-in for ranks on several hosts):
``--alternations`` rounds, each ``--iters / --alternations`` calls with the vote, then as many without (one
settings re-agreement between them), so both variants see the same load. Rows per channel: ``voted`` and
``unvoted`` (median, p10, p90 microseconds per call, the worst rank), and ``vote cost``: the difference of the two
medians (the worst rank's), the spread of that difference over the rounds (p10/p90 of the per-round
differences), and the exchange alone as the helper times it (``vote_seconds``: median, p10, p90). ``--nccl-us T``
adds each cost as a share of a recorded NCCL-route time ``T`` (the docs cite which). The calls' data are not
checked: the route is stubbed (every call's decline reason is asserted, and no unvoted call may vote).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import ClassVar

from benchmarks.harness import oracle, product, report, stats, timing
from benchmarks.harness.case import Case, Context


def _summary(us: list[float]) -> dict:
    us = sorted(us)
    return {"median_us": statistics.median(us), "p10_us": stats.quantile(us, 0.1), "p90_us": stats.quantile(us, 0.9),
            "n": len(us)}


def measure(ctx: Context, channel: str) -> dict | str:
    """This rank's timings for one channel, or why it cannot run here."""
    import torch

    from fastvideo.distributed.communication_op import sequence_model_parallel_all_to_all_4D as a2a
    from fastvideo.distributed.parallel_state import get_sp_group
    from fastvideo.distributed.ulysses.helper import UlyssesHelper

    args = ctx.args
    rank = ctx.rank
    sp = get_sp_group()
    identity = (lambda: (f"host{rank}", "boot")) if channel == "gloo" else None
    kw = {"identity": identity} if identity is not None else {}
    with product.settings(FASTVIDEO_ULYSSES_A2A="auto", FASTVIDEO_ULYSSES_A2A_CHECKED=None):
        helper = UlyssesHelper(sp, transport=None, vote="gloo" if channel == "gloo" else "shm", **kw)
        try:
            if helper.fused_available:
                return "the helper did not decline at construction"
            if helper.stats()["vote"] != channel:
                return f"the helper votes over {helper.stats()['vote']}, not {channel} (kernel library missing?)"
            product.registry().install_default_helper(helper)
            x = torch.randn(2, 4, 4 * ctx.world, 8)
            per_round = max(args.iters // args.alternations, 10)
            voted: list[float] = []
            unvoted: list[float] = []
            diffs: list[float] = []
            votes_before = len(helper.vote_seconds())

            def timed(n: int, into: list[float] | None) -> list[float]:
                got = []
                for _ in range(n):
                    start = time.perf_counter_ns()
                    a2a(x, 2, 1)
                    got.append((time.perf_counter_ns() - start) / 1e3)
                if into is not None:
                    into.extend(got)
                return got

            exchange_us: list[float] = []
            with product.stub_checked_route(), torch.no_grad():
                timed(args.warmup, None)
                for r in range(args.alternations):
                    on = timed(per_round, voted)
                    exchange_us += [v * 1e6 for v in helper.vote_seconds(per_round)]
                    with product.settings(FASTVIDEO_ULYSSES_A2A_CHECKED="0"):
                        calls_before = len(helper.vote_seconds())
                        timed(args.warmup // 4, None)
                        off = timed(per_round, unvoted)
                        assert len(helper.vote_seconds()) == calls_before, "a call voted with checked mode off"
                    diffs.append(statistics.median(on) - statistics.median(off))
                    ctx.advance(f"{channel} round {r + 1}/{args.alternations}")
            declines = helper.stats()["declines"]
            voted_calls = len(helper.vote_seconds()) - votes_before if votes_before < 4096 else None
        finally:
            product.registry().install_default_helper(None)
            helper.destroy()
    return {"voted": _summary(voted), "unvoted": _summary(unvoted), "exchange": _summary(exchange_us),
            "diffs": diffs, "declines": declines, "voted_calls": voted_calls}


class RouteVoteCase(Case):
    name = "route_vote"
    summary = "the per-call vote's cost on the NCCL route under auto (a helper declined at construction)"
    backend = "gloo"
    key = ("vote", "variant")
    metric = "median_us"
    defaults: ClassVar[dict] = {"iters": 4000, "warmup": 400}
    quick: ClassVar[dict] = {"iters": 200, "warmup": 20}
    columns = (
        report.Column("vote", "vote"),
        report.Column("variant", "variant", width=10),
        report.Column("sp_size", "ranks"),
        report.Column("median_us", "median us", fmt=".1f"),
        report.Column("p10_us", "p10 us", fmt=".1f"),
        report.Column("p90_us", "p90 us", fmt=".1f"),
        report.Column("exchange_us", "exchange us", fmt=".1f"),
        report.Column("share_text", "of NCCL route", width=14),
    )

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--vote", choices=("shm", "gloo", "both"), default=None,
                            help="the channels (default: both, one that cannot run here skipped with the reason); "
                                 "one named here that cannot run fails the run")
        parser.add_argument("--alternations", type=int, default=10, help="rounds of voted then unvoted calls")
        parser.add_argument("--nccl-us", type=float, default=None,
                            help="a recorded NCCL-route time per call to set each cost beside (us)")

    def run(self, ctx: Context) -> None:
        import os

        args = ctx.args
        if ctx.world < 2:
            raise SystemExit("route_vote needs >= 2 ranks (--nproc 2)")
        ctx.header.update(cpus=os.cpu_count(), load_average=list(os.getloadavg()), alternations=args.alternations,
                          nccl_us=args.nccl_us)
        kinds = ("shm", "gloo") if args.vote in (None, "both") else (args.vote,)
        ctx.progress.total = len(kinds) * args.alternations
        no_data = oracle.NO_DATA + ": the NCCL route is stubbed; the verdict of every call is asserted"
        for kind in kinds:
            results = timing.gather(measure(ctx, kind))
            skipped = next((r for r in results if isinstance(r, str)), None)
            if skipped:
                ctx.unavailable(f"--vote {kind}", skipped, named=args.vote is not None)
                ctx.skip(skipped, vote=kind)
                continue
            if any(list(r["declines"]) != ["transport_missing"] for r in results):
                ctx.fail(f"{kind}: a call did not take the agreed decline: {[r['declines'] for r in results]}")
            for variant in ("voted", "unvoted"):
                worst = max(results, key=lambda r: r[variant]["median_us"])[variant]
                ctx.add_row({"vote": kind, "variant": variant, "sp_size": ctx.world, **worst, "share_text": "",
                             "per_rank": [r[variant] for r in results], "wrong": 0, "wrong_oracle": no_data})
            cost = max(r["voted"]["median_us"] - r["unvoted"]["median_us"] for r in results)
            diffs = sorted(d for r in results for d in r["diffs"])
            exchange = max(results, key=lambda r: r["exchange"]["median_us"])["exchange"]
            share = cost / args.nccl_us if args.nccl_us else None
            ctx.add_row({"vote": kind, "variant": "vote cost", "sp_size": ctx.world, "median_us": cost,
                         "p10_us": stats.quantile(diffs, 0.1), "p90_us": stats.quantile(diffs, 0.9),
                         "exchange_us": exchange["median_us"], "exchange": exchange,
                         "share": share, "share_text": f"{share:.2%}" if share is not None else "",
                         "wrong": 0, "wrong_oracle": no_data})


CASE = RouteVoteCase()
