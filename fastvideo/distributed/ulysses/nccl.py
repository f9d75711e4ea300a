"""The NCCL route: pack + ``all_to_all_single`` + unpack over a process group (gloo on CPU).

Always available and the correctness oracle. A plain function below the helper (it imports only the
layouts): differentiability comes from the op above it, whose one autograd formula covers every route.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from fastvideo.distributed.ulysses.layout import EVEN, Splits, block_shapes, recv_layout, send_layout


def _split_sizes(shapes: list[tuple[int, ...]]) -> tuple[int, list[int] | None]:
    """(total elements, per-rank split sizes or None when they are equal: ``all_to_all_single``'s even split)."""
    sizes = [math.prod(shape) for shape in shapes]
    return sum(sizes), (None if all(n == sizes[0] for n in sizes) else sizes)


def nccl_route(x: torch.Tensor, mode: int, group: dist.ProcessGroup, *, splits: Splits = EVEN) -> torch.Tensor:
    """The NCCL route without autograd: collective over ``group``; blocks the host only as ``all_to_all_single``
    does; capture-safe on NCCL. ``x`` and ``splits`` must be what ``validate_input`` accepted."""
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    sent, received = block_shapes(x.shape, mode, world_size, rank, splits)
    total, recv_sizes = _split_sizes(received)
    _, send_sizes = _split_sizes(sent)
    recv = x.new_empty(total)
    dist.all_to_all_single(recv, send_layout(x, mode, world_size, splits=splits), recv_sizes, send_sizes,
                           group=group)
    return recv_layout(recv, mode, received)
