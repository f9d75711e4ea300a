"""The fused transport's interface, and a CPU transport that executes plans honestly over gloo.

The helper never talks to a kernel directly: it asks a ``Transport`` for its local capability,
runs its construction steps with a vote before each one, asks it for per-call eligibility, and
executes agreed plans through it. ``native.NativeTransport`` is the real one (the NCCL-device-API
kernel); ``GlooPlanTransport`` runs the same plans on CPU so the vote, plans, chunking, autograd,
declines and recovery are all exercised in CI:

* the same chunk order (``Plan.chunks``: planes, then S_local row ranges taken from every peer; with
  uneven split tables a peer whose share is shorter contributes fewer or no rows to a chunk),
* one bounded, reused receive window of the agreed capacity (a chunk that does not fit is a bug
  and raises),
* outputs own their storage: every call returns a fresh tensor, never a view of the window.
"""

from __future__ import annotations

import abc
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from fastvideo.distributed.ulysses.contract import DeclineReason
from fastvideo.distributed.ulysses.policy import Geometry, Plan

# What a transport can launch (``Capability.entry_points``, what the planner reads). The native transport's are
# the kernel build's offerings of these names (fastvideo_kernel.OFFERINGS, by the library's ABI).
ENTRY_ORIGINAL = "original"  # the 36-CTA whole-operand SM plan
ENTRY_TUNED = "tuned"  # SM plans of any CTA count and chunking
ENTRY_CE = "ce"  # the copy-engine plan kind
ENTRY_CAPTURE = "capture"  # SM plans captured into a CUDA graph
ENTRY_CE_CAPTURE = "ce_capture"  # copy-engine plans captured into a CUDA graph
# Plans of calls with uneven seq_splits / head_splits: the planner requires this offering for them. The native
# transport offers it where its build does (ABI 5 and later: the launches pass the split tables).
ENTRY_UNEVEN = "uneven"
ENTRIES = frozenset({ENTRY_ORIGINAL, ENTRY_TUNED, ENTRY_CE, ENTRY_CAPTURE, ENTRY_CE_CAPTURE, ENTRY_UNEVEN})


class VoteNotStarted(RuntimeError):
    """``Transport.execute(..., vote=...)`` failed before the exchange: this rank has not voted (its peers wait in
    the vote). The helper then votes this failure on the plain path, so that every rank raises together."""


@dataclass(frozen=True)
class Capability:
    """What this rank's transport can do, probed locally without any collective."""

    name: str
    present: bool
    abi_version: int = 0
    entry_points: frozenset[str] = frozenset()
    nccl_build: int = 0
    nccl_runtime: int = 0
    dtypes: tuple[torch.dtype, ...] = ()
    supports_unaligned: bool = False
    decline: DeclineReason | None = None  # a local reason this rank cannot take part at all
    detail: str = ""

    def agreement_key(self) -> tuple:
        """What every rank must have identically for the fused route to be constructed."""
        return (
            self.name,
            self.present,
            self.abi_version,
            tuple(sorted(self.entry_points)),
            self.nccl_build,
            self.nccl_runtime,
            tuple(str(d) for d in self.dtypes),
            self.supports_unaligned,
        )


@dataclass
class ConstructionContext:
    """What a transport's construction steps may use: this rank's place and a way to share bytes."""

    rank: int
    world_size: int
    device: torch.device
    window_bytes: int
    max_ctas: int
    device_group: dist.ProcessGroup
    all_gather_object: Callable[[object], list[object]]  # this rank's obj -> every rank's, by rank


@dataclass
class Step:
    """One construction step; ``collective`` steps are entered only after every rank voted success."""

    name: str
    run: Callable[[], None]
    collective: bool = False


@dataclass
class TopologyReport:
    decline: DeclineReason | None = None
    detail: str = ""
    extras: dict[str, object] = field(default_factory=dict)


