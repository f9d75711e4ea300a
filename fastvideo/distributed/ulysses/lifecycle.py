"""The two ends of a helper: disposed after a failed vote or launch (rank-local), or destroyed (collective).

A disposed helper takes no further call (``UlyssesHelper._check_alive`` raises): its vote group is unusable after a
failed exchange, and after a launch that failed here its peers may wait in theirs. A destroyed one has released its
transport and vote channels on every rank. A call enters this module only when it fails. Plain functions taking
the helper (as ``stats.report`` does); the helper imports this module, so this module imports nothing above it
(``_Helper`` says what it uses).
"""

from __future__ import annotations

from typing import Protocol

from fastvideo.distributed.ulysses.contract import DeclineReason
from fastvideo.distributed.ulysses.stats import CallStats
from fastvideo.distributed.ulysses.transport import Transport
from fastvideo.distributed.ulysses.vote import GlooVote, ShmVote
from fastvideo.distributed.ulysses.watchdog import FusedCallWatchdog


class _Group(Protocol):
    vote_failure: str | None


class _Helper(Protocol):
    """The part of a ``UlyssesHelper`` these functions use."""

    sp: _Group
    generation: int
    transport: Transport | None
    _stats: CallStats
    _vote: GlooVote
    _call_vote: GlooVote | ShmVote
    _watchdog: FusedCallWatchdog | None
    _built: bool
    _destroyed: bool
    _disposed_error: str | None


class HelperDisposedError(RuntimeError):
    """The helper was destroyed, or disposed itself after a failed vote; build a new one."""


def check_alive(helper: _Helper) -> None:
    """Local: raise ``HelperDisposedError`` for a disposed or destroyed helper (counted), else nothing."""
    if helper._disposed_error is not None:
        raise HelperDisposedError(
            f"Ulysses helper gen{helper.generation} was disposed after a failed vote ({helper._disposed_error}); "
            "its vote group is unusable. Tear down and rebuild the process groups."
        )
    if helper._destroyed:
        helper._stats.declines[DeclineReason.DISPOSED] += 1
        raise HelperDisposedError(
            f"Ulysses helper gen{helper.generation} was destroyed; construct a new UlyssesHelper (collective)."
        )


def dispose(helper: _Helper, why: str) -> None:
    """Local, not blocking: ``helper`` takes no further call (a vote failed, or a launch after one)."""
    helper._disposed_error = why
    if not helper._vote.owns_group:
        helper.sp.vote_failure = why  # the shared group is dead too: later helpers must not use it
    if helper.transport is not None:
        helper.transport.abort()
    helper._stats.declines[DeclineReason.DISPOSED] += 1


def launch_failed(helper: _Helper, seq: int, exc: Exception) -> None:
    """Local: a launch failed on this rank after every rank agreed to run call ``seq``. Its peers have launched (or
    will launch) it and may wait at its barriers, and a later launch here could pair with their stuck call, so the
    helper is disposed (the peers' watchdogs end the processes that are stuck)."""
    dispose(helper, f"the fused launch of call {seq} failed on this rank after the vote: {type(exc).__name__}: {exc}")


def destroy(helper: _Helper) -> None:
    """Collective over the SP group, blocking: ``UlyssesHelper.destroy`` (a second call is a no-op)."""
    if helper._destroyed:
        return
    helper._destroyed = True
    if helper._watchdog is not None:
        helper._watchdog.stop()
    if helper._built and helper._disposed_error is None and helper.transport is not None:
        helper.transport.destroy()
    helper._built = False
    if helper._call_vote is not helper._vote:
        helper._call_vote.destroy()
    helper._vote.destroy()
