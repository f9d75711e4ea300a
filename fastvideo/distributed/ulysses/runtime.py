"""A helper's native runtime, the failure rules of its calls, and its two ends.

``Runtime`` owns what a helper holds of the process: the transport, the construction vote group, the per-call vote
channel and the watchdog of its launches in flight; every vote and launch of a call goes through it, so that each
failure has one rule. A vote that fails disposes the helper (rank-local): its vote group is unusable after a failed
exchange. A launch that fails after every rank agreed to run it disposes it too: its peers may wait in theirs. A
disposed helper takes no further call (``check`` raises). A destroyed one (collective) has released its transport
and vote channels on every rank; its SP group's teardown (``destroy_sequence_parallel``) destroys it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fastvideo.distributed.ulysses import contract
from fastvideo.distributed.ulysses.contract import DeclineReason, Field
from fastvideo.distributed.ulysses.hot import HotLane
from fastvideo.distributed.ulysses.planner import Proposal
from fastvideo.distributed.ulysses.stats import CallStats
from fastvideo.distributed.ulysses.transport import Transport, VoteNotStarted
from fastvideo.distributed.ulysses.vote import GlooVote, ShmVote, VoteError
from fastvideo.distributed.ulysses.watchdog import FusedCallWatchdog, InFlight

# The current stream's capture status in one call (``torch.cuda.is_current_stream_capturing`` wraps it). Asked only
# for CUDA tensors: a CPU build's placeholder for it is never called; a build without it takes the wrapper.
_is_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None) or torch.cuda.is_current_stream_capturing


def stream_capturing(x: torch.Tensor) -> bool:
    """Whether this call is being captured into a CUDA graph (its device's current stream is capturing)."""
    return x.is_cuda and _is_capturing()


class HelperDisposedError(RuntimeError):
    """The helper was destroyed, or disposed itself after a failed vote; build a new one."""


class Runtime:
    """The native runtime of one helper and its lifecycle. Local, except ``destroy`` (collective)."""

    def __init__(self, sp, generation: int, transport: Transport | None, vote: GlooVote, stats: CallStats,
                 watchdog_timeout_s: float, on_watchdog_timeout: Callable[[str], None]) -> None:
        self.sp, self.generation, self.transport, self.vote = sp, generation, transport, vote
        # Set by the helper from construction's agreed outcome: the per-call channel it chose, and whether the
        # transport's construction succeeded on every rank.
        self.call_vote: GlooVote | ShmVote = vote
        self.built = False
        self.disposed: str | None = None  # why, once disposed
        self.destroyed = False
        self._stats = stats
        self._watchdog_s, self._on_watchdog = watchdog_timeout_s, on_watchdog_timeout
        self._watchdog: FusedCallWatchdog | None = None  # built at the first launch that leaves work in flight
        self.on_destroy: list[Callable[[], None]] = []  # told when ``destroy`` ran
        # Its SP group's teardown destroys it (collective, as that teardown is; keyed by the generation, the same on
        # every rank): no helper exchanges over groups that are gone. A destroyed runtime stays there until then: a
        # no-op holding no transport resources.
        sp.add_teardown(f"ulysses.gen{generation}", self.destroy)

    @property
    def alive(self) -> bool:
        return self.disposed is None and not self.destroyed

    def check(self) -> None:
        """Local: raise ``HelperDisposedError`` for a disposed or destroyed helper (counted), else nothing."""
        if self.disposed is not None:
            raise HelperDisposedError(
                f"Ulysses helper gen{self.generation} was disposed after a failed vote ({self.disposed}); its vote "
                "group is unusable. Tear down and rebuild the process groups.")
        if self.destroyed:
            self._stats.declines[DeclineReason.DISPOSED] += 1
            raise HelperDisposedError(
                f"Ulysses helper gen{self.generation} was destroyed; construct a new UlyssesHelper (collective).")

    def dispose(self, why: str) -> None:
        """Local, not blocking: the helper takes no further call (a vote failed, or a launch after one)."""
        self.disposed = why
        if not self.vote.owns_group:
            self.sp.vote_failed(why)  # the shared group is dead too: later helpers must not use it
        if self.transport is not None:
            self.transport.abort()
        self._stats.declines[DeclineReason.DISPOSED] += 1

    def launch_failed(self, seq: int, exc: Exception) -> None:
        """Local: a launch failed on this rank after every rank agreed to run call ``seq``. Its peers have launched
        (or will launch) it and may wait at its barriers, and a later launch here could pair with their stuck call,
        so the helper is disposed (the peers' watchdogs end the processes that are stuck)."""
        self.dispose(f"the fused launch of call {seq} failed on this rank after the vote: {type(exc).__name__}: "
                     f"{exc}")

    # ------------------------------------------------------------------ a call's votes and launches

    def exchange(self, fields: list[int]) -> torch.Tensor:
        """Gather every rank's fields over the per-call channel (collective); a failed vote disposes the helper and
        raises."""
        vote = self.call_vote
        try:
            rows = vote.exchange(fields)
        except VoteError as exc:
            self.dispose(str(exc))
            raise
        self._stats.vote_s.append(vote.last_s)
        return rows

    def gather(self, mine: object) -> list[object] | None:
        """Every rank's ``mine`` over the construction vote group (collective, blocking), or None when the exchange
        failed: the helper is then disposed (its vote group is unusable)."""
        try:
            return self.vote.all_gather_object(mine)
        except VoteError as exc:
            self.dispose(str(exc))
            return None

    def voted_launch(self, x: torch.Tensor, proposal: Proposal, word: int, seq: int, hot: HotLane | None = None,
                     hit: tuple | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None, BaseException | None]:
        """One library call votes (the proposal's fields, SEQ = ``word``) and, where every rank proposed this same
        call, launches: the transport's voted ``execute``, or (``hit``) the hot lane's, already made. Returns
        (output, None, None) when it launched, else (None, the gathered votes, a local error)."""
        vote = self.call_vote
        try:
            out = (self.transport.execute(x, proposal.geom, proposal.plan, vote=vote, fields=proposal.fields,
                                          seq=word) if hit is None else hot.finish(x, hit, vote))
        except VoteNotStarted as exc:
            # This rank has not voted yet: vote its failure, so that every rank raises together.
            fields = contract.with_seq(proposal.fields, word)
            fields[Field.ELIGIBILITY] = DeclineReason.LOCAL_ERROR.bit
            fields[Field.WINDOW_BYTES] = fields[Field.PLAN] = 0
            return None, self.exchange(fields), exc
        except VoteError as exc:
            self.dispose(str(exc))
            raise
        except Exception as exc:
            self.launch_failed(seq, exc)
            raise
        self._stats.vote_s.append(vote.last_s)
        return out, (None if out is not None else vote.rows), None

    def execute(self, x: torch.Tensor, proposal: Proposal, seq: int, capture: bool) -> torch.Tensor:
        """Run (or, ``capture``, capture) the plan every rank agreed to run. Collective."""
        try:
            return self.transport.execute(x, proposal.geom, proposal.plan, capture=capture)
        except Exception as exc:
            self.launch_failed(seq, exc)
            raise

    def watch(self, call: InFlight) -> None:
        """Local: track a launch in flight (the watchdog is built at the first). A deque append: the watchdog polls
        every ``POLL_EVERY`` tracked calls and on its thread's timer, never per call (a poll queries an event)."""
        if self._watchdog is None:
            self._watchdog = FusedCallWatchdog.for_group(self._watchdog_s, self.sp.ranks, self.sp.rank_in_group,
                                                         self._on_watchdog, self.transport.watchdog_thread_setup)
        self._watchdog.track(call)

    def in_flight(self) -> int:
        """Local: launches not yet seen complete."""
        return self._watchdog.in_flight() if self._watchdog is not None else 0

    def destroy(self) -> None:
        """Collective over the SP group, blocking (a second call is a no-op)."""
        if self.destroyed:
            return
        self.destroyed = True
        if self._watchdog is not None:
            self._watchdog.stop()
        if self.built and self.disposed is None and self.transport is not None:
            self.transport.destroy()
        self.built = False
        if self.call_vote is not self.vote:
            self.call_vote.destroy()
        self.vote.destroy()
        for hook in self.on_destroy:
            hook()
