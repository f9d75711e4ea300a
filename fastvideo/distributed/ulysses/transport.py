"""The fused transport's interface.

The helper never talks to a kernel directly: it asks a ``Transport`` for its local capability, runs its
construction steps with a vote before each one, asks it for per-call eligibility, and executes agreed plans
through it. ``native.NativeTransport`` is the real one (the NCCL-device-API kernel); the CPU plan transport that
runs the same plans over gloo, so that CI exercises the vote, plans, chunking, autograd, declines and recovery,
is a simulation and lives with the tests (``tests/plan_transport.py``).
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass, fields

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
        """What every rank must have identically for the fused route to be constructed: every field but the local
        decline and its detail."""
        return tuple(getattr(self, f.name) for f in fields(self) if f.name not in ("decline", "detail"))


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
