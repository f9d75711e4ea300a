"""The NCCL route: permute + ``all_to_all_single`` + permute over a process group (gloo on CPU).

Always available and the correctness oracle. A plain function below the helper (it imports only the
layouts): differentiability comes from the op above it, whose one autograd formula covers every route.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fastvideo.distributed.ulysses.layout import recv_layout, send_layout


def nccl_route(x: torch.Tensor, mode: int, group: dist.ProcessGroup) -> torch.Tensor:
    """The NCCL route without autograd. Collective over ``group``; ``x`` must already be validated."""
    send = send_layout(x, mode, dist.get_world_size(group))
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv_layout(recv, mode)
