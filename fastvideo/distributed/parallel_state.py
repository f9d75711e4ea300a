"""Sequence-parallel (SP) process groups.

The world is cut into SP groups of ``sp_size`` consecutive ranks (ranks ``[k*sp, (k+1)*sp)``); the
data-parallel groups run across them (ranks with the same SP rank). Each SP group has a *device*
group (NCCL on CUDA, gloo on CPU) that carries the all-to-all, and a gloo *CPU* group for host-side
agreement. Creation is collective over the world (``torch.distributed.new_group`` needs every rank).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class GroupCoordinator:
    """One process group as seen from this rank: its ranks, device group and CPU (gloo) group."""

    ranks: list[int]
    rank_in_group: int
    device_group: dist.ProcessGroup
    cpu_group: dist.ProcessGroup
    device: torch.device

    @property
    def world_size(self) -> int:
        return len(self.ranks)


_SP: GroupCoordinator | None = None
_DP: GroupCoordinator | None = None


def _device_for_backend(backend: str) -> torch.device:
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def initialize_sequence_parallel(sp_size: int, *, timeout: datetime.timedelta | None = None) -> GroupCoordinator:
    """Create the SP and DP groups. Collective over the world; call once after ``init_process_group``.

    ``sp_size`` must divide the world size. ``timeout`` bounds every collective of the new groups
    (gloo and NCCL), so tests can keep a hang short.
    """
    global _SP, _DP
    if not dist.is_initialized():
        raise RuntimeError("initialize_sequence_parallel: call torch.distributed.init_process_group first.")
    if _SP is not None:
        raise RuntimeError(
            "initialize_sequence_parallel: SP groups already exist; call destroy_sequence_parallel first."
        )
    world, rank = dist.get_world_size(), dist.get_rank()
    if not isinstance(sp_size, int) or sp_size < 1 or world % sp_size:
        raise ValueError(
            f"initialize_sequence_parallel: sp_size={sp_size!r} must be a positive integer dividing the world size "
            f"{world}; pick one of {[d for d in range(1, world + 1) if world % d == 0]}."
        )
    backend = dist.get_backend()
    device = _device_for_backend(backend)
    kwargs = {"timeout": timeout} if timeout is not None else {}
    sp: GroupCoordinator | None = None
    for start in range(0, world, sp_size):
        ranks = list(range(start, start + sp_size))
        dev_group = dist.new_group(ranks, backend=backend, **kwargs)
        cpu_group = dist.new_group(ranks, backend="gloo", **kwargs)
        if rank in ranks:
            sp = GroupCoordinator(ranks, ranks.index(rank), dev_group, cpu_group, device)
    dp: GroupCoordinator | None = None
    for offset in range(sp_size):
        ranks = list(range(offset, world, sp_size))
        dev_group = dist.new_group(ranks, backend=backend, **kwargs)
        cpu_group = dist.new_group(ranks, backend="gloo", **kwargs)
        if rank in ranks:
            dp = GroupCoordinator(ranks, ranks.index(rank), dev_group, cpu_group, device)
    assert sp is not None and dp is not None
    _SP, _DP = sp, dp
    return sp


def model_parallel_is_initialized() -> bool:
    return _SP is not None


def get_sp_group() -> GroupCoordinator:
    if _SP is None:
        raise RuntimeError("SP groups are not initialised: call initialize_sequence_parallel(sp_size) first.")
    return _SP


def get_dp_group() -> GroupCoordinator:
    if _DP is None:
        raise RuntimeError("DP groups are not initialised: call initialize_sequence_parallel(sp_size) first.")
    return _DP


def get_sp_world_size() -> int:
    return get_sp_group().world_size


def get_sp_rank() -> int:
    return get_sp_group().rank_in_group


def destroy_sequence_parallel() -> None:
    """Tear down in a safe order: the Ulysses helper (collective) first, then the groups it used.

    Collective over each SP group. Safe to call when nothing was initialised.
    """
    global _SP, _DP
    # Imported here: the helper module imports this one.
    from fastvideo.distributed.ulysses import helper as _helper

    _helper.destroy_default_helper()
    for coordinator in (_DP, _SP):
        if coordinator is None:
            continue
        for group in (coordinator.device_group, coordinator.cpu_group):
            try:
                dist.destroy_process_group(group)
            except (RuntimeError, ValueError):
                pass  # already gone with the default group
    _SP = _DP = None