class Transport(abc.ABC):
    """A fused all-to-all transport. One object per helper; owns its native resources."""

    name: str = "transport"

    @abc.abstractmethod
    def capability(self) -> Capability:
        """Local probe: library present, ABI, entry points, NCCL versions. No collective."""

    @abc.abstractmethod
    def construction_steps(self, ctx: ConstructionContext) -> list[Step]:
        """The ordered steps that build the window and communicator (the helper votes between them)."""

    def topology(self) -> TopologyReport:
        """Local check after construction: are all peers LSA-reachable over NVLink?"""
        return TopologyReport()

    def capture_decline(self, geom: Geometry, plan: Plan) -> str | None:
        """Why ``plan`` cannot be frozen into a CUDA graph being captured on this rank (None: it can, and
        ``execute(..., capture=True)`` captures it). A plan can be frozen when one call is device work alone:
        enqueued with no host work that a replay would need. By default a transport cannot (the CPU transport
        runs gloo collectives on the host per chunk)."""
        return f"the {self.name} transport does host work per call (it cannot be captured into a CUDA graph)"

    def fuses_vote(self, vote) -> bool:
        """Whether ``execute(..., vote=vote, fields=...)`` can run this call's exchange over ``vote`` (the
        helper's per-call vote channel) and the launch in one step. By default not: the helper votes, decides,
        then executes."""
        return False

    def hot_decline(self) -> str:
        """Local, never raises: why this transport keeps no hot signatures (``hot.py``: a signature's later eager
        calls in one native call), or "" where it can. By default it cannot."""
        return f"the {self.name} transport has no hot path"

    def hot_path(self, vote):
        """Local: this transport's hot-path table (``hot.HotPath``) for ``vote``, or None (by default)."""
        return None

    @abc.abstractmethod
    def execute(self, x: torch.Tensor, geom: Geometry, plan: Plan, *, capture: bool = False, vote=None,
                fields: tuple[int, ...] = (), seq: int = 0) -> torch.Tensor | None:
        """Run ``plan`` on ``x``: collective over the SP group; returns a fresh tensor the caller owns.

        * ``vote`` None: the plan every rank agreed; the output is returned. ``capture``: capture it into the
          CUDA graph the current stream is capturing (only after ``capture_decline`` returned None on every
          rank): no host state changes, nothing to watch.
        * ``vote`` given (only where ``fuses_vote(vote)``, never under capture): exchange ``fields`` (the
          proposal's, SEQ 0) with SEQ = ``seq`` over it and launch ``plan`` only where every rank proposed this
          same call, the one verdict that runs a plan.
          Returns None when it did not launch (``vote.rows`` holds the gathered votes for the helper's
          verdict). Raises ``VoteNotStarted`` for a failure before the exchange (this rank has not voted),
          the vote's own error (``vote.failure``) when the exchange failed, anything else for a launch that
          failed after every rank agreed to run it.

        Host-blocking only for the vote; the launch is enqueued on the current stream."""

    def completion_marker(self):
        """A handle whose ``query()`` says whether the last ``execute``'s device work has completed (the
        native transport: a CUDA event), or None when ``execute`` returns with its work done (the CPU
        transport). The helper's watchdog tracks it; it must never synchronise."""
        return None

    def watchdog_thread_setup(self) -> None:
        """Run once in the helper's watchdog thread before it polls ``completion_marker`` (the native
        transport relaxes that thread's CUDA stream-capture mode)."""

    def abort(self) -> None:
        """Release local resources after a failed construction (no collective)."""

    @abc.abstractmethod
    def destroy(self) -> None:
        """Release everything. Collective; called once by the helper."""


def output_shape(geom: Geometry, rank: int = 0) -> tuple[int, int, int, int]:
    """``rank``'s output shape for ``geom`` (the rank matters only for uneven split tables)."""
    if geom.mode == 0:
        return (geom.B, geom.S_global, geom.head_table[rank], geom.D)
    return (geom.B, geom.seq_table[rank], geom.H, geom.D)


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
