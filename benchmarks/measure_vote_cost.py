"""Measure the per-call vote's cost: ``GlooVote.exchange`` (12 x int64 all-gather over gloo) on N CPU ranks.

    .venv/bin/python benchmarks/measure_vote_cost.py --world-sizes 2 4 --iters 2000

Each rank times every exchange (perf_counter_ns around the call) after a warm-up; the script prints the
median and p90 in microseconds per rank and the worst rank's. Ranks run as gloo processes through
``tests/distributed/mp.py`` (forkserver, one torch thread each). Results go to docs/ulysses_contract.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def measure(rank: int, world_size: int, iters: int, warmup: int) -> tuple[float, float]:
    """Rank function: (median us, p90 us) of ``iters`` exchanges."""
    import time

    from fastvideo.distributed.parallel_state import get_sp_group
    from fastvideo.distributed.ulysses.vote import GlooVote

    vote = GlooVote(get_sp_group().ranks, timeout_s=60.0)
    fields = [rank, 0, 0, 0, 1, 3, 16, 12, 8, 0, 0, 0]
    for i in range(warmup):
        fields[1] = i
        vote.exchange(fields)
    samples = []
    for i in range(iters):
        fields[1] = warmup + i
        t0 = time.perf_counter_ns()
        vote.exchange(fields)
        samples.append(time.perf_counter_ns() - t0)
    samples.sort()
    vote.destroy()
    return statistics.median(samples) / 1e3, samples[int(0.9 * (len(samples) - 1))] / 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=200)
    args = parser.parse_args(argv)
    sys.path[:0] = [p for p in (ROOT, os.path.dirname(os.path.abspath(__file__))) if p not in sys.path]
    import measure_vote_cost as this  # the rank function must be importable by name on every rank
    import torch

    from tests.distributed.mp import run_ranks

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    print(f"torch {torch.__version__}, python {platform.python_version()}, {os.cpu_count()} CPUs, "
          f"commit {commit.strip()}, iters {args.iters} (warm-up {args.warmup})")
    for p in args.world_sizes:
        results = run_ranks(p, this.measure, args.iters, args.warmup, timeout_s=600)
        per_rank = ", ".join(f"rank {r}: {m:.0f}/{q:.0f}" for r, (m, q) in enumerate(results))
        worst_median = max(m for m, _ in results)
        worst_p90 = max(q for _, q in results)
        print(f"SP{p}: median {worst_median:.0f} us, p90 {worst_p90:.0f} us (worst rank; per rank median/p90 us: "
              f"{per_rank})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
