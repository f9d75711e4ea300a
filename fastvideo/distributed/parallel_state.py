"""Upstream FastVideo's ``parallel_state``: the world, node and TP groups, the init and cleanup entry points,
upstream's group factories and helpers, and the SP layer (``sp_groups``) re-exported, so that everything upstream
imports from here resolves here.

``maybe_init_distributed_environment_and_model_parallel(tp_size, sp_size)`` initialises the default group from
torchrun's environment, a world group, the node group, the SP and DP groups (``initialize_sequence_parallel``) and
the TP groups; ``cleanup_dist_env_and_memory()`` tears all of it down, helpers first. Every group is a
``GroupCoordinator`` with upstream's collectives and transfers (``group_transfers``); deliberate differences are in
``docs/fastvideo_migration.md``.

The SP and DP groups, their ``GroupCoordinator`` and the agreed settings live in ``sp_groups``: this module
builds on them and changes nothing in how they are built, and ``sp_groups`` never imports it. As upstream's init
builds its communicators' Ulysses helpers, ``initialize_model_parallel`` installs what the SP communicator's
``ulysses_a2a`` is (``ulysses.registry.install``): this module sits above the Ulysses layer.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from fastvideo import _module_present, envs
from fastvideo.distributed import sp_groups as _sp_groups
from fastvideo.distributed.group_transfers import GraphCaptureContext, TensorMetadata
from fastvideo.distributed.node_groups import get_same_node_ranks, is_the_same_node_as
from fastvideo.distributed.sp_groups import (
    GroupCoordinator,
    _destroy_groups,
    _device_for_backend,
    _groups,
    agree_ulysses_settings,
    check_group_size,
    consecutive_groups,
    destroy_sequence_parallel,
    get_dp_group,
    get_sp_group,
    get_sp_rank,
    get_sp_world_size,
    model_parallel_is_initialized,
    override_ulysses_settings,
)
from fastvideo.distributed.ulysses import registry as _ulysses_registry

__all__ = [
    "GraphCaptureContext",
    "GroupCoordinator",
    "TensorMetadata",
    "agree_ulysses_settings",
    "all_reduce",
    "all_reduce_fake",
    "cleanup_dist_env_and_memory",
    "destroy_distributed_environment",
    "destroy_model_parallel",
    "destroy_sequence_parallel",
    "get_dp_group",
    "get_dp_rank",
    "get_dp_world_size",
    "get_local_torch_device",
    "get_node_group",
    "get_same_node_ranks",
    "get_sp_group",
    "get_sp_parallel_rank",
    "get_sp_rank",
    "get_sp_world_size",
    "get_tp_group",
    "get_tp_rank",
    "get_tp_world_size",
    "get_world_group",
    "get_world_rank",
    "get_world_size",
    "init_distributed_environment",
    "init_model_parallel_group",
    "init_node_group",
    "init_world_group",
    "initialize_model_parallel",
    "initialize_sequence_parallel",
    "initialize_sequence_parallel_group",
    "initialize_tensor_parallel_group",
    "is_the_same_node_as",
    "maybe_init_distributed_environment_and_model_parallel",
    "model_parallel_is_initialized",
    "override_ulysses_settings",
    "patch_tensor_parallel_group",
    "set_custom_all_reduce",
    "state",
]

logger = logging.getLogger(__name__)

_WORLD: GroupCoordinator | None = None
_NODE: GroupCoordinator | None = None  # the ranks of this rank's node (upstream's weight loaders read it)
_TP: GroupCoordinator | None = None
_TP_STATE_PATCHED = False
_TP_GROUPS: list[dist.ProcessGroup] = []  # every TP group this rank created (each rank creates all of them)


def get_world_group() -> GroupCoordinator:
    if _WORLD is None:
        raise RuntimeError("The world group is not initialised: call maybe_init_distributed_environment_and_"
                           "model_parallel(tp_size, sp_size) or init_distributed_environment() first.")
    return _WORLD


def get_tp_group() -> GroupCoordinator:
    if _TP is None:
        raise RuntimeError("TP groups are not initialised: call maybe_init_distributed_environment_and_model_parallel"
                           "(tp_size, sp_size) or initialize_model_parallel() first.")
    return _TP


def get_world_size() -> int:
    return get_world_group().world_size


def get_world_rank() -> int:
    return get_world_group().rank_in_group


def get_tp_world_size() -> int:
    return get_tp_group().world_size


def get_tp_rank() -> int:
    return get_tp_group().rank_in_group


# This rank's rank in its SP group: upstream's name for ``get_sp_rank``.
get_sp_parallel_rank = get_sp_rank


def get_dp_world_size() -> int:
    return get_dp_group().world_size


def get_dp_rank() -> int:
    return get_dp_group().rank_in_group


def get_local_torch_device() -> torch.device:
    """The device this rank computes on: the world group's once it exists (``cuda:LOCAL_RANK`` over NCCL, the
    CPU over gloo); before that the platform's, asked as upstream asks it (its ``current_platform``; alone, torch):
    ``npu:LOCAL_RANK`` or ``cuda:LOCAL_RANK``, else the CPU (upstream says ``mps``, which gloo cannot use). Local."""
    if _WORLD is not None:
        return _WORLD.device
    if not _module_present("fastvideo.platforms"):
        kind = "cuda" if torch.cuda.is_available() else None
    else:
        from fastvideo.platforms import current_platform

        cuda = current_platform.is_cuda_alike() or current_platform.is_cuda()
        kind = "npu" if current_platform.is_npu() else "cuda" if cuda else None
    return torch.device(kind, int(envs.LOCAL_RANK)) if kind else torch.device("cpu")


def init_distributed_environment(
    world_size: int = 1,
    rank: int = 0,
    distributed_init_method: str = "env://",
    local_rank: int = 0,
    backend: str = "nccl",
    device_id: torch.device | None = None,
) -> GroupCoordinator:
    """Initialise the default process group if needed, and the world group. Collective over the world.

    ``backend``: ``"nccl"`` (the default) where CUDA is available, after ``torch.cuda.set_device(local_rank)``;
    gloo on a machine without CUDA (as upstream picks by platform) or when asked for ``"gloo"`` (the CPU, also
    on a GPU host). ``local_rank=-1`` reads ``LOCAL_RANK``. An existing default group is kept, with its backend.
    ``device_id`` is accepted for upstream's signature; the device is ``cuda:local_rank`` over NCCL.
    """
    global _WORLD
    if local_rank == -1:
        local_rank = int(envs.LOCAL_RANK) if distributed_init_method == "env://" else rank
    if dist.is_initialized():
        backend = dist.get_backend()
    elif backend not in ("nccl", "gloo"):
        raise ValueError(f"init_distributed_environment: backend={backend!r} must be 'nccl' or 'gloo'.")
    elif backend == "nccl" and not torch.cuda.is_available():
        backend = "gloo"
    if backend == "nccl":
        count = torch.cuda.device_count()
        if not 0 <= local_rank < count:
            raise ValueError(f"init_distributed_environment: local_rank={local_rank} but this host has {count} "
                             "CUDA device(s); launch one process per GPU (torchrun --nproc_per_node=<GPUs>).")
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, init_method=distributed_init_method, world_size=world_size,
                                rank=rank)
    if _WORLD is None:
        world = dist.get_world_size()
        default = dist.group.WORLD
        assert default is not None
        # The default group carries the world group's device collectives; gloo for its host side.
        cpu_group = default if backend == "gloo" else dist.new_group(list(range(world)), backend="gloo")
        _WORLD = GroupCoordinator.of(list(range(world)), dist.get_rank(), default, cpu_group,
                                     _device_for_backend(backend), local_rank=local_rank, unique_name="world")
    elif _WORLD.world_size != dist.get_world_size():
        raise RuntimeError(f"init_distributed_environment: the world group has {_WORLD.world_size} ranks but the "
                           f"default group {dist.get_world_size()}; call cleanup_dist_env_and_memory() first.")
    if _NODE is None:
        init_node_group(local_rank, dist.get_backend())
    return _WORLD


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    sequence_model_parallel_size: int = 1,
    data_parallel_size: int = 1,
    backend: str | None = None,
) -> None:
    """Build the SP, DP and TP groups over the world group. Collective over the world.

    SP groups: ``initialize_sequence_parallel(sequence_model_parallel_size)`` (which validates and agrees the
    settings), or the existing ones when they were built with that size. DP groups run across them (size
    ``world / sp``; ``data_parallel_size`` is 1, meaning that, or must equal it). TP groups: consecutive ranks,
    ``tensor_model_parallel_size`` each (it must divide the world size). Raises if TP groups already exist.
    """
    global _TP
    world = get_world_group()
    n = world.world_size
    tp_ranks = consecutive_groups("initialize_model_parallel", "tensor_model_parallel_size",
                                  tensor_model_parallel_size, n)
    check_group_size("initialize_model_parallel", "sequence_model_parallel_size", sequence_model_parallel_size, n)
    dp = n // sequence_model_parallel_size
    if data_parallel_size not in (1, dp):
        raise ValueError(f"initialize_model_parallel: data_parallel_size={data_parallel_size!r}, but the DP groups "
                         f"of {n} ranks at SP size {sequence_model_parallel_size} have {dp} ranks; pass 1 or {dp}.")
    if backend is not None and backend != dist.get_backend():
        raise ValueError(f"initialize_model_parallel: backend={backend!r} differs from the default group's "
                         f"{dist.get_backend()!r}; the groups use the default group's backend.")
    if _TP is not None:
        raise RuntimeError("initialize_model_parallel: TP groups already exist; call cleanup_dist_env_and_memory() "
                           "first (maybe_init_distributed_environment_and_model_parallel returns when they match).")
    if not model_parallel_is_initialized():
        initialize_sequence_parallel(sequence_model_parallel_size)
    elif get_sp_world_size() != sequence_model_parallel_size:
        raise ValueError(f"initialize_model_parallel: SP groups of size {get_sp_world_size()} already exist, not "
                         f"{sequence_model_parallel_size}; call destroy_sequence_parallel() first.")
    for coordinator in (get_sp_group(), get_dp_group()):  # the SP and DP groups exist now
        coordinator.local_rank = world.local_rank
    _TP = GroupCoordinator(tp_ranks, world.local_rank, dist.get_backend(), True, group_name="tp", created=_TP_GROUPS)


def init_model_parallel_group(group_ranks: list[list[int]], local_rank: int, backend: str,
                              use_message_queue_broadcaster: bool = False,
                              group_name: str | None = None) -> GroupCoordinator:
    """Upstream's factory: a coordinator over this rank's list of ``group_ranks`` (every rank creates every group:
    collective over the world). ``use_message_queue_broadcaster`` builds nothing here."""
    return GroupCoordinator(group_ranks, local_rank, backend, True, use_message_queue_broadcaster, group_name)


def init_world_group(ranks: list[int], local_rank: int, backend: str) -> GroupCoordinator:
    """Upstream's factory: a coordinator over ``ranks`` named ``world`` (collective). ``init_distributed_environment``
    builds the world group over the default group instead, creating no device group."""
    return GroupCoordinator([ranks], local_rank, backend, True, group_name="world")


def get_node_group() -> GroupCoordinator:
    """The ranks of this rank's node (built by ``init_distributed_environment``). Local."""
    if _NODE is None:
        raise RuntimeError("The node group is not initialised: call init_distributed_environment() first.")
    return _NODE


