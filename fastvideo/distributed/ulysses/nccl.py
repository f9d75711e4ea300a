"""The NCCL route: pack + ``all_to_all_single`` + unpack over a process group (gloo on CPU).

Always available and the correctness oracle. A plain function below the helper (it imports only the
layouts): differentiability comes from the op above it, whose one autograd formula covers every route.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from fastvideo.distributed.host_exchange import classify_failure, group_timeout_s
from fastvideo.distributed.ulysses.layout import EVEN, Splits, block_shapes, recv_layout, send_layout


class CollectiveError(RuntimeError):
    """The NCCL route's collective failed on this rank (a synchronous backend, gloo on CPU): it timed out (a peer is
    stopped, stuck or not calling) or a peer closed the connection (it raised or exited). ``kind``: ``timeout``,
    ``closed`` or ``failed``. On NCCL (CUDA) a failure surfaces through torch's NCCL watchdog instead."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


def _split_sizes(shapes: list[tuple[int, ...]], itemsize: int) -> tuple[int, list[int] | None]:
    """(total bytes, per-rank split sizes in bytes, or None when they are equal: ``all_to_all_single``'s even
    split, which NCCL may serve with its own all-to-all)."""
    sizes = [math.prod(shape) * itemsize for shape in shapes]
    return sum(sizes), (None if all(n == sizes[0] for n in sizes) else sizes)


def nccl_route(x: torch.Tensor, mode: int, group: dist.ProcessGroup, *, splits: Splits = EVEN) -> torch.Tensor:
    """The NCCL route without autograd: collective over ``group``; blocks the host only as ``all_to_all_single``
    does; capture-safe on NCCL. ``x`` and ``splits`` must be what ``validate_input`` accepted.

    The exchange moves bytes, so every dtype goes (NCCL and gloo have no int16, and NCCL no complex types)."""
    world_size, rank = group.size(), group.rank()  # the group's own: dist.get_rank(group) walks c10d's maps
    sent, received = block_shapes(x.shape, mode, world_size, rank, splits)
    total, recv_sizes = _split_sizes(received, x.element_size())
    _, send_sizes = _split_sizes(sent, x.element_size())
    recv = torch.empty(total, dtype=torch.uint8, device=x.device)
    send = send_layout(x, mode, world_size, splits=splits).view(torch.uint8)
    start = time.perf_counter()
    try:
        dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=group)
    except RuntimeError as exc:
        raise _failure(group, exc, time.perf_counter() - start) from exc
    return recv_layout(recv.view(x.dtype), mode, received)


def nccl_route_start(x: torch.Tensor, mode: int, group: dist.ProcessGroup, *,
                     splits: Splits = EVEN, own_input: bool = False) -> Callable[[], torch.Tensor]:
    """The NCCL route issued without waiting: collective over ``group``; does not block the host; not for CUDA-graph
    capture (the async route runs ``nccl_route`` on its communication stream there). Returns ``finish()``, which
    waits for the backend's work and lays the output out (call it once; ``x`` may be reused once it returned).

    On gloo (CPU) the exchange then runs in the backend's own threads: the CPU form of an exchange in flight.
    The backend reads the send buffer until ``finish()``; where that is a view of ``x`` (no pack copy was needed),
    ``own_input`` copies it first, so ``x`` may be reused as soon as this returns (a compiled caller's buffers)."""
    world_size, rank = group.size(), group.rank()
    sent, received = block_shapes(x.shape, mode, world_size, rank, splits)
    total, recv_sizes = _split_sizes(received, x.element_size())
    _, send_sizes = _split_sizes(sent, x.element_size())
    recv = torch.empty(total, dtype=torch.uint8, device=x.device)
    send = send_layout(x, mode, world_size, splits=splits).view(torch.uint8)
    if own_input and send.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
        send = send.clone()
    start = time.perf_counter()
    try:
        work = dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=group, async_op=True)
    except RuntimeError as exc:
        raise _failure(group, exc, time.perf_counter() - start) from exc

    def finish(send: torch.Tensor = send) -> torch.Tensor:  # ``send`` held: the backend reads it until done
        try:
            work.wait()
        except RuntimeError as exc:
            raise _failure(group, exc, time.perf_counter() - start) from exc
        return recv_layout(recv.view(x.dtype), mode, received)

    return finish


def _failure(group: dist.ProcessGroup, exc: RuntimeError, seconds: float) -> CollectiveError:
    ranks = dist.get_process_group_ranks(group)
    timeout = group_timeout_s(group)
    limit = f"{timeout:g} s" if timeout is not None else "its timeout"
    kind = classify_failure(exc)
    if kind == "timeout":
        what = (f"timed out after {seconds:.1f} s (the SP group's timeout, {limit}: the default process group's "
                "unless initialize_sequence_parallel was given one): a peer is stopped, stuck, or not calling the op")
    elif kind == "closed":
        # A peer that raised closes its groups too, alive: the closed connection alone does not say it exited.
        what = f"failed after {seconds:.3f} s: the peer closed the connection (it raised or exited)"
    else:
        what = f"failed after {seconds:.3f} s"
    return CollectiveError(f"Ulysses all-to-all (NCCL route) over SP ranks {ranks} {what} ({exc}).", kind)
