"""Copy-engine rates of the Ulysses relayout on one GPU: what the copy-engine plan kind builds on.

For mode 0 a sender gathers, per peer, every S_local row's ``run`` bytes (``run`` = H/P x D x itemsize) from rows
``H x D x itemsize`` apart: one pitched copy (``cudaMemcpy2DAsync``: width ``run``, source pitch ``P x run``,
height B x S_local); the receiver then has its block contiguous. Measured device to device on one GPU (HBM, not
NVLink: whether the copy engine keeps its flat-copy rate when it gathers rows of these widths):

* ``flat``: one contiguous ``cudaMemcpyAsync`` of the same bytes;
* ``pitched``: the gather above (through CuPy), for the run widths of wan720p (H=40) and H3 (H=56), D=128,
  bf16, at SP 2, 4 and 8;
* ``kernel``: torch's strided copy kernel doing the same gather (SMs, for comparison).

Rates count bytes read + written (2 x bytes) / time, the median of ``--iters`` after ``--warmup``, CUDA events.
``wrong`` compares the gathered rows with the source block. On CPU, or without CuPy, the pitched copy is skipped
and the rest runs (on CPU a dry run: host copies, timings mean nothing).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import ClassVar

import torch

from benchmarks.harness import oracle, report
from benchmarks.harness.case import Case, Context

HEADS = ((40, "wan720p"), (56, "h3"))


def time_ms(fn, iters: int, warmup: int, cuda: bool) -> float:
    for _ in range(warmup):
        fn()
    times = []
    if cuda:
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(iters):
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop))
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


class CopyEngineCase(Case):
    name = "copy_engine"
    summary = "flat, pitched (cudaMemcpy2DAsync) and kernel gathers of the relayout's row widths on one GPU"
    key = ("case_name",)
    metric = "pitched_ms"
    defaults: ClassVar[dict] = {"iters": 20, "warmup": 3}
    quick: ClassVar[dict] = {"iters": 3, "warmup": 1}
    columns = (
        report.Column("case_name", "case", width=26),
        report.Column("bytes", "MB", fmt=".1f", scale=1e-6),
        report.Column("flat_gbps", "flat GB/s", fmt=".0f"),
        report.Column("pitched_gbps", "pitched GB/s", fmt=".0f"),
        report.Column("kernel_gbps", "kernel GB/s", fmt=".0f"),
        report.Column("pitched_over_flat", "pitched/flat", fmt=".2f"),
    )

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--rows", type=int, default=0,
                            help="B x S_local rows per peer (default 37800, wan720p at SP2; 256 on CPU)")

    def run(self, ctx: Context) -> None:
        args, device = ctx.args, ctx.device
        cuda = device.type == "cuda"
        rows = args.rows or (37800 if cuda else 256)
        cupy, why_not = None, ""
        if not cuda:
            why_not = "needs a CUDA GPU"
            ctx.note("CPU: a dry run of the flat and kernel gathers (timings mean nothing); pitched skipped")
        else:
            try:
                import cupy
            except ImportError:
                why_not = "CuPy not installed"
                ctx.note("CuPy is not installed: the pitched rows are skipped")
        ctx.header.update(rows=rows, cupy=getattr(cupy, "__version__", None))
        for heads, label in HEADS:
            for p in (2, 4, 8):
                if heads % p:
                    continue
                run = heads // p * 128 * 2
                src = oracle.make_input((rows, p, run // 2), torch.bfloat16, device, args.seed + p)
                dst = torch.empty(rows, run // 2, device=device, dtype=torch.bfloat16)
                flat_src = torch.empty_like(dst)
                nbytes = dst.numel() * 2
                q = p - 1  # the block of the last peer: a pitched gather

                def kernel(dst=dst, src=src, q=q) -> None:
                    dst.copy_(src[:, q])

                def flat(dst=dst, flat_src=flat_src) -> None:
                    dst.copy_(flat_src)

                row = {"case_name": f"{label} SP{p} run {run} B", "run_bytes": run, "rows": rows, "bytes": nbytes}
                kernel()
                wrong = oracle.count_bitwise_diff(dst, src[:, q])
                times = {"flat": time_ms(flat, args.iters, args.warmup, cuda),
                         "kernel": time_ms(kernel, args.iters, args.warmup, cuda)}
                if cupy is not None:
                    stream = torch.cuda.current_stream().cuda_stream
                    d2d = cupy.cuda.runtime.memcpyDeviceToDevice

                    def pitched(dst=dst, src=src, q=q, run=run, p=p, stream=stream, d2d=d2d) -> None:
                        cupy.cuda.runtime.memcpy2DAsync(dst.data_ptr(), run, src.data_ptr() + q * run, p * run, run,
                                                        rows, d2d, stream)

                    dst.zero_()
                    pitched()
                    torch.cuda.synchronize()
                    wrong += oracle.count_bitwise_diff(dst, src[:, q])
                    times["pitched"] = time_ms(pitched, args.iters, args.warmup, cuda)
                else:
                    row["pitched_note"] = why_not
                for k, t in times.items():
                    row[f"{k}_ms"] = t
                    row[f"{k}_gbps"] = 2 * nbytes / (t * 1e-3) / 1e9
                row["pitched_over_flat"] = (row["pitched_gbps"] / row["flat_gbps"]) if "pitched_gbps" in row else None
                ctx.add_row({**row, "wrong": wrong, "wrong_oracle": "the gathered rows vs the source block "
                             "(kernel gather" + (", pitched gather)" if cupy is not None else ")")})


CASE = CopyEngineCase()