def init_node_group(local_rank: int, backend: str) -> None:
    """Build the node groups: consecutive blocks of as many ranks as share rank 0's node (``get_same_node_ranks``
    over the world's CPU group). Collective over the world. Every node must hold as many ranks (ValueError
    otherwise, before any group is created)."""
    global _NODE
    size = len(get_same_node_ranks(get_world_group().cpu_group))
    world = dist.get_world_size()
    if world % size:
        raise ValueError(f"init_node_group: rank 0's node holds {size} of the {world} ranks; every node must hold as "
                         "many ranks (launch the same number of processes on each node).")
    _NODE = GroupCoordinator([list(range(start, start + size)) for start in range(0, world, size)], local_rank,
                             backend, True, group_name="node")


def set_custom_all_reduce(enable: bool) -> None:
    """Upstream's switch for its custom all-reduce. Accepted; this package has none, so it changes nothing."""


@contextlib.contextmanager
def patch_tensor_parallel_group(tp_group: GroupCoordinator) -> Iterator[None]:
    """Local: ``get_tp_group()`` is ``tp_group`` for the block (upstream: models with another TP size), restored
    after it. Not reentrant: a nested patch raises RuntimeError."""
    global _TP, _TP_STATE_PATCHED
    if _TP_STATE_PATCHED:
        raise RuntimeError("patch_tensor_parallel_group: the TP group is already patched; nesting is not supported.")
    previous = get_tp_group()
    _TP_STATE_PATCHED, _TP = True, tp_group
    try:
        yield
    finally:
        _TP_STATE_PATCHED, _TP = False, previous


