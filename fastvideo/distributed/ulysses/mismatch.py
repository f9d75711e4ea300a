"""The cold ends of a helper's call that raises on every rank: each rank's side of a mismatch, and a caller's error.

The per-call vote carries digests and bits only (a tag's hash, the split tables' hash, a ``LOCAL_ERROR`` bit). When
the verdict is a SEQ mismatch of tagged calls, a SPLITS mismatch or a peer's local error, every rank reached that
same verdict from the same votes, so every rank enters one more exchange, over the helper's construction vote group,
to name what each rank's call was (or what it raised). ``vote_caller_error`` is the failing rank's side: its call
failed before any collective (invalid input there), and it votes ``LOCAL_ERROR``, a poisoned proposal, so that its
peers raise for the same call, naming its error, instead of pairing with its next call.

``UlyssesHelper.call`` enters this module only to raise. Plain functions taking the helper (as ``stats.report``
does); the helper imports this module, so this module imports nothing above it (``_Helper`` says what it uses).
"""

from __future__ import annotations

from typing import NoReturn, Protocol

import torch

from fastvideo.distributed.ulysses import contract
from fastvideo.distributed.ulysses.contract import ContractMismatchError, DeclineReason, Field, PeerCallError, Phase
from fastvideo.distributed.ulysses.planner import Proposal
from fastvideo.distributed.ulysses.stats import CallStats
from fastvideo.distributed.ulysses.vote import GlooVote, VoteError


class _Group(Protocol):
    ranks: list[int]
    rank_in_group: int


class _Helper(Protocol):
    """The part of a ``UlyssesHelper`` these functions use."""

    sp: _Group
    generation: int
    checked: bool
    _seq: int
    _tags: dict[str, list[int]]
    _stats: CallStats
    _vote: GlooVote  # the construction vote group: every rank is still in step on it after a voted mismatch

    def _check_alive(self) -> None: ...

    def _dispose(self, why: str) -> None: ...

    def _exchange(self, fields: list[int]) -> torch.Tensor: ...


def raised(helper: _Helper, error: BaseException, proposal: Proposal, seq: int, phase: Phase, tag: str | None,
           local: BaseException | None) -> BaseException:
    """A RAISE verdict's error (``UlyssesHelper._decide``), raised ``from local`` by the caller: counted, the call not
    counted for its tag (every rank raises it and rolls its own count back), with the detail the votes lacked
    (``with_detail``: collective for the three kinds it names)."""
    helper._stats.raised += 1
    count = 0
    if tag is not None:
        entry = helper._tags[tag]
        count = entry[phase] - 1
        entry[phase] = count
    return with_detail(helper, error, proposal, seq, phase, tag, count, local)


def caller_error(helper: _Helper, x: object, mode: int, error: BaseException) -> NoReturn:
    """Raise ``error``, found by the helper's own entry points before any collective; in checked mode after voting
    it (``vote_caller_error``), so that every rank raises. Collective in checked mode; always raises."""
    if not helper.checked or torch.compiler.is_compiling():
        raise error
    vote_caller_error(helper, mode, torch.is_grad_enabled() and isinstance(x, torch.Tensor) and x.requires_grad, error)


def with_detail(helper: _Helper, error: BaseException, proposal: Proposal, seq: int, phase: Phase, tag: str | None,
                count: int, local: BaseException | None = None) -> BaseException:
    """Collective and blocking for a peer's local error, a SPLITS mismatch or a SEQ mismatch of tagged calls, local
    otherwise: the error a RAISE verdict raises. For those three, the same error naming each failing rank's error,
    each rank's tables, or tag and count (one more exchange, which every rank enters: every rank reached this
    verdict); else ``error``. ``count``: the call's count for ``tag`` (0 untagged); ``local``: this rank's own error
    in the call, if any (what it voted ``LOCAL_ERROR`` for)."""
    if isinstance(error, PeerCallError):
        return peer_errors(helper, error, local)
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


ERROR_TEXT_MAX = 500  # characters of each rank's error carried to its peers (the exchange is one 4 KiB slot)


def error_text(error: BaseException | None) -> str | None:
    """``"Type: message"`` of a rank's own error in a call, shortened, or None: what its peers are told."""
    if error is None:
        return None
    text = f"{type(error).__name__}: {error}"
    return text if len(text) <= ERROR_TEXT_MAX else text[:ERROR_TEXT_MAX - 3] + "..."


def peer_errors(helper: _Helper, error: PeerCallError, local: BaseException | None) -> PeerCallError:
    """Collective, blocking: a ``LOCAL_ERROR`` verdict's error naming each failing rank's own error. Every rank
    enters this exchange (every rank reached the verdict from the same votes); where it fails, ``error`` stands."""
    texts = _gather(helper, error_text(local))
    if texts is None:
        return error
    return PeerCallError(error.ranks, {r: t if t is not None else "(its error was not reported)"
                                       for r, t in enumerate(texts) if r in error.ranks})


def vote_caller_error(helper: _Helper, mode: int, grad: bool, error: BaseException) -> NoReturn:
    """Collective (one vote, then the exchange of the errors), blocking; always raises ``error``:
    ``UlyssesHelper.vote_caller_error``, the vote of ``LOCAL_ERROR`` for a call that failed on this rank before any
    collective, so that every peer raises ``PeerCallError`` for this same call, naming ``error``, instead of waiting
    in it or pairing it with this rank's next call."""
    helper._check_alive()
    seq = helper._seq
    helper._seq += 1  # also the call count
    helper._stats.raised += 1
    phase = Phase.FORWARD_GRAD if grad else Phase.FORWARD_NO_GRAD
    fields = contract.fields(helper.generation, seq, DeclineReason.LOCAL_ERROR.bit, mode, torch.float32, (0, 0, 0, 0),
                             phase)
    fields[Field.DTYPE] = 0  # nothing is known of the input but the mode and the grad flag
    try:
        rows = helper._exchange(fields)
    except VoteError as exc:
        raise error from exc
    verdict = contract.decide(rows).error
    # Every rank reached this verdict (this rank's LOCAL_ERROR is in it): all enter the exchange of the errors.
    peers = peer_errors(helper, verdict, error) if isinstance(verdict, PeerCallError) else None
    if hasattr(error, "add_note"):  # Python 3.11+
        others = "" if peers is None else "; ".join(f"rank {r}: {t}" for r, t in sorted(peers.errors.items())
                                                     if r != helper.sp.rank_in_group)
        error.add_note(f"Ulysses: voted on SP ranks {helper.sp.ranks}; every peer raises PeerCallError for this "
                       f"call{f' (other ranks that raised: {others})' if others else ''}.")
    raise error
