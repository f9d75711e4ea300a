"""Per-call host cost of the public op's route choice, and of checked mode, on 2 gloo ranks (CPU).

    .venv/bin/python scripts/measure_public_op_overhead.py [--iters 20000] [--root CHECKOUT]

``--root`` measures another checkout of the package (e.g. the commit before a change) with this same
script, so two revisions are compared with identical code around them. Rows, per rank, median (and p90)
microseconds per call of ``sequence_model_parallel_all_to_all_4D`` on a [2, 4, 4, 8] float32 tensor:

* ``off, route stubbed``: the public function with the NCCL route replaced by a stub that returns its
  input (``nccl.NcclAllToAll.apply``): what the op itself adds on top of the route. This is the number
  that must not grow when checked mode is off.
* ``off``: the full call (the gloo all-to-all included; noisy on a loaded machine).
* ``off + checked``: the full call with ``FASTVIDEO_ULYSSES_A2A_CHECKED=1`` (one vote per call: over gloo, or
  over the same-host shared-memory vote with ``--kernel-library`` pointing at a built kernel library).
* ``off + checked, route stubbed``: the same with the route stubbed: the vote and the checked path alone.

``--in-process``: no ranks; the SP group and the route are stubbed in this process, and the public function
is timed alone (best of 7 rounds of 100000 calls): the least noisy comparison of two revisions on a shared
machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _stats(ns: list[int]) -> dict:
    us = sorted(t / 1000 for t in ns)
    return {"median_us": round(statistics.median(us), 2), "p90_us": round(us[int(0.9 * (len(us) - 1))], 2)}


def measure(rank: int, world_size: int, iters: int) -> dict:
    import time

    import torch

    from fastvideo import envs
    from fastvideo.distributed import communication_op as op

    x = torch.randn(2, 4, 4, 8)
    a2a = op.sequence_model_parallel_all_to_all_4D
    results = {}

    def timed(n: int) -> list[int]:
        times = []
        for _ in range(n):
            start = time.perf_counter_ns()
            a2a(x, 2, 1)
            times.append(time.perf_counter_ns() - start)
        return times

    with envs.override(FASTVIDEO_ULYSSES_A2A="off"), torch.no_grad():
        real = op._NcclAllToAll.apply
        op._NcclAllToAll.apply = staticmethod(lambda t, mode, group: t)  # the route stubbed out
        try:
            timed(2000)
            results["off, route stubbed"] = _stats(timed(iters))
        finally:
            op._NcclAllToAll.apply = real
        timed(200)
        results["off"] = _stats(timed(max(iters // 10, 100)))
        if "FASTVIDEO_ULYSSES_A2A_CHECKED" in envs.registry():
            from fastvideo.distributed.ulysses import helper

            with envs.override(FASTVIDEO_ULYSSES_A2A_CHECKED="1"):
                timed(200)
                results["off + checked"] = _stats(timed(max(iters // 10, 100)))
                real_route = helper.nccl_route
                helper.nccl_route = lambda t, mode, group: t  # what the checker's decline runs
                try:
                    timed(200)
                    results["off + checked, route stubbed"] = _stats(timed(max(iters // 10, 100)))
                finally:
                    helper.nccl_route = real_route
                results["vote"] = helper._CHECKED_OFF.stats()["vote"]
    return results


def in_process() -> float:
    """Nanoseconds per call of the public function on the `off` route, SP group and route stubbed (best of 7)."""
    import time

    import torch

    from fastvideo.distributed import communication_op as op
    from fastvideo.distributed import settings

    class StubGroup:
        world_size = 2
        device_group = None
        agreed = settings.AgreedSettings(settings.raw_now(), {"FASTVIDEO_ULYSSES_A2A": "off",
                                                              "FASTVIDEO_ULYSSES_A2A_CHECKED": False})

        def agreed_settings(self):  # what GroupCoordinator.agreed_settings does when nothing changed
            if self.agreed.changed():
                raise RuntimeError("the environment changed during the measurement")
            return self.agreed

    group = StubGroup()
    op.get_sp_group = lambda: group
    op._NcclAllToAll.apply = staticmethod(lambda t, mode, g: t)
    x = torch.randn(2, 4, 4, 8)
    a2a = op.sequence_model_parallel_all_to_all_4D
    best = float("inf")
    with torch.no_grad():
        for _ in range(7):
            start = time.perf_counter_ns()
            for _ in range(100_000):
                a2a(x, 2, 1)
            best = min(best, (time.perf_counter_ns() - start) / 100_000)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=20000)
    parser.add_argument("--root", default=HERE, help="the checkout whose fastvideo package is measured")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--kernel-library", help="a built kernel library: checked mode then votes over shared memory")
    parser.add_argument("--in-process", action="store_true", help="time the public function alone, stubbed, here")
    args = parser.parse_args()
    sys.path[:0] = [os.path.abspath(args.root), HERE]  # the measured package first; tests/ for the rank launcher
    if args.in_process:
        import fastvideo

        print(f"package: {os.path.dirname(fastvideo.__file__)}")
        print(f"public function, off, SP group and route stubbed: {in_process():.0f} ns a call (best of 7)")
        return 0
    if args.kernel_library:
        os.environ["FASTVIDEO_KERNEL_LIBRARY"] = os.path.abspath(args.kernel_library)
        sys.path.insert(0, os.path.join(HERE, "fastvideo-kernel"))  # the loader, from the source tree
    from tests.distributed import mp

    results = mp.run_ranks(2, measure, args.iters, timeout_s=600)
    import fastvideo

    print(f"package: {os.path.dirname(fastvideo.__file__)}")
    for name in results[0]:
        if name == "vote":
            print(f"checked mode voted over: {results[0][name]}")
            continue
        row = "  ".join(f"rank {r}: {res[name]['median_us']:8.2f} us (p90 {res[name]['p90_us']:8.2f})"
                        for r, res in enumerate(results))
        print(f"{name:22s} {row}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
