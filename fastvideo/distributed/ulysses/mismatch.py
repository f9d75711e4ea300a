"""The cold ends of a helper's call that raises on every rank: each rank's side of a mismatch, and a caller's error.

The per-call vote carries digests only (a tag's hash, the split tables' hash). When the verdict is a SEQ mismatch of
tagged calls or a SPLITS mismatch, every rank reached that same verdict from the same votes, so every rank enters
one more exchange, over the helper's construction vote group, to name what each rank's call was. Checked mode's
``vote_caller_error`` is the other side: this rank's call failed before any collective, and it votes
``LOCAL_ERROR`` so that its peers raise for the same call instead of waiting in it.

``UlyssesHelper.call`` enters this module only to raise. Plain functions taking the helper (as ``stats.report``
does); the helper imports this module, so this module imports nothing above it (``_Helper`` says what it uses).
"""

from __future__ import annotations

from typing import NoReturn, Protocol

import torch

from fastvideo.distributed.ulysses import contract
from fastvideo.distributed.ulysses.contract import ContractMismatchError, DeclineReason, Field, Phase
from fastvideo.distributed.ulysses.planner import Proposal
from fastvideo.distributed.ulysses.stats import CallStats
from fastvideo.distributed.ulysses.vote import GlooVote, VoteError


class _Group(Protocol):
    ranks: list[int]


class _Helper(Protocol):
    """The part of a ``UlyssesHelper`` these functions use."""

    sp: _Group
    generation: int
    _seq: int
    _stats: CallStats
    _vote: GlooVote  # the construction vote group: every rank is still in step on it after a voted mismatch

    def _check_alive(self) -> None: ...

    def _dispose(self, why: str) -> None: ...

    def _exchange(self, fields: list[int]) -> torch.Tensor: ...


def with_detail(helper: _Helper, error: BaseException, proposal: Proposal, seq: int, phase: Phase, tag: str | None,
                count: int) -> BaseException:
    """Collective and blocking for a SPLITS mismatch or a SEQ mismatch of tagged calls, local otherwise: the error a
    RAISE verdict raises. For those two, the same mismatch naming each rank's tables, or tag and count (one more
    exchange, which every rank enters: every rank reached this verdict); else ``error``. ``count``: the call's
    count for ``tag`` (0 untagged)."""
    if not isinstance(error, ContractMismatchError):
        return error
    if error.field is Field.SPLITS:
        return _splits_mismatch(helper, error, proposal)
    if error.field is Field.SEQ and any(contract.is_tagged(v) for v in error.values):
        return _tag_mismatch(helper, error, seq, phase, tag, count)
    return error


def _gather(helper: _Helper, mine: object) -> list[object] | None:
    """Every rank's ``mine`` over the construction vote group; collective, blocking. None when the exchange failed:
    the helper is then disposed (its vote group is unusable) and the digests' error stands."""
    try:
        return helper._vote.all_gather_object(mine)
    except VoteError as exc:
        helper._dispose(str(exc))
        return None


def _tag_mismatch(helper: _Helper, error: ContractMismatchError, seq: int, phase: Phase, tag: str | None,
                  count: int) -> ContractMismatchError:
    """Collective, blocking: every rank's tag and count for a SEQ mismatch of tagged calls."""
    calls = _gather(helper, (tag, int(phase), count, seq))
    if calls is None:
        return error
    per_rank = [f"tag {t!r}, {Phase(p).name.lower()} call {n}" if t is not None else f"untagged call {s}"
                for t, p, n, s in calls]
    tags = list(dict.fromkeys(t for t, *_ in calls if t is not None))
    return ContractMismatchError(Field.SEQ, error.values, per_rank, tags=tags, hint=contract.tag_hint(tags))


def _splits_mismatch(helper: _Helper, error: ContractMismatchError, proposal: Proposal) -> ContractMismatchError:
    """Collective, blocking: every rank's split tables for a SPLITS mismatch."""
    geom = proposal.geom
    tables = _gather(helper, (geom.seq_table, geom.head_table) if geom is not None else None)
    if tables is None:
        return error
    per_rank = [f"seq_splits={list(t[0])}, head_splits={list(t[1])}" if t is not None else "unknown"
                for t in tables]
    return ContractMismatchError(Field.SPLITS, error.values, per_rank)


def vote_caller_error(helper: _Helper, mode: int, grad: bool, error: BaseException) -> NoReturn:
    """Collective (one vote), blocking; always raises ``error``: ``UlyssesHelper.vote_caller_error``, checked mode's
    vote of ``LOCAL_ERROR`` for a call that failed on this rank before any collective, so that every peer raises
    ``PeerCallError`` for this same call instead of waiting in it."""
    helper._check_alive()
    seq = helper._seq
    helper._seq += 1  # also the call count
    helper._stats.raised += 1
    phase = Phase.FORWARD_GRAD if grad else Phase.FORWARD_NO_GRAD
    fields = contract.fields(helper.generation, seq, DeclineReason.LOCAL_ERROR.bit, mode, torch.float32, (0, 0, 0, 0),
                             phase)
    fields[Field.DTYPE] = 0  # nothing is known of the input but the mode and the grad flag
    try:
        helper._exchange(fields)
    except VoteError as exc:
        raise error from exc
    if hasattr(error, "add_note"):  # Python 3.11+
        error.add_note(f"Ulysses checked mode: voted on SP ranks {helper.sp.ranks}; every peer raises "
                       "PeerCallError for this call.")
    raise error
