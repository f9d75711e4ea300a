"""The process-group start-up shared by the 2-GPU check scripts (``check_ulysses_h3_native.py``,
``check_ulysses_graphs.py``): gloo for a CPU dry run, else NCCL with one GPU per rank. Not a test module."""

from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist


def init_check_group(name: str, cpu_dry_run: bool) -> bool:
    """Start the default process group for check ``name``; False (after saying why on stderr) when this
    launch cannot run it: a dry run needs 2+ ranks, a real run 2+ GPUs and 2+ ranks. Real runs keep NVLink
    multicast off unless the caller set ``NCCL_NVLS_ENABLE``."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if cpu_dry_run:
        if world < 2:
            print(f"{name} --cpu-dry-run: run it under torch.distributed.run --nproc_per_node>=2", file=sys.stderr)
            return False
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=2))
        return True
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < 2 or world < 2:
        print(f"{name}: needs 2+ GPUs and torch.distributed.run --nproc_per_node>=2 (found {gpus} GPUs, "
              f"WORLD_SIZE={world}); nothing was checked.", file=sys.stderr)
        return False
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local), timeout=datetime.timedelta(minutes=5))
    return True