def initialize_tensor_parallel_group(tensor_model_parallel_size: int = 1, backend: str | None = None,
                                     group_name_suffix: str = "") -> GroupCoordinator:
    """Upstream's: a further TP coordinator (consecutive ranks) for ``patch_tensor_parallel_group``; the global TP
    group is left as it is. Collective over the world."""
    groups = consecutive_groups("initialize_tensor_parallel_group", "tensor_model_parallel_size",
                                tensor_model_parallel_size, dist.get_world_size())
    return init_model_parallel_group(groups, get_world_group().local_rank, backend or dist.get_backend(), True,
                                     f"tp_{group_name_suffix}" if group_name_suffix else "tp")


def initialize_sequence_parallel(sp_size: int, *, timeout: datetime.timedelta | None = None) -> GroupCoordinator:
    """``sp_groups.initialize_sequence_parallel`` (the SP and DP groups, the agreed settings; collective over the
    world), then what the SP communicator's ``ulysses_a2a`` answers installed (``ulysses.registry.install``, as
    upstream's init builds its communicators' helpers)."""
    sp = _sp_groups.initialize_sequence_parallel(sp_size, timeout=timeout)
    _ulysses_registry.install()
    return sp


def initialize_sequence_parallel_group(sequence_model_parallel_size: int = 1, backend: str | None = None,
                                       group_name_suffix: str = "") -> GroupCoordinator:
    """Upstream's: a further SP coordinator (consecutive ranks); the global SP group, its settings and its Ulysses
    helper are left as they are (its ``all_to_all_4D`` is the NCCL route). Collective over the world."""
    groups = consecutive_groups("initialize_sequence_parallel_group", "sequence_model_parallel_size",
                                sequence_model_parallel_size, dist.get_world_size())
    return init_model_parallel_group(groups, get_world_group().local_rank, backend or dist.get_backend(),
                                     group_name=f"sp_{group_name_suffix}" if group_name_suffix else "sp")


