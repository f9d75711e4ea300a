"""The helper's per-call host path on the fused route: everything a call costs the host but the transfer.

Settings check, geometry, plan, the 12-field vote, the verdict, bookkeeping: the ranks (gloo, on CPU, whatever
the host) build a ``UlyssesHelper`` whose transport moves nothing (its ``execute`` returns a preallocated
output), so the time per ``helper.all_to_all`` call is the host path alone. ``--vote shm`` is the same-host
shared-memory vote a single-host GPU job uses (it needs the kernel library: the tree's development build is
used where one exists), ``gloo`` the fallback. ``--gap-us N --gap-kind sleep|spin`` idles before each call, as a
GPU call's wait does between two calls. ``--tag`` tags every call (``helper.all_to_all(x, 0, tag=...)``: the vote's
SEQ is then the tag's own count). ``--voted-launch`` (with the shared-memory vote) has the transport take the vote
as the native transport does on a GPU host: the helper hands it the proposal and the SEQ, and the transport runs
the library's exchange and its run check itself (``fvk_vote_exchange``, ``fvk_vote_would_run``), the hot path of a
fused call. Per rank: median and p90 microseconds per call, the vote's median (``helper.vote_seconds``), the rest,
and ``pre_us_median``: from the call's entry to the transport's ``execute`` (what a launch waits for on the host).
A GPU host adds its launch and allocation on top (``a2a``'s host overhead, ``fused_host_overhead``).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from typing import ClassVar

from benchmarks.harness import oracle, product, report, stats, timing
from benchmarks.harness.case import Case, Context


def idle(gap_s: float, kind: str) -> None:
    """What a GPU call's wait looks like to the CPU between two calls: a sleep, or a spin (a polling sync)."""
    if kind == "spin":
        end = time.perf_counter() + gap_s
        while time.perf_counter() < end:
            pass
    else:
        time.sleep(gap_s)


