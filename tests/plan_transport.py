"""A CPU transport that executes the fused route's plans honestly over gloo: the simulation the CPU suite, the
benchmarks' CPU dry runs and the overlay's parity check drive the helper with (``fastvideo`` has no CPU transport).

It is honest about what the helper relies on:

* the same chunk order (``Plan.chunks``: planes, then S_local row ranges taken from every peer; with uneven split
  tables a peer whose share is shorter contributes fewer or no rows to a chunk),
* one bounded, reused receive window of the agreed capacity (a chunk that does not fit is a bug and raises),
* outputs own their storage: every call returns a fresh tensor, never a view of the window.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

from fastvideo.distributed.ulysses.policy import Geometry, Plan
from fastvideo.distributed.ulysses.transport import (
    ENTRY_CE,
    ENTRY_ORIGINAL,
    ENTRY_TUNED,
    ENTRY_UNEVEN,
    Capability,
    ConstructionContext,
    Step,
    TopologyReport,
    Transport,
    output_shape,
)


def chunk_blocks(x: torch.Tensor, out: torch.Tensor, geom: Geometry, rank: int, p0: int, p1: int, r0: int,
                 r1: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(sends, destinations) of one chunk on ``rank``, one view per peer, in rank order.

    A chunk is planes ``[p0, p1)`` and the row range ``[r0, r1)`` of every sequence share, clipped to the share
    (a shorter share contributes fewer rows, or none). ``sends[q]`` is what this rank sends peer ``q``: in mode 0
    its own rows in range, peer ``q``'s heads; in mode 1 peer ``q``'s rows in range, its own heads.
    ``dests[q]`` is where what peer ``q`` sends lands in ``out``.
    """
    seq, heads = geom.seq_table, geom.head_table
    seq_at = [0, *itertools.accumulate(seq)]
    head_at = [0, *itertools.accumulate(heads)]

    def rows(q: int) -> slice:  # the chunk's rows of rank q's sequence share, as offsets within that share
        return slice(min(r0, seq[q]), min(r1, seq[q]))

    def seq_rows(q: int) -> slice:  # the same rows, within the whole sequence
        return slice(seq_at[q] + rows(q).start, seq_at[q] + rows(q).stop)

    peers = range(geom.world_size)
    if geom.mode == 0:  # x [B, seq[rank], H, D] -> out [B, S_global, heads[rank], D]
        sends = [x[p0:p1, rows(rank), head_at[q]:head_at[q + 1]] for q in peers]
        dests = [out[p0:p1, seq_rows(q)] for q in peers]
    else:  # x [B, S_global, heads[rank], D] -> out [B, seq[rank], H, D]
        sends = [x[p0:p1, seq_rows(q)] for q in peers]
        dests = [out[p0:p1, rows(rank), head_at[q]:head_at[q + 1]] for q in peers]
    return sends, dests


class GlooPlanTransport(Transport):
    """CPU transport for tests and CPU-only runs: executes plans chunk by chunk over gloo.

    It is honest about the things the helper relies on: the chunk order and sizes of the plan, a
    receive window of exactly the agreed capacity reused across chunks and calls, and an output the
    caller owns. ``fail_steps`` and ``capability_override`` let fault-injection tests make one rank
    fail a step or lack a capability.
    """

    name = "gloo-plan"

    def __init__(
        self,
        *,
        fail_steps: tuple[str, ...] = (),
        capability_override: Capability | None = None,
        topology_override: TopologyReport | None = None,
    ) -> None:
        self._fail_steps = fail_steps
        self._capability_override = capability_override
        self._topology_override = topology_override
        self._ctx: ConstructionContext | None = None
        self._window: torch.Tensor | None = None
        self.executed: list[tuple[Plan, int]] = []  # (plan, chunks) of every execute, for tests

    def capability(self) -> Capability:
        if self._capability_override is not None:
            return self._capability_override
        return Capability(
            self.name,
            True,
            abi_version=1,
            entry_points=frozenset({ENTRY_ORIGINAL, ENTRY_TUNED, ENTRY_CE, ENTRY_UNEVEN}),
            dtypes=(torch.bfloat16, torch.float16, torch.float32),
            supports_unaligned=True,
        )

    def construction_steps(self, ctx: ConstructionContext) -> list[Step]:
        self._ctx = ctx

        def alloc() -> None:
            self._maybe_fail("alloc_window")
            self._window = torch.empty(ctx.window_bytes, dtype=torch.uint8, device=ctx.device)

        def connect() -> None:
            probe = torch.ones(ctx.world_size, dtype=torch.int64)
            dist.all_to_all_single(torch.empty_like(probe), probe, group=ctx.device_group)
            # Fail after the collective, as a real step that errors locally would: peers are not
            # left inside it, and the vote after this step reports the failure.
            self._maybe_fail("connect")

        return [Step("alloc_window", alloc), Step("connect", connect, collective=True)]

    def _maybe_fail(self, step: str) -> None:
        if step in self._fail_steps:
            raise RuntimeError(f"injected failure in construction step {step!r}")

    def topology(self) -> TopologyReport:
        return self._topology_override or TopologyReport()

    def execute(self, x: torch.Tensor, geom: Geometry, plan: Plan, *, capture: bool = False, vote=None,
                fields: tuple[int, ...] = (), seq: int = 0) -> torch.Tensor:
        assert self._ctx is not None and self._window is not None, "execute before construction"
        assert not capture and vote is None, "the CPU transport neither captures nor fuses the vote"
        rank, group = self._ctx.rank, self._ctx.device_group
        out = torch.empty(output_shape(geom, rank), dtype=x.dtype, device=x.device)
        need = plan.window_bytes(geom)
        if need > self._window.numel():
            raise RuntimeError(f"plan needs {need} window bytes, window has {self._window.numel()}: policy bug")
        n = 0
        for p0, p1, r0, r1 in plan.chunks(geom):
            sends, dests = chunk_blocks(x, out, geom, rank, p0, p1, r0, r1)
            send_sizes, recv_sizes = [t.numel() for t in sends], [t.numel() for t in dests]
            nbytes = sum(recv_sizes) * x.element_size()
            if nbytes > need:
                raise RuntimeError(f"chunk {n} receives {nbytes} bytes, the plan's window is {need}: policy bug")
            # The window receives the chunk (as the kernel's peers' stores would), then is copied out.
            recv = self._window[:nbytes].view(x.dtype)
            send = torch.cat([t.reshape(-1) for t in sends])
            dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=group)
            for dest, block in zip(dests, recv.split(recv_sizes), strict=True):
                dest.copy_(block.view(dest.shape))
            n += 1
        self.executed.append((plan, n))
        return out

    def abort(self) -> None:
        self._window = None

    def destroy(self) -> None:
        self._window = None
        self._ctx = None
