"""What a helper did: one record per call, counters, the decline log, and its part of ``stats()``. Local; no
collective.

Gates and tests assert the plans that actually ran from ``CallRecord``s (``UlyssesHelper.history``), so a
parity check cannot pass with the fused route silently off.
"""

from __future__ import annotations

import logging
import statistics
from collections import Counter, deque
from typing import NamedTuple

from fastvideo.distributed.ulysses.contract import DeclineReason, Phase
from fastvideo.distributed.ulysses.policy import Plan

logger = logging.getLogger("fastvideo.distributed.ulysses.helper")

VOTE_SAMPLES = 4096  # vote durations kept for ``vote_seconds`` and the medians
_record = tuple.__new__


class CallRecord(NamedTuple):
    """What one call did. (A named tuple: one is built per call, and a frozen dataclass costs more to build.)"""

    seq: int
    phase: Phase
    mode: int
    route: str  # "fused" or "nccl"
    plan: Plan | None
    reason: DeclineReason | None
    chunks: int
    captured: bool = False  # the fused launch was captured into a CUDA graph (its replays are not recorded)
    tag: str | None = None  # the call site's tag, None for an untagged call


class CallStats:
    """Counters, history and decline log of one helper's calls since construction."""

    def __init__(self, history: int) -> None:
        self.fused = self.raised = self.captured = self.hot = 0
        self.declines: Counter[DeclineReason] = Counter()
        # Fused calls per proposal, keyed by its fields (a tuple of ints: one hash per call): [count, the proposal]
        # (its plan and geometry name the row in report()).
        self.plans: dict[tuple[int, ...], list] = {}
        self.vote_s: deque[float] = deque(maxlen=VOTE_SAMPLES)
        self.history: deque[CallRecord] = deque(maxlen=history)
        self._logged: set[DeclineReason] = {DeclineReason.DISABLED}  # decline reasons already logged (`off`: none)
        self.capture_detail = ""  # why the last capture on this rank could not freeze its plan (for the log)

    def logged(self, reason: DeclineReason | None) -> None:
        """``reason`` was logged already (construction logs its own decline): calls do not log it again."""
        if reason is not None:
            self._logged.add(reason)

    def ran(self, seq: int, phase: Phase, proposal, captured: bool, tag: str | None = None) -> None:
        """A fused call of ``proposal`` (``planner.Proposal``). Per call: two counters, one dict lookup, a record."""
        self.fused += 1
        if captured:
            self.captured += 1
        counted = self.plans.get(proposal.fields)
        if counted is None:
            counted = self.plans[proposal.fields] = [0, proposal]
        counted[0] += 1
        # tuple.__new__: a named tuple's own constructor is a Python function, twice the cost per call
        self.history.append(_record(CallRecord, (seq, phase, proposal.geom.mode, "fused", proposal.plan, None,
                                                 proposal.chunks, captured, tag)))

    def declined(self, seq: int, phase: Phase, mode: int, reason: DeclineReason, tag: str | None = None,
                 proposal=None) -> None:
        """A call every rank declined to the NCCL route; each reason is logged once per helper. ``proposal``: this
        rank's (``planner.Proposal``; None for a construction decline, logged at construction)."""
        self.declines[reason] += 1
        self.history.append(CallRecord(seq, phase, mode, "nccl", None, reason, 0, False, tag))
        why = proposal.why if proposal is not None else ""  # why a capture could not freeze its plan here
        if why:
            self.capture_detail = why
        if reason in self._logged:
            return
        self._logged.add(reason)
        geom = proposal.geom if proposal is not None else None
        logger.warning(
            "Ulysses fused all-to-all declined (%s) for a call of %s, mode %d; using the NCCL route. %s",
            reason.label, geom if geom is not None else "an unplanned geometry", mode,
            f"Under CUDA-graph capture the plan could not be frozen on some rank (here: {why or 'a peer could not'}); "
            "the NCCL route is captured." if reason is DeclineReason.CUDA_GRAPH_CAPTURE
            else "Run `python -m fastvideo.distributed.ulysses explain` for details.")

    def report(self) -> dict:
        """The per-call part of ``UlyssesHelper.stats()``."""
        votes = sorted(self.vote_s)
        return {
            "fused": self.fused,
            "captured": self.captured,  # fused launches captured into CUDA graphs (counted in "fused")
            "raised": self.raised,
            "declines": {r.label: n for r, n in sorted(self.declines.items())},
            "plans": dict(sum((Counter({p.plan.describe(p.geom): n}) for n, p in self.plans.values()), Counter())),
            "vote_us_median": statistics.median(votes) * 1e6 if votes else None,
            "vote_us_p90": votes[int(0.9 * (len(votes) - 1))] * 1e6 if votes else None,
            "hot_calls": self.hot,  # calls the hot lane made its library call for, whatever the library's stage
        }
