"""The benchmark's fabric limit (``fabric_reference``) alone, at a few sizes: both engines' rates.

    FASTVIDEO_KERNEL_LIBRARY=DIR/libfastvideo_ulysses_a2a_testing.so \
        torchrun --standalone --nproc_per_node=2 benchmarks/check_fabric_reference.py [--mib 64,256]

Builds the default helper (the native transport: it needs one GPU per rank and the kernel library; the
fabric copy is the test library's, ``python fastvideo-kernel/build_lib.py --out DIR --testing``) and
times ``fvk_fabric_copy``: every rank pushes the bytes into every peer's window at once, with the copy
engines and with SM stores, barrier before and after. Prints one line per size with both rates.
"""

from __future__ import annotations

import argparse
import sys

import common  # first: puts the FastVideo tree under test on sys.path
import torch
from benchmark_ulysses_a2a import fabric_reference


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", default="64,256", help="bytes per peer, MiB (comma list)")
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("check_fabric_reference: needs CUDA", file=sys.stderr)
        return 2
    rank, world, device = common.init_distributed("cuda")
    from fastvideo.distributed.ulysses.helper import get_default_helper

    helper = get_default_helper()
    status = 0
    for mib in (int(m) for m in args.mib.split(",")):
        ref = fabric_reference(helper, mib << 20, device, args.iters, 3)
        if ref is None:
            print(f"rank {rank}: no fabric reference (fused route: {helper.stats()['construction']})", flush=True)
            status = 1
            break
        print(f"rank {rank}: {world - 1} x {mib} MiB: copy engines {ref['fabric_ce_gbps']:.1f} GB/s, SM stores "
              f"{ref['fabric_sm_gbps']:.1f} GB/s, limit {ref['fabric_ms']:.3f} ms ({ref['fabric_engine']})", flush=True)
    common.set_route("off")
    common.shutdown()
    return status


if __name__ == "__main__":
    sys.exit(main())
