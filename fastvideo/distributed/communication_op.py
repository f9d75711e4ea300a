"""The public Ulysses all-to-all and its NCCL route.

``sequence_model_parallel_all_to_all_4D`` is what models call. Mode 0 (``scatter_dim=2,
gather_dim=1``) trades the sequence shard for a head shard, ``[B, S/P, H, D] -> [B, S, H/P, D]``;
mode 1 (``scatter_dim=1, gather_dim=2``) is its inverse. Both are differentiable: the backward of
one is the other.

Routes: ``FASTVIDEO_ULYSSES_A2A=off`` (default) always takes the NCCL route (permute +
``all_to_all_single`` + permute over the SP device group; over gloo on CPU), with no vote. ``auto``
asks the Ulysses helper, which votes collectively on every call and runs the fused transport where
every rank agrees it can, the NCCL route otherwise. The NCCL route is the correctness oracle.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fastvideo import envs

MODE_SEQ_GATHER = 0  # scatter heads (dim 2), gather sequence (dim 1)
MODE_HEAD_GATHER = 1  # scatter sequence (dim 1), gather heads (dim 2)
_MODES = {(2, 1): MODE_SEQ_GATHER, (1, 2): MODE_HEAD_GATHER}


def mode_for_dims(scatter_dim: int, gather_dim: int) -> int:
    """Map a (scatter_dim, gather_dim) pair to its mode, or raise a ValueError naming the fix."""
    try:
        return _MODES[(scatter_dim, gather_dim)]
    except KeyError:
        raise ValueError(
            f"sequence_model_parallel_all_to_all_4D: (scatter_dim, gather_dim)=({scatter_dim}, {gather_dim}) is not "
            "supported; use (2, 1) before attention ([B, S/P, H, D] -> [B, S, H/P, D]) or (1, 2) after it."
        ) from None


def validate_input(x: torch.Tensor, mode: int, world_size: int) -> None:
    """Raise a ValueError for input that no route can serve (checked before any vote or collective)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"sequence_model_parallel_all_to_all_4D: x must be a torch.Tensor, got {type(x).__name__}.")
    if x.dim() != 4:
        raise ValueError(
            f"sequence_model_parallel_all_to_all_4D: x must be 4-D [B, S, H, D], got shape {tuple(x.shape)}; "
            "reshape packed heads to [B, S, H, D] first."
        )
    if torch._C._functorch.is_batchedtensor(x):
        raise RuntimeError(
            "sequence_model_parallel_all_to_all_4D does not support torch.func.vmap: it would run one collective "
            "per batch element and ranks that disagree on the batch size hang. Fold the batch into dim 0 instead."
        )
    dim, what = (2, "heads (dim 2)") if mode == MODE_SEQ_GATHER else (1, "sequence (dim 1)")
    if x.shape[dim] % world_size:
        raise ValueError(
            f"sequence_model_parallel_all_to_all_4D: {what} = {x.shape[dim]} is not divisible by the SP size "
            f"{world_size}; pad it to a multiple of {world_size} or choose an SP size that divides it."
        )


def _send_layout(x: torch.Tensor, mode: int, world_size: int) -> torch.Tensor:
    """[P, B, S_local, H/P, D]: block p is what this rank sends to rank p."""
    b, s, h, d = x.shape
    p = world_size
    if mode == MODE_SEQ_GATHER:
        return x.reshape(b, s, p, h // p, d).permute(2, 0, 1, 3, 4).contiguous()
    return x.reshape(b, p, s // p, h, d).permute(1, 0, 2, 3, 4).contiguous()


def _recv_layout(o: torch.Tensor, mode: int) -> torch.Tensor:
    """Inverse of the exchange's receive side: block p came from rank p."""
    p, b, s, h, d = o.shape
    if mode == MODE_SEQ_GATHER:
        return o.permute(1, 0, 2, 3, 4).reshape(b, p * s, h, d)
    return o.permute(1, 2, 0, 3, 4).reshape(b, s, p * h, d)


def output_shape(shape: torch.Size | tuple[int, ...], mode: int, world_size: int) -> tuple[int, int, int, int]:
    b, s, h, d = shape
    if mode == MODE_SEQ_GATHER:
        return (b, s * world_size, h // world_size, d)
    return (b, s // world_size, h * world_size, d)


def nccl_route(x: torch.Tensor, mode: int, group: dist.ProcessGroup) -> torch.Tensor:
    """The NCCL route without autograd: permute + ``all_to_all_single`` + permute. Collective over ``group``."""
    world_size = dist.get_world_size(group)
    send = _send_layout(x, mode, world_size)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return _recv_layout(recv, mode)


def reference_all_to_all(inputs: list[torch.Tensor], mode: int) -> list[torch.Tensor]:
    """Every rank's NCCL-route output computed locally from every rank's input (no collective).

    The oracle for checks that simulate peers on one device: the exchange ``recv_r[p] = send_p[r]``
    is exactly what ``all_to_all_single`` does between the two permutes.
    """
    world_size = len(inputs)
    sends = [_send_layout(x, mode, world_size) for x in inputs]
    return [_recv_layout(torch.stack([sends[p][r] for p in range(world_size)]), mode) for r in range(world_size)]


class _NcclAllToAll(torch.autograd.Function):
    """Differentiable NCCL route; the backward is the inverse all-to-all."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, mode: int, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.mode, ctx.group = mode, group
        return nccl_route(x, mode, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return nccl_route(grad.contiguous(), 1 - ctx.mode, ctx.group), None, None


def sequence_model_parallel_all_to_all_4D(x: torch.Tensor, scatter_dim: int = 2, gather_dim: int = 1) -> torch.Tensor:
    """Ulysses all-to-all over the SP group. Collective, blocking on the host only under ``auto`` (the vote).

    ``(2, 1)``: ``[B, S/P, H, D] -> [B, S, H/P, D]``; ``(1, 2)``: the inverse. Differentiable.
    SP size 1 returns ``x`` itself. Raises ValueError for input no route can serve (not 4-D, another
    dim pair, heads or sequence not divisible by the SP size) before any collective.
    """
    from fastvideo.distributed.parallel_state import get_sp_group

    sp = get_sp_group()
    mode = mode_for_dims(scatter_dim, gather_dim)
    validate_input(x, mode, sp.world_size)
    if sp.world_size == 1:
        return x
    if envs.get("FASTVIDEO_ULYSSES_A2A") == "off":
        return _NcclAllToAll.apply(x, mode, sp.device_group)
    from fastvideo.distributed.ulysses.helper import get_default_helper

    return get_default_helper().all_to_all(x, mode)
