"""Measure the helper's per-call host path on the fused route: everything a call costs the host except
the transfer itself (settings check, geometry, plan, the 12-field vote, the verdict, bookkeeping).

    .venv/bin/python benchmarks/measure_host_path.py --iters 5000 [--vote shm|gloo] [--json out.json]

Two gloo ranks on this machine (``tests/distributed/mp.py``) build a ``UlyssesHelper`` whose transport
moves nothing: ``execute`` returns a preallocated output, so the time per ``helper.all_to_all`` call is
the host path alone. ``--vote shm`` (default when the built kernel library is found:
``FASTVIDEO_KERNEL_LIBRARY`` or ``build/kernel/libfastvideo_ulysses_a2a.so``) uses the same-host
shared-memory vote a single-host GPU job uses; ``gloo`` the fallback.

``--gap-us N --gap-kind sleep|spin`` idles N us before each call, as a GPU call's wait does between two
calls: the host path then runs from colder caches (and, with two ranks, the vote absorbs the ranks' jitter).

Printed per rank: median and p90 microseconds per call, the vote's share (``helper.vote_seconds``) and
the rest (host path without the vote). The GPU host adds its own kernel-launch and output-allocation
cost on top (``benchmarks/benchmark_ulysses_a2a.py`` reports host-to-completion minus device time there).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def idle(gap_s: float, kind: str) -> None:
    """What a GPU call's wait looks like to the CPU between two calls: a sleep, or a spin (as a synchronize
    that polls)."""
    import time

    if kind == "spin":
        end = time.perf_counter() + gap_s
        while time.perf_counter() < end:
            pass
    else:
        time.sleep(gap_s)


def measure(rank: int, world_size: int, iters: int, warmup: int, vote: str, gap_us: float = 0.0,
            gap_kind: str = "sleep") -> dict:
    """Rank function: per-call host-path times of a fused route that moves nothing, with ``gap_us`` of idle
    time (``gap_kind``) before each call."""
    import time

    if os.path.join(ROOT, "fastvideo-kernel") not in sys.path:  # the loader, from the source tree
        sys.path.insert(0, os.path.join(ROOT, "fastvideo-kernel"))
    import torch

    from fastvideo import envs
    from fastvideo.distributed.parallel_state import get_sp_group
    from fastvideo.distributed.ulysses.helper import UlyssesHelper
    from fastvideo.distributed.ulysses.policy import TunedRow
    from fastvideo.distributed.ulysses.transport import GlooPlanTransport, output_shape

    class NoMove(GlooPlanTransport):
        """The fused route's host path without the transfer: execute returns a preallocated output."""

        out: torch.Tensor | None = None

        def execute(self, x, geom, plan):  # type: ignore[override]
            if self.out is None:
                self.out = torch.empty(output_shape(geom), dtype=x.dtype)
            return self.out

    x = torch.randn(3, 16, 8, 8)
    row = TunedRow("CPU", world_size, torch.float32, 8, 8, ctas=144, planes_per_chunk=1, source="host path bench")
    helper = UlyssesHelper(get_sp_group(), transport=NoMove(), tuned_table=(row,), gpu_name="CPU", vote=vote)
    assert helper.fused_available, helper.stats()
    times = []
    with envs.override(FASTVIDEO_ULYSSES_A2A="auto"), torch.no_grad():
        for i in range(warmup + iters):
            if gap_us:
                idle(gap_us * 1e-6, gap_kind)
            start = time.perf_counter_ns()
            helper.all_to_all(x, 0)
            if i >= warmup:
                times.append((time.perf_counter_ns() - start) / 1e3)
    stats = helper.stats()
    votes = [v * 1e6 for v in helper.vote_seconds(iters)]  # the helper keeps the last 4096
    times = times[-len(votes):]
    helper.destroy()
    assert stats["fused"] == warmup + iters, stats
    return {
        "rank": rank, "vote": stats["vote"], "call_us_median": statistics.median(times),
        "call_us_p90": sorted(times)[int(0.9 * (len(times) - 1))], "vote_us_median": statistics.median(votes),
        "rest_us_median": statistics.median(t - v for t, v in zip(times, votes, strict=True)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=5000)
    parser.add_argument("--warmup", type=int, default=500)
    parser.add_argument("--vote", choices=("shm", "gloo", "auto"), default="auto")
    parser.add_argument("--gap-us", type=float, default=0.0,
                        help="idle time before each call (what a GPU call's wait leaves between two calls)")
    parser.add_argument("--gap-kind", choices=("sleep", "spin"), default="sleep")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    sys.path.insert(0, ROOT)
    os.environ.setdefault("FASTVIDEO_KERNEL_LIBRARY", os.path.join(ROOT, "build", "kernel",
                                                                   "libfastvideo_ulysses_a2a.so"))
    from tests.distributed import mp

    results = mp.run_ranks(2, measure, args.iters, args.warmup, args.vote, args.gap_us, args.gap_kind, timeout_s=600)
    print(f"{'rank':>4} {'vote':>5} {'call us':>8} {'p90 us':>8} {'vote us':>8} {'rest us':>8}")
    for r in results:
        print(f"{r['rank']:>4} {r['vote']:>5} {r['call_us_median']:8.1f} {r['call_us_p90']:8.1f} "
              f"{r['vote_us_median']:8.1f} {r['rest_us_median']:8.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"iters": args.iters, "gap_us": args.gap_us, "gap_kind": args.gap_kind, "results": results}, f,
                  indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
