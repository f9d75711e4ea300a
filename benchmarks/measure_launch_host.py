"""What a fused launch costs the host, per plan kind and chunk count, on one GPU (the kernel at P = 1).

    python3 benchmarks/measure_launch_host.py [--iters 200] [--json launch_host.json]

The host path of a fused call is the vote and the policy (``benchmarks/measure_host_path.py``, no GPU) plus
``NativeTransport.execute``: the output allocation, the ctypes call, the library's checks and its CUDA API
calls (one kernel for the SM kind; for the copy-engine kind, per chunk: the pushes, a barrier kernel, two
event records, two stream waits, the own-block and copy-out kernels, plus the fork, the entry barrier and
the join). This script times ``execute`` on the host with the stream held busy by a sleep kernel, so that no
call waits for the device: ``issue_us`` is host time only. At P = 1 a call pushes nothing (no peers), so the
copy-engine rows leave out the pushes' ``cudaMemcpy2DAsync`` calls (``--parts`` times one of those, through
CuPy where it is installed). Every call's output is checked against its input (at P = 1 the all-to-all is
the identity): ``wrong`` counts differing elements over all checked calls.

Printed: one row per (geometry, plan) with the chunk count, the median and p90 issue time, and per chunk;
then the parts (``--parts``): torch.empty on CUDA, a no-op ctypes call into the library, an event record, a
stream wait, an empty kernel launch, and a device-to-device ``cudaMemcpy2DAsync``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for path in (REPO, REPO / "fastvideo-kernel"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import torch  # noqa: E402

from fastvideo.distributed.ulysses.native import NativeTransport  # noqa: E402
from fastvideo.distributed.ulysses.policy import ENGINE_CE, Geometry, Plan  # noqa: E402
from fastvideo.distributed.ulysses.transport import ConstructionContext  # noqa: E402

# Per-rank operands of the SP2 geometries (at P = 1 the kernel moves the same bytes through the same chunks).
GEOMETRIES = {"wan720p-sp2": (1, 37800, 40, 128), "h3-32k-sp2": (3, 16384, 56, 128)}
BATCH = 8  # calls issued behind one sleep kernel before the host waits (the launch queue never fills)


def stats_us(seconds: list[float]) -> dict:
    us = sorted(s * 1e6 for s in seconds)
    return {"median_us": statistics.median(us), "p90_us": us[int(0.9 * (len(us) - 1))], "n": len(us)}


def timed_issue(fn, iters: int) -> list[float]:
    """Host seconds per ``fn()`` call, each batch queued behind a sleep kernel that outlasts its issue."""
    times = []
    for start in range(0, iters, BATCH):
        torch.cuda._sleep(50_000_000)  # ~25 ms at H200 clocks: the batch's issue never waits for the device
        for _ in range(min(BATCH, iters - start)):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
    return times


def plans_for(geom: Geometry) -> list[tuple[str, Plan]]:
    """The SM kernel in one launch, and the copy-engine kind at 1, 2 and 4 row chunks per plane (one plane
    per chunk: as the H200 rows run it). At P = 1 the whole operand is one chunk's bytes, so the SM launch
    is one chunk for either geometry."""
    out = [("sm 144 CTAs", Plan(144, geom.B, geom.S, tuned=True))]
    for split in (1, 2, 4):
        out.append((f"ce 66 CTAs, {split} row chunk(s)", Plan(66, 1, -(-geom.S // split), tuned=True,
                                                             engine=ENGINE_CE)))
    return out


def parts(transport: NativeTransport, device: torch.device, iters: int) -> dict:
    """Host microseconds of the pieces an execute is made of (each timed alone, the stream kept busy)."""
    lib = transport._lib
    shape = (1, 37800, 20, 128)
    stream = torch.cuda.current_stream(device)
    other = torch.cuda.Stream(device)
    event = torch.cuda.Event()
    small = torch.empty(16, device=device)
    out = {
        "torch.empty (cached)": stats_us(timed_issue(lambda: torch.empty(shape, dtype=torch.bfloat16, device=device),
                                                     iters)),
        "ctypes no-op (fvk_abi_version)": stats_us(timed_issue(lib.fvk_abi_version, iters)),
        "torch.cuda.current_stream": stats_us(timed_issue(lambda: torch.cuda.current_stream(device), iters)),
        "event record": stats_us(timed_issue(lambda: event.record(stream), iters)),
        "stream wait event": stats_us(timed_issue(lambda: other.wait_event(event), iters)),
        "empty kernel launch (small.zero_)": stats_us(timed_issue(small.zero_, iters)),
    }
    try:
        import cupy
    except ImportError:
        out["cudaMemcpy2DAsync"] = "CuPy not installed"
        return out
    src = torch.empty(2 * 37800 * 5120, dtype=torch.uint8, device=device)
    dst = torch.empty(37800 * 5120, dtype=torch.uint8, device=device)

    def copy2d() -> None:
        cupy.cuda.runtime.memcpy2DAsync(dst.data_ptr(), 5120, src.data_ptr(), 10240, 5120, 37800,
                                        cupy.cuda.runtime.memcpyDeviceToDevice, stream.cuda_stream)

    out["cudaMemcpy2DAsync (37800 rows of 5120 B)"] = stats_us(timed_issue(copy2d, iters))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--window-bytes", type=int, default=1 << 30)
    parser.add_argument("--no-parts", dest="parts", action="store_false")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("measure_launch_host: no CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    transport = NativeTransport()
    cap = transport.capability()
    if not cap.present:
        print(f"measure_launch_host: kernel library unavailable: {cap.detail}", file=sys.stderr)
        return 2
    ctx = ConstructionContext(rank=0, world_size=1, device=device, window_bytes=args.window_bytes, max_ctas=144,
                              device_group=None, all_gather_object=lambda obj: [obj])
    for step in transport.construction_steps(ctx):
        step.run()
    rows, wrong_total = [], 0
    print(f"{'geometry':>12} {'plan':>28} {'chunks':>6} {'issue us':>9} {'p90 us':>8} {'us/chunk':>8} {'wrong':>6}")
    for name, shape in GEOMETRIES.items():
        x = torch.randn(shape, device=device).to(torch.bfloat16)
        for mode in (0, 1):
            geom = Geometry.from_input(x.shape, mode, 1, x.dtype)
            for label, plan in plans_for(geom):
                chunks = plan.num_chunks(geom)
                wrong = 0
                for _ in range(3):  # every plan: output equals input at P = 1 (and warms up)
                    y = transport.execute(x, geom, plan)
                    torch.cuda.synchronize()
                    wrong += int((y.view(torch.int16) != x.view(torch.int16)).sum())
                times = timed_issue(lambda x=x, geom=geom, plan=plan: transport.execute(x, geom, plan), args.iters)
                s = stats_us(times)
                row = {"geometry": name, "mode": mode, "plan": plan.describe(geom), "label": label,
                       "engine": plan.engine, "chunks": chunks, "issue_median_us": s["median_us"],
                       "issue_p90_us": s["p90_us"], "issue_us_per_chunk": s["median_us"] / chunks, "wrong": wrong}
                rows.append(row)
                wrong_total += wrong
                print(f"{name:>12} {label + f' m{mode}':>28} {chunks:>6} {s['median_us']:9.1f} {s['p90_us']:8.1f} "
                      f"{s['median_us'] / chunks:8.1f} {wrong:>6}")
        del x
        torch.cuda.empty_cache()
    part_rows = parts(transport, device, args.iters) if args.parts else {}
    for what, s in part_rows.items():
        print(f"part: {what}: " + (f"{s['median_us']:.2f} us median, {s['p90_us']:.2f} p90" if isinstance(s, dict)
                                    else s))
    transport.destroy()
    if args.json:
        header = {"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__,
                  "nccl": ".".join(map(str, torch.cuda.nccl.version())), "library": cap.detail,
                  "commit": (REPO / "COMMIT").read_text().strip() if (REPO / "COMMIT").is_file() else "unknown",
                  "iters": args.iters, "argv": sys.argv}
        Path(args.json).write_text(json.dumps({"header": header, "rows": rows, "parts": part_rows}, indent=1) + "\n")
    print(f"{'OK' if not wrong_total else 'WRONG'}: {wrong_total} wrong element(s) over {len(rows)} plans")
    return 1 if wrong_total else 0


if __name__ == "__main__":
    sys.exit(main())
