"""Check the benchmark's fabric limit (``copy_engine_reference``): CUDA-IPC handles travel over the CPU
group, every rank copies into every peer's buffer, and every byte arrives.

    torchrun --standalone --nproc_per_node=2 benchmarks/check_fabric_reference.py [--mib 256]

Runs on any number of GPUs, including one (ranks then share it: the copies are device-local, so the rate
says nothing about the fabric; the check is that the IPC path works and moves every byte). Prints the
median time and rate per rank; exits 1 if a byte is missing.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import common  # first: puts the FastVideo tree under test on sys.path
import torch
import torch.distributed as dist
from benchmark_ulysses_a2a import copy_engine_reference

from fastvideo.distributed import parallel_state


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=256, help="bytes per peer, MiB")
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("check_fabric_reference: needs CUDA", file=sys.stderr)
        return 2
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local % torch.cuda.device_count())
    torch.cuda.set_device(device)
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
    parallel_state.initialize_sequence_parallel(dist.get_world_size())
    try:
        nbytes = args.mib << 20
        t = copy_engine_reference(nbytes, device, args.iters, 3)
        rank = dist.get_rank()
        shared = torch.cuda.device_count() < dist.get_world_size()
        peers = dist.get_world_size() - 1
        print(f"rank {rank}: {peers} x {args.mib} MiB in {t * 1e3:.3f} ms = "
              f"{common.bandwidth_gbps(nbytes * dist.get_world_size(), dist.get_world_size(), t):.1f} GB/s per rank"
              f"{' (ranks share one GPU: device-local copies, not the fabric)' if shared else ''}; every byte arrived",
              flush=True)
    finally:
        parallel_state.destroy_sequence_parallel()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
