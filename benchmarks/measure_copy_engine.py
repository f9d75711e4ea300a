"""Copy-engine rates that a copy-engine plan kind of the fused route would build on, on one GPU.

    python benchmarks/measure_copy_engine.py --json ce.json          # one GPU, one process

The Ulysses relayout as copy-engine work: for mode 0 a sender gathers, per peer, every S_local row's
``run`` bytes (``run`` = H/P x D x itemsize) from rows ``H x D x itemsize`` apart, i.e. one pitched
copy (``cudaMemcpy2DAsync``: width ``run``, source pitch ``P x run``, height B x S_local); the receiver
then has its block contiguous. This script measures, device to device on one GPU (HBM, not NVLink:
it says whether the copy engine keeps its flat-copy rate when it gathers rows of these widths, which
is what decides whether pitched copies can fold the relayout at the link's speed):

* ``flat``: one contiguous ``cudaMemcpyAsync`` of the same bytes;
* ``pitched``: the gather above, for the run widths of wan720p (H=40) and H3 (H=56), D=128, bf16, at
  SP 2, 4 and 8;
* ``kernel``: torch's strided copy kernel doing the same gather (SMs, for comparison).

Rates count bytes read + written (2 x bytes moved) / time, median of ``--iters`` after a warm-up, CUDA
events. Needs CuPy for ``cudaMemcpy2DAsync`` (on the GPU hosts' image).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch


def time_ms(fn, iters: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def measure_case(label: str, heads: int, p: int, rows: int, iters: int) -> dict:
    """flat / pitched / kernel rates for the run width of ``heads`` at SP ``p`` (bf16, D=128)."""
    import cupy

    stream = torch.cuda.current_stream().cuda_stream
    d2d = cupy.cuda.runtime.memcpyDeviceToDevice
    run = heads // p * 128 * 2
    src = torch.randn(rows, p, run // 2, device="cuda").to(torch.bfloat16)  # [rows, P, run]: a head-split input
    dst = torch.empty(rows, run // 2, device="cuda", dtype=torch.bfloat16)
    flat_src = torch.empty_like(dst)
    nbytes = dst.numel() * 2
    q = p - 1  # the block of the last peer: a pitched gather

    def pitched() -> None:
        cupy.cuda.runtime.memcpy2DAsync(dst.data_ptr(), run, src.data_ptr() + q * run, p * run, run, rows, d2d, stream)

    def flat() -> None:
        cupy.cuda.runtime.memcpyAsync(dst.data_ptr(), flat_src.data_ptr(), nbytes, d2d, stream)

    def kernel() -> None:
        dst.copy_(src[:, q])

    pitched()
    torch.cuda.synchronize()
    assert torch.equal(dst, src[:, q]), "the pitched copy gathered the wrong rows"
    t_flat, t_pitch, t_kernel = (time_ms(f, iters) for f in (flat, pitched, kernel))
    rate = [2 * nbytes / (t * 1e-3) / 1e9 for t in (t_flat, t_pitch, t_kernel)]
    return {"case": f"{label} SP{p} run {run} B", "run_bytes": run, "rows": rows, "bytes": nbytes,
            "flat_ms": t_flat, "pitched_ms": t_pitch, "kernel_ms": t_kernel,
            "flat_gbps": rate[0], "pitched_gbps": rate[1], "kernel_gbps": rate[2]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--rows", type=int, default=37800, help="B x S_local rows per peer (wan720p SP2: 37800)")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("measure_copy_engine: needs a CUDA GPU", file=sys.stderr)
        return 2
    import cupy

    rows_out = []
    print(f"{'case':>28} {'bytes MB':>9} {'flat GB/s':>10} {'pitched GB/s':>13} {'kernel GB/s':>12} "
          f"{'pitched/flat':>12}")
    for heads, label in ((40, "wan720p"), (56, "h3")):
        for p in (2, 4, 8):
            if heads % p:
                continue
            r = measure_case(label, heads, p, args.rows, args.iters)
            rows_out.append(r)
            print(f"{r['case']:>28} {r['bytes'] / 1e6:9.1f} {r['flat_gbps']:10.0f} {r['pitched_gbps']:13.0f} "
                  f"{r['kernel_gbps']:12.0f} {r['pitched_gbps'] / r['flat_gbps']:12.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cupy": cupy.__version__,
                       "rows": rows_out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
