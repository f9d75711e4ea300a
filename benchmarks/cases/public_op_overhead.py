"""Per-call host cost of the public op's route choice, and of checked mode, on the run's ranks (gloo, CPU).

Rows per rank, median and p90 microseconds per call of ``sequence_model_parallel_all_to_all_4D`` on a
[2, 4, 4, 8] float32 tensor:

* ``off, route stubbed``: the public function with the NCCL route replaced by an identity: what the op itself
  adds on top of the route (the number that must not grow when checked mode is off);
* ``off``: the full call (the gloo all-to-all included; noisy on a loaded machine);
* ``off + checked``: the full call with ``FASTVIDEO_ULYSSES_A2A_CHECKED=1`` (one vote per call: over the
  shared-memory vote where the kernel library loads, else gloo);
* ``off + checked, route stubbed``: the vote and the checked path alone.

``--in-process`` (one process, no ranks): the SP group and the route stubbed, the public function timed alone
(best of 7 rounds of ``--iters`` calls): the least noisy comparison of two revisions (``--tree DIR``) on a
shared machine. The stubs are this case's own (``harness.product``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import ClassVar

from benchmarks.harness import oracle, product, report, stats, timing
from benchmarks.harness.case import Case, Context


def _stats(ns: list[int]) -> dict:
    us = sorted(t / 1000 for t in ns)
    return {"median_us": statistics.median(us), "p90_us": stats.quantile(us, 0.9), "n": len(us)}


class PublicOpOverheadCase(Case):
    name = "public_op_overhead"
    summary = "the public op's own per-call host cost on the off route, and checked mode's"
    backend = "gloo"
    key = ("variant", "rank")
    metric = "median_us"
    defaults: ClassVar[dict] = {"iters": 20000}
    quick: ClassVar[dict] = {"iters": 200, "warmup": 2}
    columns = (
        report.Column("variant", "variant", width=30),
        report.Column("rank", "rank"),
        report.Column("median_us", "median us", fmt=".2f"),
        report.Column("p90_us", "p90 us", fmt=".2f"),
        report.Column("ns_per_call", "ns/call", fmt=".0f"),
    )

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--in-process", action="store_true",
                            help="one process: the public function alone, SP group and route stubbed")

    def run(self, ctx: Context) -> None:
        import torch

        from fastvideo import envs
        from fastvideo.distributed import communication_op as op

        args = ctx.args
        x = torch.randn(2, 4, 4, 8)
        a2a = op.sequence_model_parallel_all_to_all_4D
        no_data = oracle.NO_DATA + ": a stubbed route returns its input"
        if args.in_process:
            if ctx.world != 1:
                raise SystemExit("--in-process: run it as one process")
            rounds = max(args.iters, 1000)
            best = float("inf")
            with product.stub_sp_group(2), torch.no_grad():
                for _ in range(7):
                    start = time.perf_counter_ns()
                    for _ in range(rounds):
                        a2a(x, 2, 1)
                    best = min(best, (time.perf_counter_ns() - start) / rounds)
            ctx.add_row({"variant": "off, SP group and route stubbed (best of 7)", "rank": 0, "ns_per_call": best,
                         "calls_per_round": rounds, "wrong": 0, "wrong_oracle": no_data})
            return
        if ctx.world < 2:
            raise SystemExit("public_op_overhead needs >= 2 ranks (--nproc 2), or --in-process")

        def timed(n: int) -> list[int]:
            times = []
            for _ in range(n):
                start = time.perf_counter_ns()
                a2a(x, 2, 1)
                times.append(time.perf_counter_ns() - start)
            return times

        full = max(args.iters // 10, 100)
        results: dict[str, dict] = {}
        wrong: dict[str, int] = {}
        with product.settings(FASTVIDEO_ULYSSES_A2A="off"), torch.no_grad():
            with product.stub_public_op_route():
                timed(min(2000, args.iters))
                results["off, route stubbed"] = _stats(timed(args.iters))
            timed(200)
            results["off"] = _stats(timed(full))
            wrong["off"] = self._wrong(a2a, x)
            if "FASTVIDEO_ULYSSES_A2A_CHECKED" in envs.registry():
                with product.settings(FASTVIDEO_ULYSSES_A2A_CHECKED="1"):
                    timed(200)
                    results["off + checked"] = _stats(timed(full))
                    wrong["off + checked"] = self._wrong(a2a, x)
                    with product.stub_checked_route():
                        timed(200)
                        results["off + checked, route stubbed"] = _stats(timed(full))
                ctx.header["checked_vote"] = product.checked_vote_kind()
        ctx.progress.total = 1
        for rank, (res, bad) in enumerate(timing.gather((results, wrong))):
            for variant, s in res.items():
                counted = variant in bad
                ctx.add_row({"variant": variant, "rank": rank, **s, "wrong": bad.get(variant, 0),
                             "wrong_oracle": ("nccl_route on the same input (bitwise), this rank" if counted
                                              else no_data)})
        ctx.advance("done")

    @staticmethod
    def _wrong(a2a, x) -> int:
        """This rank's output of one real call against the NCCL route's (the call the timings are of)."""
        from fastvideo.distributed.communication_op import nccl_route
        from fastvideo.distributed.parallel_state import get_sp_group

        return oracle.count_bitwise_diff(a2a(x, 2, 1), nccl_route(x, 0, get_sp_group().device_group))


CASE = PublicOpOverheadCase()
