"""The NCCL route: permute + ``all_to_all_single`` + permute over a process group (gloo on CPU).

Always available and the correctness oracle. A plain function below the helper (it imports only the
layouts): differentiability comes from the op above it, whose one autograd formula covers every route.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from fastvideo.distributed.host_exchange import classify_failure, group_timeout_s
from fastvideo.distributed.ulysses.layout import recv_layout, send_layout


class CollectiveError(RuntimeError):
    """The NCCL route's collective failed on this rank (a synchronous backend, gloo on CPU): it timed out (a peer is
    stopped, stuck or not calling) or the connection to a peer closed (the peer is gone). ``kind``: ``timeout``,
    ``closed`` or ``failed``. On NCCL (CUDA) a failure surfaces through torch's NCCL watchdog instead."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


def nccl_route(x: torch.Tensor, mode: int, group: dist.ProcessGroup) -> torch.Tensor:
    """The NCCL route without autograd. Collective over ``group``; ``x`` must already be validated."""
    send = send_layout(x, mode, dist.get_world_size(group))
    recv = torch.empty_like(send)
    start = time.perf_counter()
    try:
        dist.all_to_all_single(recv, send, group=group)
    except RuntimeError as exc:
        raise _failure(group, exc, time.perf_counter() - start) from exc
    return recv_layout(recv, mode)


def _failure(group: dist.ProcessGroup, exc: RuntimeError, seconds: float) -> CollectiveError:
    ranks = dist.get_process_group_ranks(group)
    timeout = group_timeout_s(group)
    limit = f"{timeout:g} s" if timeout is not None else "its timeout"
    kind = classify_failure(exc)
    if kind == "timeout":
        what = (f"timed out after {seconds:.1f} s (the SP group's timeout, {limit}: the default process group's "
                "unless initialize_sequence_parallel was given one): a peer is stopped, stuck, or not calling the op")
    elif kind == "closed":
        what = f"failed after {seconds:.3f} s: the connection to a peer closed, so that peer's process is gone"
    else:
        what = f"failed after {seconds:.3f} s"
    return CollectiveError(f"Ulysses all-to-all (NCCL route) over SP ranks {ranks} {what} ({exc}).", kind)
