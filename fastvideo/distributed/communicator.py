"""The collectives of one process group, as upstream FastVideo's ``DeviceCommunicatorBase`` offers them
(``device_communicators/base_device_communicator.py`` re-exports it at upstream's path).

Every ``GroupCoordinator`` (``sp_groups``) builds one on first use of ``device_communicator``:

* ``all_to_all_4D(x, scatter_dim=2, gather_dim=1)``: the Ulysses all-to-all's NCCL route over this group's device
  group (``all_to_all.nccl_route``, gloo on CPU), differentiable. It is the oracle upstream's tests call unbound,
  ``DeviceCommunicatorBase.all_to_all_4D(comm, x, 2, 1)``, and it never takes the fused route: models call
  ``communication_op.sequence_model_parallel_all_to_all_4D``, the one entry that votes and takes the fused route
  under ``FASTVIDEO_ULYSSES_A2A=auto``.
* ``all_gather`` (backward: reduce-scatter, i.e. each rank gets the sum over ranks of its slice's gradient),
  ``slice`` (backward: all-gather, divided by the group size when ``scale_grad``), ``all_reduce`` (SUM is
  differentiable) and ``gather``, with upstream's semantics. ``all_gather`` is torch's functional
  collective, so it traces under ``torch.compile(fullgraph=True)``.
* ``ulysses_a2a``: the SP group's Ulysses helper, or None. This module sits below the helper, so it cannot build
  one: what ``ulysses_a2a`` returns is installed explicitly (``register_ulysses_a2a_provider``) by the layer that
  owns the helpers (``ulysses/registry.py``), at upstream's init entry points and at the op's first call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as _fc
from torch.distributed import ProcessGroup, ReduceOp

from fastvideo.distributed import utils as _utils
from fastvideo.distributed.all_to_all import (
    check_dim,
    mode_for_dims,
    nccl_route,
    shares,
    validate_input,
)

# The gradients here are torch's: its differentiable functional collectives (torch 2.13 renamed two of them; the
# GPU hosts run 2.11). The all-gather's backward is a reduce-scatter (sum), the reduce-scatter's an all-gather,
# the all-to-all's the inverse all-to-all: upstream's DistributedAutograd formulas, without a Function of ours
# (the Ulysses op's is the package's one autograd formula). They serve grad-tracked input only: before 2.13 the
# ``_c10d_functional_autograd`` ops have an Autograd kernel and no backend one, so a tensor made under
# ``torch.inference_mode`` (no autograd dispatch key) finds no kernel; untracked input takes the plain ops.
_all_gather_autograd = getattr(_fc, "all_gather_single_autograd", None) or _fc.all_gather_tensor_autograd
_reduce_scatter_autograd = getattr(_fc, "reduce_scatter_single_autograd", None) or _fc.reduce_scatter_tensor_autograd
_all_gather = getattr(_fc, "all_gather_single", None) or _fc.all_gather_tensor  # 2.13 deprecates the latter

_ULYSSES_PROVIDER: Callable[[DeviceCommunicatorBase], Any] | None = None


def register_ulysses_a2a_provider(provider: Callable[[DeviceCommunicatorBase], Any]) -> None:
    """Install what ``DeviceCommunicatorBase.ulysses_a2a`` returns (``ulysses/registry.py`` does). Local,
    idempotent: the last provider installed answers."""
    global _ULYSSES_PROVIDER
    _ULYSSES_PROVIDER = provider


def group_peer(caller: str, arg: str, rank: object, ranks: Sequence[int], me: int | None = None, step: int = 0) -> int:
    """The global rank of group rank ``rank`` in a group over ``ranks``, which must be another rank than ``me``
    (this rank's rank in the group) where that is given: a peer of a point-to-point transfer. A ValueError naming
    ``caller`` and ``arg`` otherwise, before any communication. ``rank`` None with a ``step``: the rank ``step``
    ranks on from ``me`` (a transfer's default neighbour)."""
    rank = (me + step) % len(ranks) if rank is None and step else rank
    if not isinstance(rank, int) or not 0 <= rank < len(ranks):
        raise ValueError(f"{caller}: {arg}={rank!r} must be a rank of the group (0..{len(ranks) - 1}): "
                         "ranks here are ranks in the group, not global ranks.")
    if rank == me:
        raise ValueError(f"{caller}: {arg}={rank} is this rank; pass another rank of the group.")
    return ranks[rank]


def _grad_tracked(x: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and x.requires_grad


class DeviceCommunicatorBase:
    """Collectives over one group: ``device_group`` carries data (NCCL on CUDA, gloo on CPU), ``cpu_group``
    (gloo) host-side coordination. Every method is collective over the group and, on CUDA, enqueues on the
    current stream without blocking the host (``gather``: on the destination rank only, the others return None)."""

    def __init__(self, cpu_group: ProcessGroup, device: torch.device | None = None,
                 device_group: ProcessGroup | None = None, unique_name: str = "") -> None:
        self.device = device or torch.device("cpu")
        self.cpu_group = cpu_group
        self.device_group = device_group if device_group is not None else cpu_group
        self.unique_name = unique_name
        self.rank = dist.get_rank(cpu_group)
        self.world_size = dist.get_world_size(cpu_group)
        self.ranks = dist.get_process_group_ranks(cpu_group)
        self.global_rank = dist.get_rank()
        self.global_world_size = dist.get_world_size()
        self.rank_in_group = self.rank

    @property
    def ulysses_a2a(self) -> Any:
        """The SP group's Ulysses helper (with ``try_all_to_all_4D`` and ``close``) when this is the SP group's
        communicator, its size is > 1 and the agreed route is ``auto``; None otherwise, and None before the layer
        that owns the helpers installed its provider (upstream's init entry points and the op's first call do).
        Collective the first time under ``auto``: it builds the op's helper, as the op's first call would. A value
        assigned to it (upstream's communicators assign ``maybe_create_helper(...)``'s) is what it is from then
        on."""
        if "_ulysses_a2a" in self.__dict__:
            return self.__dict__["_ulysses_a2a"]
        return None if _ULYSSES_PROVIDER is None else _ULYSSES_PROVIDER(self)

    @ulysses_a2a.setter
    def ulysses_a2a(self, helper: Any) -> None:
        self.__dict__["_ulysses_a2a"] = helper

    def all_to_all_4D(self, input_: torch.Tensor, scatter_dim: int = 2, gather_dim: int = 1, *,
                      seq_splits: Sequence[int] | None = None,
                      head_splits: Sequence[int] | None = None, tag: str | None = None) -> torch.Tensor:
        """The Ulysses all-to-all's NCCL route over this group: ``(2, 1)`` ``[B, S/P, H, D] -> [B, S, H/P, D]``,
        ``(1, 2)`` the inverse; ``seq_splits`` / ``head_splits`` as the public op's. Collective; differentiable
        (torch's ``all_to_all_single`` formula: the gradient is the inverse exchange); group size 1 returns
        ``input_``. Raises ValueError, before any collective, for input no route can serve. ``tag``: the public
        op's, checked (a non-empty str or None) and otherwise unused: this route never votes, so nothing compares
        it across ranks (the public op's checked mode does)."""
        mode = mode_for_dims(scatter_dim, gather_dim)
        splits = validate_input(input_, mode, self.world_size, self.rank_in_group, seq_splits, head_splits,
                                tag=tag)
        if self.world_size == 1:
            return input_
        return nccl_route(input_, mode, self.device_group, splits=splits)

    def all_gather(self, input_: torch.Tensor, dim: int = -1, *, splits: Sequence[int] | None = None) -> torch.Tensor:
        """Every rank's ``input_`` concatenated along ``dim``, in group order. Collective; differentiable (the
        gradient is reduce-scattered: summed over ranks, each rank keeping its own slice).

        ``splits`` (this package's, keyword-only; the same on every rank): every rank's rows along ``dim``, where
        they differ (``sequence_model_parallel_shard(..., seq_splits=)``'s shards, a head share); None: all alike.
        Uneven shares travel padded to the largest and are cut back to their own rows, so the result is exact."""
        # Checked before the size-1 return, so that a group of one refuses a bad dim or table alike.
        table = shares("all_gather", "splits", splits, self.world_size)
        dim = check_dim("all_gather", input_, dim)
        if table is not None and table[self.rank_in_group] != input_.shape[dim]:  # not this rank's own share
            raise ValueError(f"all_gather: splits[{self.rank_in_group}] = {table[self.rank_in_group]} but this rank's "
                             f"input has {input_.shape[dim]} rows along dim {dim}; pass every rank's own row count, "
                             "the same table on every rank.")
        if self.world_size == 1:
            return input_
        gather = _all_gather_autograd if _grad_tracked(input_) else _all_gather
        if table is None or len(set(table)) == 1:
            return gather(input_.contiguous(), dim, self.device_group)
        largest = max(table)
        padded = _utils.pad_sequence_tensor(input_, largest, seq_dim=dim)
        gathered = gather(padded.contiguous(), dim, self.device_group)
        return torch.cat([gathered.narrow(dim, r * largest, rows) for r, rows in enumerate(table)], dim=dim)

    def slice(self, input_: torch.Tensor, dim: int = -1, *, scale_grad: bool,
              splits: Sequence[int] | None = None) -> torch.Tensor:
        """This rank's chunk of ``input_`` along ``dim``, contiguous: an equal one (the dim must divide by the
        group size), or with ``splits`` (keyword-only, the same on every rank, summing to the dim) rows
        ``sum(splits[:rank])`` up to that plus ``splits[rank]``.

        Local in the forward. The backward is collective: ``input_``'s gradient is every rank's chunk gradient
        all-gathered (divided by the group size when ``scale_grad``), upstream's formula for an input that every
        rank holds whole. A gradient hook on a private alias of ``input_`` applies it, so gradients that reach
        ``input_`` from its other uses are left as they are."""
        dim = check_dim("slice", input_, dim)
        table = shares("slice", "splits", splits, self.world_size, input_.shape[dim])
        if table is None:
            if input_.shape[dim] % self.world_size:
                raise ValueError(f"slice: dim {dim} has {input_.shape[dim]} rows, not divisible by the group size "
                                 f"{self.world_size}; pad it first (sequence_model_parallel_shard does), or pass "
                                 "splits (every rank's rows).")
            table = (input_.shape[dim] // self.world_size,) * self.world_size
        start, rows = sum(table[:self.rank_in_group]), table[self.rank_in_group]
        scale = self.world_size if scale_grad else 1

        def gathered(grad: torch.Tensor) -> torch.Tensor:
            full = self.all_gather(grad.narrow(dim, start, rows).contiguous(), dim, splits=table)
            return full / scale if scale != 1 else full

        if _grad_tracked(input_):
            input_ = input_.view_as(input_)  # the private alias that carries the hook
            input_.register_hook(gathered)
        return input_.narrow(dim, start, rows).contiguous()

    def all_reduce(self, input_: torch.Tensor, op: ReduceOp | None = ReduceOp.SUM) -> torch.Tensor:
        """Out-of-place all-reduce. Collective; differentiable for SUM (the default), whose gradient is the
        all-reduced gradient (here a reduce-scatter and an all-gather, torch's differentiable pair)."""
        op = ReduceOp.SUM if op is None else op
        if op == ReduceOp.SUM and _grad_tracked(input_):
            padded, _ = _utils.compute_padding_for_sp(input_.numel(), self.world_size)
            flat = _utils.pad_sequence_tensor(input_.reshape(-1), padded, seq_dim=0)
            summed = _all_gather_autograd(_reduce_scatter_autograd(flat, "sum", 0, self.device_group), 0,
                                          self.device_group)
            return summed[: input_.numel()].view_as(input_)
        if _grad_tracked(input_):
            raise ValueError(f"all_reduce: op={op} has no gradient here; only SUM is differentiable (detach first).")
        out = input_.clone()
        dist.all_reduce(out, op=op, group=self.device_group)
        return out

    def gather(self, input_: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
        """Collective: every rank's ``input_`` joined along ``dim`` on the group's rank ``dst``, None elsewhere."""
        dim = check_dim("gather", input_, dim)
        root = group_peer("gather", "dst", dst, self.ranks)
        parts = [torch.empty_like(input_) for _ in range(self.world_size)] if self.rank_in_group == dst else None
        dist.gather(input_.contiguous(), parts, dst=root, group=self.device_group)
        return torch.cat(parts, dim=dim) if parts is not None else None

    def send(self, tensor: torch.Tensor, dst: int | None = None) -> None:
        """Point to point over the device group, blocking: ``tensor`` to group rank ``dst`` (default: the next
        rank)."""
        peer = group_peer("send", "dst", dst, self.ranks, self.rank_in_group, 1)
        dist.send(tensor.contiguous(), peer, self.device_group)

    def recv(self, size: torch.Size, dtype: torch.dtype, src: int | None = None) -> torch.Tensor:
        """Point to point over the device group, blocking: a new ``size`` x ``dtype`` tensor on this communicator's
        device, from group rank ``src`` (default: the previous rank)."""
        peer = group_peer("recv", "src", src, self.ranks, self.rank_in_group, -1)
        tensor = torch.empty(size, dtype=dtype, device=self.device)
        dist.recv(tensor, peer, self.device_group)
        return tensor

    def destroy(self) -> None:
        """Nothing to release: the Ulysses helper is destroyed with its SP group (``destroy_sequence_parallel``)."""


class DistributedAutograd:
    """Upstream's differentiable collectives, called as ``DistributedAutograd.AllGather.apply(group, x, P, dim)``.

    Each ``apply`` is torch's differentiable functional collective (or this package's NCCL route for the
    all-to-all), with upstream's argument order and gradients: all-reduce (gradient: the all-reduced gradient),
    all-gather (reduce-scatter), slice (all-gather, divided by P when ``scale_grad``), all-to-all (the inverse
    all-to-all). Collective over ``group``."""

    class AllReduce:
        @staticmethod
        def apply(group: ProcessGroup, input_: torch.Tensor, op: ReduceOp | None = None) -> torch.Tensor:
            return _on(group).all_reduce(input_, op)

    class AllGather:
        @staticmethod
        def apply(group: ProcessGroup, input_: torch.Tensor, world_size: int, dim: int) -> torch.Tensor:
            return _on(group, world_size).all_gather(input_, dim)

    class Slice:
        @staticmethod
        def apply(group: ProcessGroup, input_: torch.Tensor, world_size: int, dim: int,
                  scale_grad: bool) -> torch.Tensor:
            return _on(group, world_size).slice(input_, dim, scale_grad=scale_grad)

    class AllToAll4D:
        @staticmethod
        def apply(group: ProcessGroup, input_: torch.Tensor, world_size: int, scatter_dim: int,
                  gather_dim: int) -> torch.Tensor:
            return _on(group, world_size).all_to_all_4D(input_, scatter_dim, gather_dim)


def _on(group: ProcessGroup, world_size: int | None = None) -> DeviceCommunicatorBase:
    """A communicator over ``group`` (local: creates no process group), checked against upstream's ``world_size``."""
    comm = DeviceCommunicatorBase(group, device_group=group)
    if world_size is not None and world_size != comm.world_size:
        raise ValueError(f"DistributedAutograd: world_size={world_size} but the group has {comm.world_size} ranks.")
    return comm
