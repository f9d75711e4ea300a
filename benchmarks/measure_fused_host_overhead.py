"""The fused call's host overhead on one GPU: the whole call through the helper at P = 1, host-to-completion
against the device time of the same launch.

    python3 benchmarks/measure_fused_host_overhead.py [--iters 300] [--json fused_host_overhead.json]

Issue 12's host target is host-to-completion minus device time <= 30 us on the fused route. Two GPUs are
needed for the real number; one GPU measures everything in it but the peer: a one-rank helper (settings,
policy and plan cache, the 12-field vote over the same-host shared memory, the verdict, ``execute``, the
watchdog's bookkeeping) driving the real kernel library on a one-rank NCCL communicator. At P = 1 the vote
waits for no peer, the barriers meet no peer and a copy-engine call pushes nothing (no ``cudaMemcpy2DAsync``
per chunk), so this is a lower bound of the SP2 overhead, not the SP2 number. The helper refuses SP sizes
below 2 (``policy.MIN_WORLD_SIZE``); this script lowers that bound in its own process, for the measurement,
and plans from rows it makes for SP1 (the H200 rows' plan shapes: SM 144 CTAs; copy engine 66 CTAs in 1
or 2 row chunks).

Per row: ``host_ms`` (median over ``--iters`` of ``perf_counter`` around ``helper.all_to_all`` plus
``torch.cuda.synchronize``), ``device_ms`` (median of CUDA events around ``transport.execute`` with the same
plan), their difference ``host_overhead_us``, the vote's median, and ``sync_us``: a synchronize of an idle
device, the part of every host-to-completion number that is the wake-up alone. Every output is checked
(at P = 1 the all-to-all is the identity): ``wrong`` counts differing elements.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import common  # noqa: E402  - puts the tree under test on sys.path
import torch  # noqa: E402

GEOMETRIES = {"wan720p-sp2": (1, 37800, 40, 128), "h3-32k-sp2": (3, 16384, 56, 128)}  # per-rank SP2 operands


def median_us(seconds: list[float]) -> float:
    return statistics.median(seconds) * 1e6


def measure(helper, x: torch.Tensor, mode: int, engine: str, ctas: int, args) -> dict:
    """One row: the helper's call and the launch alone, for ``x`` in ``mode``; the plan that ran asserted (the
    row's engine and CTAs, tuned)."""
    from fastvideo import envs
    from fastvideo.distributed.ulysses.policy import Geometry

    device = x.device
    geom = Geometry.from_input(x.shape, mode, 1, x.dtype)
    with envs.override(FASTVIDEO_ULYSSES_A2A="auto"), torch.no_grad():
        mark = helper.stats()["calls"]
        lat = common.host_latencies(lambda: helper.all_to_all(x, mode), device, args.iters, args.warmup)
        out = helper.all_to_all(x, mode)
        torch.cuda.synchronize()
        wrong = int((out.view(torch.int16) != x.view(torch.int16)).sum())
        record = helper.history[-1]
        plan = record.plan
        if record.route != "fused" or plan is None or (plan.engine, plan.ctas, plan.tuned) != (engine, ctas, True):
            raise SystemExit(f"mode {mode}: expected the fused tuned {engine} plan of {ctas} CTAs, ran {record}")
        dev = common.device_times(lambda: helper.transport.execute(x, geom, plan), device, args.iters, args.warmup)
    row = {"mode": mode, "engine": engine, "plan": plan.describe(geom), "chunks": plan.num_chunks(geom),
           "calls": helper.stats()["calls"] - mark, "host_ms": statistics.median(lat) * 1e3,
           "device_ms": statistics.median(dev) * 1e3, "vote_us": median_us(helper.vote_seconds(args.iters)),
           "wrong": wrong}
    row["host_overhead_us"] = (row["host_ms"] - row["device_ms"]) * 1e3
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("measure_fused_host_overhead: no CUDA device", file=sys.stderr)
        return 2
    from fastvideo.distributed.ulysses import helper as helper_mod
    from fastvideo.distributed.ulysses import policy

    try:  # where the helper's construction checks the SP size in this tree (older trees: the helper module)
        from fastvideo.distributed.ulysses import construction as size_check
    except ImportError:
        size_check = helper_mod
    from fastvideo.distributed.ulysses.policy import ENGINE_CE, ENGINE_SM, TunedRow

    _, world, device = common.init_distributed("cuda")
    if world != 1:
        raise SystemExit("measure_fused_host_overhead: run it as one process (P = 1)")
    policy.MIN_WORLD_SIZE = size_check.MIN_WORLD_SIZE = 1  # this process only: the measurement's P = 1
    gpu = torch.cuda.get_device_name(device)
    header = common.env_header(device, 1, extra={"benchmark": "fused_host_overhead", "iters": args.iters})
    common.print_header(header)
    sync_s = []
    for _ in range(args.iters):
        t0 = time.perf_counter()
        torch.cuda.synchronize()
        sync_s.append(time.perf_counter() - t0)
    print(f"# synchronize of an idle device: {median_us(sync_s):.1f} us median")
    rows, wrong_total = [], 0
    print(f"{'geometry':>12} {'mode':>4} {'plan':>24} {'chunks':>6} {'host ms':>8} {'device ms':>9} "
          f"{'host us':>8} {'vote us':>8} {'wrong':>6}")
    for name, shape in GEOMETRIES.items():
        x = torch.randn(shape, device=device).to(torch.bfloat16)
        for engine, ctas, splits in ((ENGINE_SM, 144, 1), (ENGINE_CE, 66, 1), (ENGINE_CE, 66, 2)):
            table = (TunedRow(policy.normalize_gpu_name(gpu), 1, torch.bfloat16, shape[2], shape[3], ctas=ctas,
                              planes_per_chunk=1,
                              row_chunks=splits, engine=engine, source="measure_fused_host_overhead (P = 1)"),)
            helper = helper_mod.UlyssesHelper(tuned_table=table, vote="shm")
            if not helper.fused_available:
                raise SystemExit(f"the one-rank helper declined: {helper.stats()['construction_detail']}")
            for mode in (0, 1):
                row = {"geometry": name, **measure(helper, x, mode, engine, ctas, args),
                       "sync_us": median_us(sync_s)}
                rows.append(row)
                wrong_total += row["wrong"]
                label = f"{engine} {ctas} CTAs x{splits}"
                print(f"{name:>12} {mode:>4} {label:>24} {row['chunks']:>6} {row['host_ms']:8.3f} "
                      f"{row['device_ms']:9.3f} {row['host_overhead_us']:8.1f} {row['vote_us']:8.1f} "
                      f"{row['wrong']:>6}")
            helper.destroy()
        torch.cuda.empty_cache()
    common.write_json(args.json, header, rows, sync_us=median_us(sync_s))
    print(f"{'OK' if not wrong_total else 'WRONG'}: {wrong_total} wrong element(s) over {len(rows)} rows")
    common.shutdown()
    return 1 if wrong_total else 0


if __name__ == "__main__":
    sys.exit(main())
