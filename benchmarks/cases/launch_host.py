"""What a fused launch costs the host, per plan kind and chunk count, on one GPU (the kernel at P = 1).

The host path of a fused call is the vote and the policy (``host_path``) plus ``NativeTransport.execute``: the
output allocation, the ctypes call, the library's checks and its CUDA API calls (one kernel for the SM kind; for
the copy-engine kind per chunk the pushes, a barrier kernel, two event records, two stream waits, the own-block
and copy-out kernels, plus the fork, the entry barrier and the join). ``execute`` is timed on the host with the
stream held busy by a sleep kernel, so that no call waits for the device: ``issue_us`` is host time only. At P = 1
a call pushes nothing (no peers), so the copy-engine rows leave out the pushes' ``cudaMemcpy2DAsync`` calls
(``--parts`` times one of those, through CuPy where installed, beside an allocation, a no-op ctypes call, an
event record, a stream wait and an empty kernel launch). Every call's output is compared with its input (the
all-to-all at P = 1 is the identity).

Geometries are the per-rank operands at SP2 (``--at-sp``) of ``--geometry`` (default wan720p, h3-32k). On CPU
it is a dry run: the same loop on ``GlooPlanTransport`` at P = 1 (timings mean nothing).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import ClassVar

import torch

from benchmarks.harness import oracle, product, report
from benchmarks.harness.case import Case, Context
from benchmarks.harness.cli import divisible, input_shape

BATCH = 8  # calls issued behind one sleep kernel before the host waits (the launch queue never fills)


def stats_us(seconds: list[float]) -> dict:
    us = sorted(s * 1e6 for s in seconds)
    return {"median_us": statistics.median(us), "p90_us": us[int(0.9 * (len(us) - 1))], "n": len(us)}


def timed_issue(fn, iters: int, cuda: bool) -> list[float]:
    """Host seconds per ``fn()`` call, each batch queued behind a sleep kernel that outlasts its issue (CUDA)."""
    times = []
    for start in range(0, iters, BATCH):
        if cuda:
            torch.cuda._sleep(50_000_000)  # ~25 ms at H200 clocks: the batch's issue never waits for the device
        for _ in range(min(BATCH, iters - start)):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        if cuda:
            torch.cuda.synchronize()
    return times


def plans_for(geom) -> list[tuple[str, object]]:
    """The SM kernel in one launch, and the copy-engine kind at 1, 2 and 4 row chunks per plane (one plane per
    chunk, as the H200 rows run it). At P = 1 the whole operand is one chunk's bytes."""
    from fastvideo.distributed.ulysses.policy import ENGINE_CE, Plan

    out = [("sm 144 CTAs", Plan(144, geom.B, geom.S, tuned=True))]
    for split in (1, 2, 4):
        out.append((f"ce 66 CTAs, {split} row chunk(s)", Plan(66, 1, -(-geom.S // split), tuned=True,
                                                             engine=ENGINE_CE)))
    return out


def parts(native, device: torch.device, iters: int) -> dict:
    """Host microseconds of the pieces an execute is made of (each timed alone, the stream kept busy)."""
    shape = (1, 37800, 20, 128)
    stream = torch.cuda.current_stream(device)
    other = torch.cuda.Stream(device)
    event = torch.cuda.Event()
    small = torch.empty(16, device=device)
    out = {
        "torch.empty (cached)": stats_us(timed_issue(lambda: torch.empty(shape, dtype=torch.bfloat16, device=device),
                                                     iters, True)),
        "ctypes no-op (fvk_abi_version)": stats_us(timed_issue(product.library_noop(native), iters, True)),
        "torch.cuda.current_stream": stats_us(timed_issue(lambda: torch.cuda.current_stream(device), iters, True)),
        "event record": stats_us(timed_issue(lambda: event.record(stream), iters, True)),
        "stream wait event": stats_us(timed_issue(lambda: other.wait_event(event), iters, True)),
        "empty kernel launch (small.zero_)": stats_us(timed_issue(small.zero_, iters, True)),
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

    out["cudaMemcpy2DAsync (37800 rows of 5120 B)"] = stats_us(timed_issue(copy2d, iters, True))
    return out


def cpu_stand_in(window_bytes: int):
    """``GlooPlanTransport`` constructed at P = 1 over the run's one-rank group: the dry run's transport."""
    import torch.distributed as dist

    from fastvideo.distributed.parallel_state import get_sp_group
    from fastvideo.distributed.ulysses.transport import ConstructionContext
    GlooPlanTransport = product.plan_transport()

    transport = GlooPlanTransport()
    ctx = ConstructionContext(rank=0, world_size=1, device=torch.device("cpu"), window_bytes=window_bytes,
                              max_ctas=144, device_group=get_sp_group().device_group,
                              all_gather_object=lambda obj: [obj])
    assert dist.get_world_size() == 1
    for step in transport.construction_steps(ctx):
        step.run()
    return transport


class LaunchHostCase(Case):
    name = "launch_host"
    summary = "NativeTransport.execute's host time per plan kind and chunk count at P = 1 (one GPU)"
    key = ("geometry", "mode", "label")
    metric = "issue_median_us"
    defaults: ClassVar[dict] = {"iters": 200}
    quick: ClassVar[dict] = {"iters": 16}
    columns = (
        report.Column("geometry", "geometry", width=12),
        report.Column("label_mode", "plan", width=28, get=lambda r: f"{r['label']} m{r['mode']}"),
        report.Column("chunks", "chunks"),
        report.Column("issue_median_us", "issue us", fmt=".1f"),
        report.Column("issue_p90_us", "p90 us", fmt=".1f"),
        report.Column("issue_us_per_chunk", "us/chunk", fmt=".1f"),
    )

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--window-bytes", type=int, default=1 << 30)
        parser.add_argument("--at-sp", type=int, default=2, help="the geometries' per-rank operands at this SP size")
        parser.add_argument("--no-parts", dest="parts", action="store_false", help="skip the parts' timings")

    def report(self, ctx: Context) -> list[str]:
        lines = super().report(ctx)
        for what, s in (ctx.extra.get("parts") or {}).items():
            lines.append(f"# part: {what}: " + (f"{s['median_us']:.2f} us median, {s['p90_us']:.2f} p90"
                                               if isinstance(s, dict) else s))
        return lines

    def run(self, ctx: Context) -> None:
        from fastvideo.distributed.ulysses.policy import Geometry

        args, device = ctx.args, ctx.device
        if ctx.world != 1:
            raise SystemExit("launch_host: run it as one process (P = 1)")
        cuda = device.type == "cuda"
        if cuda:
            native, detail = product.one_rank_native_transport(device, args.window_bytes)
            if native is None:
                raise SystemExit(f"launch_host: kernel library unavailable: {detail}")
            ctx.header["library"] = detail
        else:
            native = cpu_stand_in(args.window_bytes)
            ctx.note("CPU: a dry run on GlooPlanTransport at P = 1 (timings mean nothing)")
        ctx.header.update(at_sp=args.at_sp, dry_run=not cuda)
        geometries = ctx.geometries(cpu=("toy",), gpu=("wan720p", "h3-32k"))
        ctx.progress.total = len(geometries) * 2
        try:
            for name, shape in geometries:
                why = divisible(shape, args.at_sp)
                if why:
                    ctx.skip(why, geometry=name, mode=None, label="")
                    continue
                x = oracle.make_input(input_shape(shape, 0, args.at_sp), ctx.dtype, device, args.seed)
                for mode in (0, 1):
                    geom = Geometry.from_input(x.shape, mode, 1, x.dtype)
                    for label, plan in plans_for(geom):
                        wrong = 0
                        for _ in range(3):  # every plan: output equals input at P = 1 (and warms up)
                            y = native.execute(x, geom, plan)
                            if cuda:
                                torch.cuda.synchronize()
                            wrong += oracle.count_bitwise_diff(y, x)
                        s = stats_us(timed_issue(lambda x=x, geom=geom, plan=plan: native.execute(x, geom, plan),
                                                 args.iters, cuda))
                        chunks = plan.num_chunks(geom)
                        ctx.add_row({"geometry": name, "mode": mode, "plan": plan.describe(geom), "label": label,
                                     "engine": plan.engine, "chunks": chunks, "issue_median_us": s["median_us"],
                                     "issue_p90_us": s["p90_us"], "issue_us_per_chunk": s["median_us"] / chunks,
                                     "wrong": wrong, "wrong_oracle": "the input (the all-to-all at P = 1 is the "
                                     "identity), 3 calls per plan"})
                    ctx.advance(f"{name} mode {mode}")
                del x
                if cuda:
                    torch.cuda.empty_cache()
            if cuda and args.parts:
                ctx.extra["parts"] = parts(native, device, args.iters)
        finally:
            native.destroy()


CASE = LaunchHostCase()
