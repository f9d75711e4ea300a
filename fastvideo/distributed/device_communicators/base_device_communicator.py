"""The collectives of one process group, as upstream FastVideo's ``DeviceCommunicatorBase`` offers them.

Every ``GroupCoordinator`` (``parallel_state``) builds one on first use of ``device_communicator``:

* ``all_to_all_4D(x, scatter_dim=2, gather_dim=1)``: the NCCL route of the Ulysses all-to-all over this
  group's device group (``ulysses/nccl.py``; gloo on CPU), differentiable. It is the oracle upstream's tests
  call unbound, ``DeviceCommunicatorBase.all_to_all_4D(comm, x, 2, 1)``, and it never takes the fused
  route: models call ``communication_op.sequence_model_parallel_all_to_all_4D``, the one entry that votes,
  validates, compiles and takes the fused route under ``FASTVIDEO_ULYSSES_A2A=auto``.
* ``all_gather`` (backward: reduce-scatter, i.e. each rank gets the sum over ranks of its slice's gradient),
  ``slice`` (backward: all-gather, divided by the group size when ``scale_grad``), ``all_reduce`` (SUM is
  differentiable) and ``gather``, with upstream's semantics. ``all_gather`` is torch's functional
  collective, so it traces under ``torch.compile(fullgraph=True)``.
* ``ulysses_a2a``: the SP group's Ulysses helper, or None (``device_communicators/ulysses_a2a.py``).

This module sits below the Ulysses helper (``parallel_state`` imports it, and the helper imports
``parallel_state``): it reaches the helper only through the provider that ``ulysses_a2a.py`` registers
when it is imported (``fastvideo.distributed`` and ``communication_op`` import it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as _fc
from torch.distributed import ProcessGroup, ReduceOp

from fastvideo.distributed.ulysses.layout import mode_for_dims, validate_input
from fastvideo.distributed.ulysses.nccl import NcclAllToAll

# torch 2.13 renamed the differentiable all-gather (the GPU hosts run 2.11): one name for both. Its backward
# is a reduce-scatter (sum), as upstream's DistributedAutograd.AllGather.
_all_gather_autograd = getattr(_fc, "all_gather_single_autograd", None) or _fc.all_gather_tensor_autograd

_ULYSSES_PROVIDER: Callable[[DeviceCommunicatorBase], Any] | None = None


def register_ulysses_a2a_provider(provider: Callable[[DeviceCommunicatorBase], Any]) -> None:
    """Install what ``DeviceCommunicatorBase.ulysses_a2a`` returns (``ulysses_a2a.py`` does, when imported)."""
    global _ULYSSES_PROVIDER
    _ULYSSES_PROVIDER = provider


def _check_dim(x: torch.Tensor, dim: int, what: str) -> int:
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"{what}: dim={dim} is out of range for a tensor of shape {tuple(x.shape)}.")
    return dim % x.dim()


class _AllReduceSum(torch.autograd.Function):
    """Out-of-place SUM all-reduce; its gradient is the SUM all-reduce of the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, op=ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        grad = grad.clone()
        dist.all_reduce(grad, op=ReduceOp.SUM, group=ctx.group)
        return grad, None


class _Slice(torch.autograd.Function):
    """This rank's chunk of ``dim``; backward all-gathers every rank's chunk gradient (divided by the group size
    when ``scale_grad``: upstream's convention for a replicated input that every rank slices)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, rank: int, world_size: int, group: ProcessGroup,  # type: ignore[override]
                scale_grad: bool) -> torch.Tensor:
        ctx.dim, ctx.world_size, ctx.group, ctx.scale_grad = dim, world_size, group, scale_grad
        size = x.shape[dim] // world_size
        return x.narrow(dim, rank * size, size).contiguous()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        full = _all_gather_autograd(grad.contiguous(), ctx.dim, ctx.group)
        if ctx.scale_grad:
            full = full / ctx.world_size
        return full, None, None, None, None, None


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
        communicator, its size is > 1 and the agreed route is ``auto``; None otherwise. Collective the first
        time under ``auto``: it builds the op's helper, as the op's first call would."""
        if _ULYSSES_PROVIDER is None:
            raise RuntimeError(
                "device_communicator.ulysses_a2a: the Ulysses layer is not loaded. Import fastvideo.distributed "
                "(or fastvideo.distributed.communication_op) before using it; both load it."
            )
        return _ULYSSES_PROVIDER(self)

    def all_to_all_4D(self, input_: torch.Tensor, scatter_dim: int = 2, gather_dim: int = 1) -> torch.Tensor:
        """The Ulysses all-to-all's NCCL route over this group: ``(2, 1)`` ``[B, S/P, H, D] -> [B, S, H/P, D]``,
        ``(1, 2)`` the inverse. Collective; differentiable; group size 1 returns ``input_``. Raises ValueError,
        before any collective, for input no route can serve."""
        mode = mode_for_dims(scatter_dim, gather_dim)
        validate_input(input_, mode, self.world_size)
        if self.world_size == 1:
            return input_
        return NcclAllToAll.apply(input_, mode, self.device_group)

    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``input_`` concatenated along ``dim``, in group order. Collective; differentiable (the
        gradient is reduce-scattered: summed over ranks, each rank keeping its own slice)."""
        dim = _check_dim(input_, dim, "all_gather")
        if self.world_size == 1:
            return input_
        return _all_gather_autograd(input_.contiguous(), dim, self.device_group)

    def slice(self, input_: torch.Tensor, dim: int = -1, *, scale_grad: bool) -> torch.Tensor:
        """This rank's chunk of ``input_`` along ``dim`` (which must divide by the group size), contiguous.
        Local in the forward; collective in the backward (an all-gather of the gradients)."""
        dim = _check_dim(input_, dim, "slice")
        if input_.shape[dim] % self.world_size:
            raise ValueError(f"slice: dim {dim} has {input_.shape[dim]} rows, not divisible by the group size "
                             f"{self.world_size}; pad it first (sequence_model_parallel_shard does).")
        return _Slice.apply(input_, dim, self.rank_in_group, self.world_size, self.device_group, scale_grad)

    def all_reduce(self, input_: torch.Tensor, op: ReduceOp | None = ReduceOp.SUM) -> torch.Tensor:
        """Out-of-place all-reduce. Collective; differentiable for SUM (the default)."""
        op = ReduceOp.SUM if op is None else op
        if op == ReduceOp.SUM:
            return _AllReduceSum.apply(input_, self.device_group)
        if torch.is_grad_enabled() and input_.requires_grad:
            raise ValueError(f"all_reduce: op={op} has no gradient here; only SUM is differentiable (detach first).")
        out = input_.clone()
        dist.all_reduce(out, op=op, group=self.device_group)
        return out

    def gather(self, input_: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
        """Collective: every rank's ``input_`` joined along ``dim`` on the group's rank ``dst``, None elsewhere."""
        dim = _check_dim(input_, dim, "gather")
        if not 0 <= dst < self.world_size:
            raise ValueError(f"gather: dst={dst} must be a rank of the group (0..{self.world_size - 1}).")
        parts = [torch.empty_like(input_) for _ in range(self.world_size)] if self.rank_in_group == dst else None
        dist.gather(input_.contiguous(), parts, dst=self.ranks[dst], group=self.device_group)
        return torch.cat(parts, dim=dim) if parts is not None else None

    def destroy(self) -> None:
        """Nothing to release: the Ulysses helper is destroyed with its SP group (``destroy_sequence_parallel``)."""