def all_reduce(tensor: torch.Tensor, group_name: str) -> torch.Tensor:
    """Collective over the coordinator named ``group_name`` (its ``unique_name``): out-of-place all-reduce (SUM)."""
    group = _groups.get(group_name)
    if group is None:
        raise ValueError(f"all_reduce: no live group named {group_name!r}; known: {sorted(_groups)}.")
    return group.device_communicator.all_reduce(tensor)


def all_reduce_fake(tensor: torch.Tensor, group_name: str) -> torch.Tensor:
    """``all_reduce``'s shape function (for tracing): a new tensor like ``tensor``. Local."""
    return torch.empty_like(tensor)


def maybe_init_distributed_environment_and_model_parallel(tp_size: int, sp_size: int,
                                                          distributed_init_method: str = "env://") -> None:
    """Initialise everything from torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``): the default
    group (NCCL and ``torch.cuda.set_device(LOCAL_RANK)`` on GPUs, gloo on CPU), the world, SP, DP and TP groups.
    Collective over the world. Safe to call again: with the same sizes it returns at once; with others it raises
    ValueError (call ``cleanup_dist_env_and_memory()`` first to rebuild)."""
    if _WORLD is not None and _TP is not None and model_parallel_is_initialized():
        built = (_TP.world_size, get_sp_world_size())
        if built != (tp_size, sp_size):
            raise ValueError(f"maybe_init_distributed_environment_and_model_parallel: tp_size={tp_size}, "
                             f"sp_size={sp_size}, but the groups exist with tp_size={built[0]}, "
                             f"sp_size={built[1]}; call cleanup_dist_env_and_memory() first to rebuild them.")
        return
    init_distributed_environment(world_size=int(os.environ.get("WORLD_SIZE", "1")),
                                 rank=int(os.environ.get("RANK", "0")),
                                 distributed_init_method=distributed_init_method,
                                 local_rank=int(envs.LOCAL_RANK))
    initialize_model_parallel(tensor_model_parallel_size=tp_size, sequence_model_parallel_size=sp_size)


def destroy_model_parallel() -> None:
    """Tear down the SP and DP groups (their helpers first, collectively), the TP groups and the node group.
    Collective."""
    global _TP, _NODE
    try:
        destroy_sequence_parallel()
    finally:
        _destroy_groups(list(_TP_GROUPS))
        _TP_GROUPS.clear()
        _TP = None
        node, _NODE = _NODE, None
        if node is not None:
            node.destroy()


def destroy_distributed_environment() -> None:
    """Tear down the world group and then the default process group. Collective."""
    global _WORLD
    world, _WORLD = _WORLD, None
    if world is not None:  # its CPU group (the default group itself over gloo is left to destroy_process_group)
        world.destroy()
    if dist.is_initialized():
        dist.destroy_process_group()


def cleanup_dist_env_and_memory(shutdown_ray: bool = False) -> None:
    """Undo ``maybe_init_distributed_environment_and_model_parallel``, in order: the Ulysses helpers (collective),
    the SP, DP and TP groups, the world group, the default process group; then free cached memory. Collective over
    the world; safe to call when nothing is initialised, and twice. ``shutdown_ray`` shuts Ray down if it is
    installed (this package starts none)."""
    try:
        destroy_model_parallel()
    finally:
        destroy_distributed_environment()
    if shutdown_ray and _module_present("ray"):  # no Ray, no Ray runtime to shut down
        import ray

        ray.shutdown()
    gc.collect()  # FSDP modules sit in reference cycles: their parameters go only at a collection
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def state() -> dict[str, Any]:
    """What exists now (for tests and diagnostics): which groups, and how many TP process groups."""
    sp = model_parallel_is_initialized()  # the SP and DP groups are built and torn down together
    return {"world": _WORLD is not None, "node": _NODE is not None, "sp": sp, "dp": sp,
            "tp": _TP is not None, "tp_process_groups": len(_TP_GROUPS), "default_group": dist.is_initialized()}
