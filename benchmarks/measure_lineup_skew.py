"""How far apart the ranks leave each line-up the benchmarks use before a timed iteration (``common.barrier``).

    .venv/bin/python benchmarks/measure_lineup_skew.py [--ranks 2] [--iters 3000] [--json out.json]

Gloo ranks on this machine (``tests/distributed/mp.py``), one line-up kind after the other (``gloo``, then
``shm`` where the kernel library loads: ``FASTVIDEO_KERNEL_LIBRARY`` or ``build/kernel/``). Each rank reads
the host's monotonic clock (``perf_counter``, one clock for every process of a host) right after each
line-up returns; the exit skew of an iteration is the latest rank's exit minus the earliest's. Whatever the
first rank out spends waiting for the last inside a timed collective is billed to that collective by a
rank-max timing, so this is the line-up's share of every host-to-completion number (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def measure(rank: int, world_size: int, iters: int) -> dict:
    """Rank function: exit times of ``iters`` line-ups of each kind."""
    import time

    for path in (os.path.join(ROOT, "benchmarks"), os.path.join(ROOT, "fastvideo-kernel")):
        if path not in sys.path:
            sys.path.insert(0, path)
    import common

    out = {}
    for kind in ("gloo", "shm"):
        common.set_lineup(kind if kind == "gloo" else "auto")
        exits = []
        for _ in range(iters):
            common.barrier()
            exits.append(time.perf_counter())
        out[kind] = {"kind": common.lineup()["kind"], "exits": exits}
        common.close_lineup()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--iters", type=int, default=3000)
    parser.add_argument("--warmup", type=int, default=100, help="leading line-ups left out of the statistics")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    sys.path.insert(0, ROOT)
    os.environ.setdefault("FASTVIDEO_KERNEL_LIBRARY", os.path.join(ROOT, "build", "kernel",
                                                                   "libfastvideo_ulysses_a2a.so"))
    from tests.distributed import mp

    results = mp.run_ranks(args.ranks, measure, args.iters + args.warmup, timeout_s=600)
    rows = []
    print(f"{'line-up':>8} {'ran':>5} {'median us':>10} {'p90 us':>8} {'max us':>8}")
    for kind in ("gloo", "shm"):
        ran = results[0][kind]["kind"]
        columns = list(zip(*(r[kind]["exits"] for r in results), strict=True))[args.warmup:]  # one per line-up
        skew = sorted((max(col) - min(col)) * 1e6 for col in columns)
        row = {"lineup": kind, "ran": ran, "median_us": statistics.median(skew),
               "p90_us": skew[int(0.9 * (len(skew) - 1))], "max_us": skew[-1], "iters": len(skew)}
        rows.append(row)
        print(f"{kind:>8} {ran:>5} {row['median_us']:10.1f} {row['p90_us']:8.1f} {row['max_us']:8.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ranks": args.ranks, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
