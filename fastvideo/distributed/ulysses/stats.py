"""What a helper did: one record per call, counters, and the ``stats()`` report. Local; no collective.

Gates and tests assert the plans that actually ran from ``CallRecord``s (``UlyssesHelper.history``), so a
parity check cannot pass with the fused route silently off.
"""

from __future__ import annotations

import statistics
from collections import Counter, deque
from typing import NamedTuple

from fastvideo.distributed.ulysses.contract import DeclineReason, Phase
from fastvideo.distributed.ulysses.policy import Geometry, Plan

VOTE_SAMPLES = 4096  # vote durations kept for ``vote_seconds`` and the medians


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


class CallStats:
    """Counters and history of one helper's calls since construction."""

    def __init__(self, history: int) -> None:
        self.calls = self.fused = self.raised = self.captured = 0
        self.declines: Counter[DeclineReason] = Counter()
        # Fused calls per proposal, keyed by its fields (a tuple of ints: cheap to hash per call; the plan and the
        # geometry it names are kept beside it for report()).
        self.plans: Counter[tuple[int, ...]] = Counter()
        self._named: dict[tuple[int, ...], tuple[Plan, Geometry]] = {}
        self.vote_s: deque[float] = deque(maxlen=VOTE_SAMPLES)
        self.history: deque[CallRecord] = deque(maxlen=history)

    def ran(self, seq: int, phase: Phase, geom: Geometry, plan: Plan, captured: bool, key: tuple[int, ...]) -> None:
        """A fused call of the proposal whose fields are ``key``."""
        self.fused += 1
        self.captured += captured
        if self.plans[key] == 0:
            self._named[key] = (plan, geom)
        self.plans[key] += 1
        self.history.append(CallRecord(seq, phase, geom.mode, "fused", plan, None, plan.num_chunks(geom), captured))

    def declined(self, seq: int, phase: Phase, mode: int, reason: DeclineReason) -> None:
        self.declines[reason] += 1
        self.history.append(CallRecord(seq, phase, mode, "nccl", None, reason, 0))

    def report(self) -> dict:
        """The per-call part of ``UlyssesHelper.stats()``."""
        votes = sorted(self.vote_s)
        return {
            "calls": self.calls,
            "fused": self.fused,
            "captured": self.captured,  # fused launches captured into CUDA graphs (counted in "fused")
            "raised": self.raised,
            "declines": {r.label: n for r, n in sorted(self.declines.items())},
            "plans": dict(sum((Counter({self._named[k][0].describe(self._named[k][1]): n})
                               for k, n in self.plans.items()), Counter())),
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
        **helper._stats.report(),
        "vote": type(helper._call_vote).__name__.removesuffix("Vote").lower(),
        "voted_launch": helper.fused_available and helper._fused_vote,  # the vote and the launch in one call
        "checked": helper.checked,
        "long_training": helper.long_training,
        "in_flight": watchdog.in_flight() if watchdog is not None else 0,
        "disposed": helper._disposed_error is not None,
        "destroyed": helper._destroyed,
    }
