"""The detail of a call that raises on every rank: each rank's side of a mismatch, or each failing rank's error.

The per-call vote carries digests and bits only (a tag's hash, the split tables' hash, a ``LOCAL_ERROR`` bit). When
the verdict is a SEQ mismatch of tagged calls, a SPLITS mismatch or a peer's local error, every rank reached that
same verdict from the same votes, so every rank enters one more exchange (``gather``: the helper's, over its
construction vote group) to name what each rank's call was, or what it raised. Pure but for that exchange; a call
enters this module only to raise.
"""

from __future__ import annotations

from collections.abc import Callable

from fastvideo.distributed.ulysses import contract
from fastvideo.distributed.ulysses.contract import ContractMismatchError, Field, PeerCallError, Phase
from fastvideo.distributed.ulysses.planner import Proposal

# Every rank's object, in rank order, or None when the exchange failed (the helper is then disposed).
Gather = Callable[[object], "list[object] | None"]
ERROR_TEXT_MAX = 500  # characters of each rank's error carried to its peers (the exchange is one 4 KiB slot)


def with_detail(gather: Gather, error: BaseException, proposal: Proposal, word: int, phase: Phase, tag: str | None,
                count: int, local: BaseException | None = None) -> BaseException:
    """Collective and blocking for a peer's local error, a SPLITS mismatch or a SEQ mismatch of tagged calls, local
    otherwise: the error a RAISE verdict raises. For those three, the same error naming each failing rank's error,
    each rank's tables, or tag and count (one more exchange, which every rank enters: every rank reached this
    verdict); else ``error``. ``count``: the call's count for ``tag`` (0 untagged); ``local``: this rank's own error
    in the call, if any (what it voted ``LOCAL_ERROR`` for); for a backward, its forward's count. ``word``: the
    SEQ word the call voted (untagged, a call number: a backward's is its forward's)."""
    if isinstance(error, PeerCallError):
        return peer_errors(gather, error, local)
    # Else a ContractMismatchError: the only other error a RAISE verdict carries (``contract.decide``).
    if error.field is Field.SPLITS:
        # Every rank has its geometry here: a proposal without one (proposing raised) votes LOCAL_ERROR, whose
        # verdict (PeerCallError) the votes reach before any field's mismatch.
        tables = gather((proposal.geom.seq_table, proposal.geom.head_table))
        if tables is None:
            return error
        per_rank = [f"seq_splits={list(seq)}, head_splits={list(heads)}" for seq, heads in tables]
        return ContractMismatchError(Field.SPLITS, error.values, per_rank)
    if error.field is Field.SEQ and any(contract.is_tagged(v) for v in error.values):
        calls = gather((tag, int(phase), count, word))
        if calls is None:
            return error
        per_rank = [_call_text(t, Phase(p), n, w) for t, p, n, w in calls]
        tags = list(dict.fromkeys(t for t, *_ in calls if t is not None))
        backward = any(p == Phase.BACKWARD for _, p, _, _ in calls)
        return ContractMismatchError(Field.SEQ, error.values, per_rank, tags=tags,
                                     hint=contract.tag_hint(tags, backward))
    return error


def _call_text(tag: str | None, phase: Phase, count: int, word: int) -> str:
    if tag is None:  # untagged, the word is a call number (a backward votes its forward's)
        return f"{'the backward of ' if phase is Phase.BACKWARD else ''}untagged call {word}"
    if phase is Phase.BACKWARD:
        return f"tag {tag!r}, the backward of its forward call {count}"
    return f"tag {tag!r}, {phase.name.lower()} call {count}"


def error_text(error: BaseException | None) -> str | None:
    """``"Type: message"`` of a rank's own error in a call, shortened, or None: what its peers are told."""
    if error is None:
        return None
    text = f"{type(error).__name__}: {error}"
    return text if len(text) <= ERROR_TEXT_MAX else text[:ERROR_TEXT_MAX - 3] + "..."


def peer_errors(gather: Gather, error: PeerCallError, local: BaseException | None) -> PeerCallError:
    """Collective, blocking: a ``LOCAL_ERROR`` verdict's error naming each failing rank's own error. Every rank
    enters this exchange (every rank reached the verdict from the same votes); where it fails, ``error`` stands."""
    texts = gather(error_text(local))
    if texts is None:
        return error
    return PeerCallError(error.ranks, {r: t if t is not None else "(its error was not reported)"
                                       for r, t in enumerate(texts) if r in error.ranks})