class HostPathCase(Case):
    name = "host_path"
    summary = "the fused route's per-call host path (vote, policy, verdict), with a transport that moves nothing"
    backend = "gloo"
    key = ("rank",)
    metric = "call_us_median"
    defaults: ClassVar[dict] = {"iters": 5000, "warmup": 500}
    quick: ClassVar[dict] = {"iters": 60, "warmup": 10}
    columns = (
        report.Column("rank", "rank"),
        report.Column("vote", "vote"),
        report.Column("call_us_median", "call us", fmt=".1f"),
        report.Column("call_us_p90", "p90 us", fmt=".1f"),
        report.Column("vote_us_median", "vote us", fmt=".1f"),
        report.Column("rest_us_median", "rest us", fmt=".1f"),
        report.Column("pre_us_median", "pre us", fmt=".1f"),
    )

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--vote", choices=("shm", "gloo", "auto"), default="auto",
                            help="auto: the helper's choice (shared memory where every rank loads the kernel library, "
                                 "else gloo); shm or gloo: that channel, or the run fails")
        parser.add_argument("--gap-us", type=float, default=0.0, help="idle time before each call")
        parser.add_argument("--gap-kind", choices=("sleep", "spin"), default="sleep")
        parser.add_argument("--voted-launch", action="store_true",
                            help="the transport runs the shared-memory exchange itself, as the native one does")
        parser.add_argument("--tag", choices=("untagged", "tagged"), default="untagged",
                            help="call with a call-site tag (the per-tag count in the vote's SEQ)")

    def run(self, ctx: Context) -> None:
        import torch

        from fastvideo.distributed.parallel_state import get_sp_group
        from fastvideo.distributed.ulysses import contract
        from fastvideo.distributed.ulysses.helper import UlyssesHelper
        from fastvideo.distributed.ulysses.policy import TunedRow
        from fastvideo.distributed.ulysses.transport import output_shape

        GlooPlanTransport = product.plan_transport()
        args = ctx.args
        if ctx.world < 2:
            raise SystemExit("host_path needs >= 2 ranks (--nproc 2): the helper's fused route starts at SP2")

        class NoMove(GlooPlanTransport):
            """The fused route's host path without the transfer: execute returns a preallocated output. With
            ``--voted-launch`` it takes the vote as the native transport does (the exchange and the run check in
            the library, then the "launch"); it stamps its entry (``entered``) either way."""

            out: torch.Tensor | None = None
            entered = 0

            def fuses_vote(self, vote) -> bool:
                return args.voted_launch and hasattr(vote, "native_row")

            def execute(self, x, geom, plan, *, vote=None, fields=(), seq=0, **kw):  # type: ignore[override]
                self.entered = time.perf_counter_ns()
                if self.out is None:
                    self.out = torch.empty(output_shape(geom), dtype=x.dtype)
                if vote is not None:
                    lib = vote._lib
                    handle, recv, timeout = vote.native_channel()
                    t0 = time.perf_counter()
                    status = lib.fvk_vote_exchange(handle, ctypes.c_void_p(vote.native_row(fields, seq)), recv, timeout)
                    vote.last_s = time.perf_counter() - t0  # as the native transport reports its exchange
                    if status != 0:
                        raise vote.failure(status)
                    rows, voted = vote.rows, contract.with_seq(fields, seq)  # a tree with native_row has it
                    votes = ctypes.cast(rows.data_ptr(), ctypes.POINTER(ctypes.c_int64))
                    if not lib.fvk_vote_would_run(votes, rows.shape[0], (ctypes.c_int64 * len(voted))(*voted)):
                        return None
                return self.out

        x = torch.randn(3, 16, 8, 8)
        row = TunedRow("CPU", ctx.world, torch.float32, 8, 8, ctas=144, planes_per_chunk=1, source="host path bench")
        helper = UlyssesHelper(get_sp_group(), transport=NoMove(), tuned_table=(row,), gpu_name="CPU", vote=args.vote)
        if not helper.fused_available:
            raise SystemExit(f"host_path: the helper declined: {helper.stats()}")
        voting = helper.stats()["vote"]
        if args.vote != "auto" and voting != args.vote:  # the helper fell back (agreed at construction)
            helper.destroy()
            ctx.unavailable(f"--vote {args.vote}", f"the helper votes over {voting} (the shared-memory vote needs the "
                            "kernel library on every rank)", named=True)
        if args.voted_launch and not helper.stats().get("voted_launch"):
            raise SystemExit(f"host_path --voted-launch: the helper does not take the voted launch (vote "
                             f"{helper.stats()['vote']}; it needs --vote shm and the kernel library)")
        times, pre = [], []
        transport = helper.transport
        tag = "blocks.0.attn.qkv" if args.tag == "tagged" else None
        # Untagged: called without the keyword, so --compare-revs against a tree from before tags runs it.
        call = (lambda: helper.all_to_all(x, 0)) if tag is None else (lambda: helper.all_to_all(x, 0, tag=tag))
        ctx.progress.total = args.warmup + args.iters
        with torch.no_grad():  # the helper is called directly: no route setting
            for i in range(args.warmup + args.iters):
                if args.gap_us:
                    idle(args.gap_us * 1e-6, args.gap_kind)
                start = time.perf_counter_ns()
                call()
                if i >= args.warmup:
                    times.append((time.perf_counter_ns() - start) / 1e3)
                    pre.append((transport.entered - start) / 1e3)
                if (i + 1) % 1000 == 0:
                    ctx.advance(f"{i + 1} calls", 1000)
        info = helper.stats()
        votes = [v * 1e6 for v in helper.vote_seconds(args.iters)]  # the helper keeps the last 4096
        times = times[-len(votes):]
        helper.destroy()
        fused_all = info["fused"] == args.warmup + args.iters
        mine = {"rank": ctx.rank, "vote": info["vote"], "call_us_median": statistics.median(times),
                "call_us_p90": stats.quantile(sorted(times), 0.9), "vote_us_median": statistics.median(votes),
                "rest_us_median": statistics.median(t - v for t, v in zip(times, votes, strict=True)),
                "pre_us_median": statistics.median(pre[-len(votes):]),
                "fused_calls": info["fused"], "calls": info["calls"]}
        ctx.header.update(gap_us=args.gap_us, gap_kind=args.gap_kind, vote_request=args.vote, tag=args.tag,
                          voted_launch=args.voted_launch)
        for r in timing.gather(mine):
            ctx.add_row({**r, "wrong": 0, "wrong_oracle": oracle.NO_DATA + ": the transport returns a preallocated "
                         "output"})
        if not all(timing.gather(fused_all)):
            ctx.fail("not every call took the fused route (the host path measured would not be the fused one)")


CASE = HostPathCase()
