"""The per-call contract: 12 int64 fields every rank exchanges before every fused-route decision.

Wire format (frozen; ``CONTRACT_VERSION`` changes when it does; ``docs/ulysses_contract.md``):

====  ==============  =================================================================
 #    field           meaning
====  ==============  =================================================================
 0    HEADER          ``CONTRACT_VERSION << 32 | helper generation``
 1    SEQ             call sequence number of this helper (0, 1, 2, ...)
 2    ELIGIBILITY     rank-local decline bits (``1 << DeclineReason``); 0 = eligible
 3    MODE            0: scatter heads / gather sequence, 1: the inverse
 4    DTYPE           ``DTYPE_CODES`` of the operand
 5    B               planes (batch dim)
 6    S_LOCAL         per-rank sequence
 7    H               global head count
 8    D               head dim
 9    PHASE           0: no-grad forward, 1: grad-tracked forward, 2: backward
 10   WINDOW_BYTES    window bytes the plan needs (0: no fused plan), | ``WINDOW_CAPTURED`` under capture
 11   PLAN            packed plan word (``Plan.word``; 0: no fused plan)
====  ==============  =================================================================

Verdict (``decide``), computed identically on every rank from the gathered ``[P, 12]`` votes:

* A rank set the LOCAL_ERROR bit (a rank-local step of the call raised there): ``RAISE`` on every
  rank (``PeerCallError``), so no rank is left a call ahead of its peers.
* HEADER, SEQ, MODE, DTYPE, B, S_LOCAL, H, D or PHASE differ: a caller bug (the NCCL route would
  hang too). ``RAISE`` naming the field and the per-rank values; no rank enters a collective.
* ELIGIBILITY, WINDOW_BYTES or PLAN differ, or any rank has a decline bit: ``DECLINE`` together.
* Otherwise ``RUN`` the agreed plan.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass

import torch

CONTRACT_VERSION = 1
NUM_FIELDS = 12
# Set in WINDOW_BYTES by a rank whose call is being captured into a CUDA graph with the plan frozen: a rank
# capturing while a peer runs eagerly differs there, so every rank declines together (PEER_DISAGREEMENT).
# Window bytes never reach it; eager votes are unchanged (no version bump).
WINDOW_CAPTURED = 1 << 62


class Field(enum.IntEnum):
    HEADER = 0
    SEQ = 1
    ELIGIBILITY = 2
    MODE = 3
    DTYPE = 4
    B = 5
    S_LOCAL = 6
    H = 7
    D = 8
    PHASE = 9
    WINDOW_BYTES = 10
    PLAN = 11


# Fields every rank must agree on, or the caller has a bug that would hang any route.
MUST_MATCH = (Field.HEADER, Field.SEQ, Field.MODE, Field.DTYPE, Field.B, Field.S_LOCAL, Field.H, Field.D, Field.PHASE)


class Phase(enum.IntEnum):
    FORWARD_NO_GRAD = 0
    FORWARD_GRAD = 1
    BACKWARD = 2


class DeclineReason(enum.IntEnum):
    """Why the fused route did not run. The value is the bit position in the ELIGIBILITY field."""

    DISABLED = 0  # FASTVIDEO_ULYSSES_A2A=off
    TRANSPORT_MISSING = 1  # no kernel library (or no transport for this device)
    TRANSPORT_TOO_OLD = 2  # library ABI older than this package supports
    NCCL_RUNTIME_MISMATCH = 3  # runtime NCCL major.minor differs from the build's
    WORLD_SIZE = 4  # SP size outside 2..8
    MULTI_HOST = 5  # ranks on more than one host (hostname or boot id)
    NOT_LSA = 6  # peers not all reachable through LSA pointers
    NOT_NVLINK = 7  # peers reachable only over PCIe
    DTYPE = 8  # dtype the kernel does not move
    NON_CONTIGUOUS = 9  # operand not contiguous
    ALIGNMENT = 10  # alignment the kernel build cannot serve
    CUDA_GRAPH_CAPTURE = 11  # called inside CUDA graph capture with a plan that cannot be frozen into the graph
    TORCH_COMPILE = 12  # called inside a torch.compile region
    WINDOW = 13  # the plan's chunk does not fit the window (untuned policy: the whole operand)
    DISPOSED = 14  # helper destroyed, or disposed after a failed vote
    PEER_DISAGREEMENT = 15  # ranks disagree on eligibility, capability or plan
    DEVICE = 16  # operand not on the helper's device
    CONSTRUCTION_FAILED = 17  # a collective construction step failed on some rank
    LOCAL_ERROR = 18  # not a decline: a rank-local step of the call raised; every rank raises

    @property
    def bit(self) -> int:
        return 1 << int(self)

    @property
    def label(self) -> str:
        return self.name.lower()


def reasons_from_bits(bits: int) -> list[DeclineReason]:
    return [r for r in DeclineReason if bits & r.bit]


# Stable dtype codes for the wire (never reuse a code).
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.float64: 4,
    torch.int8: 5,
    torch.uint8: 6,
    torch.int16: 7,
    torch.int32: 8,
    torch.int64: 9,
}
DTYPES_BY_CODE = {code: dtype for dtype, code in DTYPE_CODES.items()}


def dtype_code(dtype: torch.dtype) -> int:
    return DTYPE_CODES.get(dtype, 0)


def header(generation: int) -> int:
    return (CONTRACT_VERSION << 32) | (generation & 0xFFFFFFFF)


def fields(generation: int, seq: int, bits: int, mode: int, dtype: torch.dtype, shape: tuple[int, int, int, int],
           phase: Phase, window_bytes: int = 0, plan_word: int = 0, capturing: bool = False) -> list[int]:
    """One rank's 12 vote fields. ``shape`` is ``(B, S_local, H, D)`` (global heads); ``window_bytes`` and
    ``plan_word`` only when this rank proposes to run that plan (both 0 otherwise). A rank capturing while a
    peer runs eagerly differs in WINDOW_BYTES: every rank then declines together."""
    row = [0] * NUM_FIELDS
    row[Field.HEADER] = header(generation)
    row[Field.SEQ] = seq
    row[Field.ELIGIBILITY] = bits
    row[Field.MODE] = mode
    row[Field.DTYPE] = dtype_code(dtype)
    row[Field.B], row[Field.S_LOCAL], row[Field.H], row[Field.D] = shape
    row[Field.PHASE] = int(phase)
    if plan_word:
        row[Field.WINDOW_BYTES] = window_bytes | (WINDOW_CAPTURED if capturing else 0)
        row[Field.PLAN] = plan_word
    return row


def outcome_code(plan_word: int, reason: DeclineReason | None) -> int:
    """What one call ran, as one int (a backward runs its forward's): the plan word (> 0) of a fused call, or
    ``-1 - reason`` (< 0) for a call that declined. 0 is reserved for a call that ran without a helper."""
    if plan_word:
        return plan_word
    return -1 - int(reason if reason is not None else DeclineReason.PEER_DISAGREEMENT)


def outcome_reason(code: int) -> DeclineReason:
    """The decline reason of a negative ``outcome_code``."""
    return DeclineReason(-1 - code)


class ContractMismatchError(RuntimeError):
    """Ranks called the all-to-all with different contracts (a caller bug). Raised on every rank."""

    def __init__(self, field: Field, values: list[int]):
        self.field, self.values = field, values
        per_rank = ", ".join(f"rank {r}: {_describe(field, v)}" for r, v in enumerate(values))
        hint = {
            Field.SEQ: "a rank skipped or repeated a call (every SP rank must issue the same sequence of calls)",
            Field.PHASE: "ranks disagree on requires_grad/backward, which would also hang the NCCL route",
            Field.HEADER: "ranks run different contract versions or helper generations (rebuild collectively)",
        }.get(field, "every SP rank must pass the same shape, dtype and mode")
        super().__init__(f"Ulysses all-to-all contract mismatch on field {field.name} ({per_rank}): {hint}.")


def _describe(field: Field, value: int) -> str:
    if field == Field.DTYPE:
        return str(DTYPES_BY_CODE.get(value, value))
    if field == Field.PHASE and value in tuple(Phase):
        return Phase(value).name.lower()
    if field == Field.HEADER:
        return f"v{value >> 32}/gen{value & 0xFFFFFFFF}"
    return str(value)


class PeerCallError(RuntimeError):
    """A rank-local step of the call raised on some rank (e.g. a bad env value there). Raised on every rank."""

    def __init__(self, ranks: list[int]):
        self.ranks = ranks
        super().__init__(
            f"Ulysses all-to-all: rank(s) {ranks} raised while preparing this call (their own traceback has the "
            "cause); every rank raises so that no rank is left a call ahead of its peers."
        )


class Verdict(enum.Enum):
    RUN = "run"
    DECLINE = "decline"
    RAISE = "raise"


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    reason: DeclineReason | None = None  # DECLINE: the counted reason
    plan_word: int = 0  # RUN: the agreed plan
    error: RuntimeError | None = None  # RAISE: ContractMismatchError or PeerCallError


@functools.lru_cache(maxsize=256)
def _run_decision(plan_word: int) -> Decision:
    """RUN decisions are immutable: one object per plan word (no allocation per call)."""
    return Decision(Verdict.RUN, plan_word=plan_word)


def decide(votes: torch.Tensor) -> Decision:
    """The collective verdict from the gathered ``[P, 12]`` int64 votes (pure; same on every rank)."""
    if votes.dim() != 2 or votes.shape[1] != NUM_FIELDS:
        raise ValueError(f"decide: votes must be [P, {NUM_FIELDS}], got {tuple(votes.shape)}")
    rows = votes.tolist()
    first = rows[0]
    if all(row == first for row in rows):
        # The common case, decided without walking the fields: every rank proposed the same call.
        # (Same verdicts as the general path below, which handles identical rows the same way.)
        bits = first[Field.ELIGIBILITY]
        if bits & DeclineReason.LOCAL_ERROR.bit:
            return Decision(Verdict.RAISE, error=PeerCallError(list(range(len(rows)))))
        if bits:
            return Decision(Verdict.DECLINE, reason=reasons_from_bits(bits)[0])
        if first[Field.PLAN] == 0:
            return Decision(Verdict.DECLINE, reason=DeclineReason.WINDOW)
        return _run_decision(first[Field.PLAN])
    failed = [r for r, row in enumerate(rows) if row[Field.ELIGIBILITY] & DeclineReason.LOCAL_ERROR.bit]
    if failed:
        return Decision(Verdict.RAISE, error=PeerCallError(failed))
    for field in MUST_MATCH:
        column = [row[field] for row in rows]
        if any(v != column[0] for v in column):
            return Decision(Verdict.RAISE, error=ContractMismatchError(field, column))
    bits = [row[Field.ELIGIBILITY] for row in rows]
    if any(b != bits[0] for b in bits):
        return Decision(Verdict.DECLINE, reason=DeclineReason.PEER_DISAGREEMENT)
    if bits[0]:
        return Decision(Verdict.DECLINE, reason=reasons_from_bits(bits[0])[0])
    for field in (Field.WINDOW_BYTES, Field.PLAN):
        column = [row[field] for row in rows]
        if any(v != column[0] for v in column):
            return Decision(Verdict.DECLINE, reason=DeclineReason.PEER_DISAGREEMENT)
    if rows[0][Field.PLAN] == 0:
        # Eligible but no plan: only a policy bug gets here; never run without one.
        return Decision(Verdict.DECLINE, reason=DeclineReason.WINDOW)
    return _run_decision(rows[0][Field.PLAN])
