"""Measure the per-call vote's cost: ``GlooVote.exchange`` (12 x int64 all-gather over gloo) and
``ShmVote.exchange`` (the same-host shared-memory vote) on N CPU ranks.

    .venv/bin/python benchmarks/measure_vote_cost.py --world-sizes 2 4 --iters 2000 --vote both

``--vote shm|both`` needs the built kernel library: ``FASTVIDEO_KERNEL_LIBRARY`` or, by default,
``build/kernel/libfastvideo_ulysses_a2a.so`` (``scripts/build_kernel.sh 2.28.9 build/kernel``).

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


def measure(rank: int, world_size: int, iters: int, warmup: int, kind: str = "gloo") -> tuple[float, float]:
    """Rank function: (median us, p90 us) of ``iters`` exchanges over ``kind`` ("gloo" or "shm")."""
    import time

    from fastvideo.distributed.parallel_state import get_sp_group
    from fastvideo.distributed.ulysses.vote import GlooVote, ShmVote, load_vote_library

    gloo = GlooVote(get_sp_group().ranks, timeout_s=60.0)
    vote = gloo
    if kind == "shm":
        vote, why = ShmVote.create(gloo, get_sp_group().rank_in_group, load_vote_library())
        if vote is None:
            raise RuntimeError(f"shared-memory vote unavailable: {why}")
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
    gloo.destroy()
    return statistics.median(samples) / 1e3, samples[int(0.9 * (len(samples) - 1))] / 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--vote", choices=("gloo", "shm", "both"), default="gloo")
    args = parser.parse_args(argv)
    kinds = ("gloo", "shm") if args.vote == "both" else (args.vote,)
    if "shm" in kinds:
        default_lib = os.path.join(ROOT, "build", "kernel", "libfastvideo_ulysses_a2a.so")
        os.environ.setdefault("FASTVIDEO_KERNEL_LIBRARY", default_lib)
        sys.path.append(os.path.join(ROOT, "fastvideo-kernel"))  # the loader, if not installed (reaches the ranks)
    sys.path[:0] = [p for p in (ROOT, os.path.dirname(os.path.abspath(__file__))) if p not in sys.path]
    import measure_vote_cost as this  # the rank function must be importable by name on every rank
    import torch

    from tests.distributed.mp import run_ranks

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    print(f"torch {torch.__version__}, python {platform.python_version()}, {os.cpu_count()} CPUs, "
          f"commit {commit.strip()}, iters {args.iters} (warm-up {args.warmup}), load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    env = {"FASTVIDEO_KERNEL_LIBRARY": os.environ.get("FASTVIDEO_KERNEL_LIBRARY")}
    for p, kind in ((p, kind) for p in args.world_sizes for kind in kinds):
        results = run_ranks(p, this.measure, args.iters, args.warmup, kind, env=env, timeout_s=600)
        per_rank = ", ".join(f"rank {r}: {m:.0f}/{q:.0f}" for r, (m, q) in enumerate(results))
        worst_median = max(m for m, _ in results)
        worst_p90 = max(q for _, q in results)
        print(f"SP{p} {kind}: median {worst_median:.0f} us, p90 {worst_p90:.0f} us (worst rank; "
              f"per rank median/p90 us: {per_rank})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
