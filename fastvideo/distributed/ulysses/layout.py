"""Input validation and the block layouts of the Ulysses all-to-all: pure tensor code, no collective.

The one place that decides what input any route can serve (``validate_input``): the public op and
the helper both call it before any vote or collective, and both routes (the NCCL route in
``nccl.py``, the fused transports) rely on it. Mode 0 (``scatter_dim=2, gather_dim=1``) trades the
sequence shard for a head shard, ``[B, S/P, H, D] -> [B, S, H/P, D]``; mode 1 is its inverse.
"""

from __future__ import annotations

import torch

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


def validate_input(x: torch.Tensor, mode: int, world_size: int, *, allow_meta: bool = False) -> None:
    """Raise for input that no route can serve, a meta tensor included (checked before any collective; in
    checked mode the public op then votes the error so that every rank raises). ``allow_meta``: check a
    shape only (the CLI's ``explain`` validates a meta tensor of the shape it is given)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"sequence_model_parallel_all_to_all_4D: x must be a torch.Tensor, got {type(x).__name__}.")
    if mode not in (MODE_SEQ_GATHER, MODE_HEAD_GATHER):
        raise ValueError(
            f"sequence_model_parallel_all_to_all_4D: mode={mode!r} must be 0 (scatter heads, gather sequence) or 1 "
            "(the inverse)."
        )
    if x.dim() != 4:
        raise ValueError(
            f"sequence_model_parallel_all_to_all_4D: x must be 4-D [B, S, H, D], got shape {tuple(x.shape)}; "
            "reshape packed heads to [B, S, H, D] first."
        )
    if x.is_meta and not allow_meta:
        raise ValueError(
            "sequence_model_parallel_all_to_all_4D: x is a meta tensor (a shape without data). The all-to-all moves "
            "data between ranks, and returning a meta output here would leave the peers waiting in the collective. "
            "Pass real tensors; to trace shapes, use torch.compile or FakeTensorMode, where the op returns a fake "
            "output without any collective."
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


def send_layout(x: torch.Tensor, mode: int, world_size: int) -> torch.Tensor:
    """[P, B, S_local, H/P, D]: block p is what this rank sends to rank p."""
    b, s, h, d = x.shape
    p = world_size
    if mode == MODE_SEQ_GATHER:
        return x.reshape(b, s, p, h // p, d).permute(2, 0, 1, 3, 4).contiguous()
    return x.reshape(b, p, s // p, h, d).permute(1, 0, 2, 3, 4).contiguous()


def recv_layout(o: torch.Tensor, mode: int) -> torch.Tensor:
    """Inverse of the exchange's receive side: block p came from rank p."""
    p, b, s, h, d = o.shape
    if mode == MODE_SEQ_GATHER:
        return o.permute(1, 0, 2, 3, 4).reshape(b, p * s, h, d)
    return o.permute(1, 2, 0, 3, 4).reshape(b, s, p * h, d)


def output_shape(shape: torch.Size | tuple[int, ...], mode: int, world_size: int) -> tuple[int, int, int, int]:
    """The op's output shape for an input of ``shape``."""
    b, s, h, d = shape
    if mode == MODE_SEQ_GATHER:
        return (b, s * world_size, h // world_size, d)
    return (b, s // world_size, h * world_size, d)


def reference_all_to_all(inputs: list[torch.Tensor], mode: int) -> list[torch.Tensor]:
    """Every rank's NCCL-route output computed locally from every rank's input (no collective).

    The oracle for checks that simulate peers on one device: the exchange ``recv_r[p] = send_p[r]``
    is exactly what ``all_to_all_single`` does between the two permutes.
    """
    world_size = len(inputs)
    sends = [send_layout(x, mode, world_size) for x in inputs]
    return [recv_layout(torch.stack([sends[p][r] for p in range(world_size)]), mode) for r in range(world_size)]
