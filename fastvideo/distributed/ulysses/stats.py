"""What a helper did: one record per call, counters, and the ``stats()`` report. Local; no collective.

Gates and tests assert the plans that actually ran from ``CallRecord``s (``UlyssesHelper.history``), so a
parity check cannot pass with the fused route silently off.
"""

from __future__ import annotations

import statistics
from collections import Counter, deque
from typing import NamedTuple

from fastvideo.distributed.ulysses.contract import DeclineReason, Phase
from fastvideo.distributed.ulysses.policy import Plan

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
    """Counters and history of one helper's calls since construction."""

    def __init__(self, history: int) -> None:
        self.fused = self.raised = self.captured = 0  # the call count is the helper's SEQ counter
        self.hot = 0  # calls the hot path made its library call for (hot.py), whatever the library's stage
        self.declines: Counter[DeclineReason] = Counter()
        # Fused calls per proposal, keyed by its fields (a tuple of ints: one hash per call): [count, the proposal]
        # (its plan and geometry name the row in report()).
        self.plans: dict[tuple[int, ...], list] = {}
        self.vote_s: deque[float] = deque(maxlen=VOTE_SAMPLES)
        self.history: deque[CallRecord] = deque(maxlen=history)

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

    def declined(self, seq: int, phase: Phase, mode: int, reason: DeclineReason, tag: str | None = None) -> None:
        self.declines[reason] += 1
        self.history.append(CallRecord(seq, phase, mode, "nccl", None, reason, 0, False, tag))

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
        }


def report(helper) -> dict:
    """``UlyssesHelper.stats()``: what the helper is (construction, vote channel, settings) and its call counts."""
    reason = helper.construction_reason
    watchdog = helper._watchdog
    return {
        "id": helper.id,
        "generation": helper.generation,
        "world_size": helper.world_size,
        "transport": helper.capability.name,
        "construction": reason.label if reason is not None else ("ok" if helper._built else "n/a"),
        "construction_detail": helper.construction_detail,
        "construction_per_rank": dict(helper.construction_per_rank),
        "calls": helper._seq,  # every call takes one SEQ number, whatever its route or outcome
        **helper._stats.report(),
        "vote": type(helper._call_vote).__name__.removesuffix("Vote").lower(),
        "voted_launch": helper.fused_available and helper._fused_vote,  # the vote and the launch in one call
        # the hot path (hot.py): "on", or why not; the calls it made and the signatures it holds
        "hot_path": "on" if helper._hot_ok else helper.hot_decline,
        "hot_calls": helper._stats.hot,
        "hot_signatures": len(helper._hot) if helper._hot is not None else 0,
        "checked": helper.checked,
        "tags": len(helper._tags),  # distinct call tags seen (each with its own per-phase count)
        "long_training": helper.long_training,
        "in_flight": watchdog.in_flight() if watchdog is not None else 0,
        "disposed": helper._disposed_error is not None,
        "destroyed": helper._destroyed,
    }
