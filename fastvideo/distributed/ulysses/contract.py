"""The per-call contract: 12 int64 fields every rank exchanges before every fused-route decision.

Wire format (frozen; ``CONTRACT_VERSION`` changes when it does; ``docs/ulysses_contract.md``):

====  ==============  =================================================================
 #    field           meaning
====  ==============  =================================================================
 0    HEADER          ``CONTRACT_VERSION << 32 | helper generation``
 1    SEQ             untagged forward: this helper's call count (0, 1, 2, ...); tagged forward: ``tag_seq``,
                      bit 62 set, a 62-bit digest of the tag XOR the phase (bits 60-61) XOR the tag's own count;
                      backward: the SEQ word its forward voted (saved with the forward's outcome)
 2    ELIGIBILITY     rank-local decline bits (``1 << DeclineReason``); 0 = eligible
 3    MODE_PHASE      ``mode | phase << 4``: mode 0 scatters heads / gathers sequence, 1 the inverse;
                      phase 0 no-grad forward, 1 grad-tracked forward, 2 backward
 4    DTYPE           ``DTYPE_CODES`` of the operand
 5    B               planes (batch dim)
 6    S               global sequence length (the sum of the sequence shares; S_local x P when even)
 7    H               global head count
 8    D               head dim
 9    SPLITS          0 for even split tables, else ``splits_digest`` of (seq_splits, head_splits)
 10   WINDOW_BYTES    window bytes the plan needs (0: no fused plan), | ``WINDOW_CAPTURED`` under capture
 11   PLAN            packed plan word (``Plan.word``; 0: no fused plan)
====  ==============  =================================================================

ELIGIBILITY stays field 2 and PLAN field 11 in every version: the kernel library's ``fvk_vote_would_run`` reads
them. Verdict (``decide``), computed identically on every rank from the gathered ``[P, 12]`` votes:

* A rank set the LOCAL_ERROR bit (a rank-local step of the call raised there): ``RAISE`` on every
  rank (``PeerCallError``), so no rank is left a call ahead of its peers.
* HEADER, SEQ, MODE_PHASE, DTYPE, B, S, H, D or SPLITS differ: a caller bug (the NCCL route would
  hang or move wrong data too). ``RAISE`` naming the field (MODE or PHASE for MODE_PHASE) and the per-rank
  values; no rank enters a collective. (An untagged forward's SEQ moves with the votes, so a rank that skips or
  repeats an untagged forward is not seen there; a tagged forward's SEQ is its tag's own count: a skip is. A
  backward's SEQ is its forward's word, so ranks running the backwards of two calls in different orders differ;
  two backward passes over one call do not.)
* ELIGIBILITY, WINDOW_BYTES or PLAN differ, or any rank has a decline bit: ``DECLINE`` together.
* Otherwise ``RUN`` the agreed plan.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

CONTRACT_VERSION = 4
NUM_FIELDS = 12
# Set in WINDOW_BYTES by a rank whose call is being captured into a CUDA graph with the plan frozen: a rank
# capturing while a peer runs eagerly differs there, so every rank declines together (PEER_DISAGREEMENT).
# Window bytes never reach it; eager votes are unchanged.
WINDOW_CAPTURED = 1 << 62
PHASE_SHIFT = 4  # MODE_PHASE = mode | phase << PHASE_SHIFT
_MODE_MASK = (1 << PHASE_SHIFT) - 1
_DIGEST_MASK = (1 << 63) - 1
# A tagged call's SEQ (``tag_seq``): bit 62 set (an untagged count never reaches it), the tag's 62-bit digest XOR
# the phase in bits 60-61 XOR the tag's own count in bits 0-59.
TAGGED = 1 << 62
TAG_PHASE_SHIFT = 60
TAG_COUNT_MASK = (1 << TAG_PHASE_SHIFT) - 1
_TAG_DIGEST_MASK = TAGGED - 1


class Field(enum.IntEnum):
    """A contract field. HEADER..PLAN are the 12 wire slots (the value is the index); MODE and PHASE are the two
    values packed into MODE_PHASE, never indices (``row[Field.MODE]`` is an IndexError): what
    ``ContractMismatchError.field`` names when MODE_PHASE differs."""

    HEADER = 0
    SEQ = 1
    ELIGIBILITY = 2
    MODE_PHASE = 3
    DTYPE = 4
    B = 5
    S = 6
    H = 7
    D = 8
    SPLITS = 9
    WINDOW_BYTES = 10
    PLAN = 11
    MODE = 12
    PHASE = 13


WIRE_FIELDS = tuple(f for f in Field if f < NUM_FIELDS)
# Fields every rank must agree on, or the caller has a bug that would hang (or corrupt) any route.
MUST_MATCH = (Field.HEADER, Field.SEQ, Field.MODE_PHASE, Field.DTYPE, Field.B, Field.S, Field.H, Field.D,
              Field.SPLITS)


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
    UNEVEN_SPLITS = 19  # uneven seq_splits/head_splits, which this transport's kernels do not move
    EMPTY = 20  # an operand of no element (every share empty, or B, H or D zero): nothing for the kernel to move

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


def dtype_code(dtype: torch.dtype | None) -> int:
    """The DTYPE field: the table's code; for a dtype the table lacks (complex, bool, the unsigned and float8
    kinds), a code of its name with bit 31 set (the same on every rank, never a table code), so that two such dtypes
    still differ in the vote; 0 for none (None)."""
    return DTYPE_CODES.get(dtype) or (0 if dtype is None else 1 << 31 | zlib.crc32(str(dtype).encode()))


def header(generation: int) -> int:
    return (CONTRACT_VERSION << 32) | (generation & 0xFFFFFFFF)


def mode_phase(mode: int, phase: int) -> int:
    """The MODE_PHASE field: ``mode | phase << 4`` (an invalid mode, -1 in a caller-error vote, packs as 15)."""
    return (mode & _MODE_MASK) | int(phase) << PHASE_SHIFT


def splits_digest(seq: Sequence[int], heads: Sequence[int]) -> int:
    """The SPLITS field for every rank's sequence and head shares: 0 when both tables are even (every share
    equal), else 63 bits of BLAKE2b over both tables (never 0). Computed once per call signature, never per call.
    Why two different tables never meet the same digest in practice: ``docs/ulysses_contract.md``."""
    if all(v == seq[0] for v in seq) and all(v == heads[0] for v in heads):
        return 0
    data = struct.pack(f"<2q{len(seq)}q{len(heads)}q", len(seq), len(heads), *seq, *heads)
    return (_blake2b_64(data, b"fv-ulysses-split") & _DIGEST_MASK) or 1


def tag_digest(tag: str) -> int:
    """62 bits of BLAKE2b (personalisation ``fv-ulysses-tag``) over the tag's UTF-8 bytes: what a tagged call's
    SEQ carries of its tag. The helper computes it once per tag (``tag_bases``) and caches it, never per call."""
    return _blake2b_64(tag.encode("utf-8", "surrogatepass"), b"fv-ulysses-tag") & _TAG_DIGEST_MASK


def _blake2b_64(data: bytes, person: bytes) -> int:
    """The 8-byte BLAKE2b digest of ``data`` under personalisation ``person``, as a little-endian int: what both
    digests of the contract (``splits_digest``, ``tag_digest``) mask to their widths."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8, person=person).digest(), "little")


def tag_bases(tag: str) -> tuple[int, int, int]:
    """Per phase (``Phase`` order), the SEQ word of the tag's call 0: ``TAGGED | digest ^ phase << 60``. Call ``n``
    of that phase is ``base ^ n`` (``tag_seq``): one XOR per call."""
    digest = tag_digest(tag)
    return tuple(TAGGED | (digest ^ (int(p) << TAG_PHASE_SHIFT)) for p in Phase)


def tag_seq(tag: str, phase: int, count: int) -> int:
    """The SEQ field of call ``count`` (0, 1, ...) of ``phase`` tagged ``tag``; for one tag, (phase, count) maps to
    distinct words for every count below 2^60. Why two tags never meet the same word in practice:
    ``docs/ulysses_contract.md``."""
    return tag_bases(tag)[phase] ^ (count & TAG_COUNT_MASK)


def is_tagged(seq_field: int) -> bool:
    """Whether a SEQ field is a tagged call's (``tag_seq``) rather than an untagged call's count."""
    return bool(seq_field & TAGGED)


def fields(generation: int, seq: int, bits: int, mode: int, dtype: torch.dtype | None, shape: tuple[int, int, int, int],
           phase: Phase, window_bytes: int = 0, plan_word: int = 0, capturing: bool = False,
           splits: int = 0) -> list[int]:
    """One rank's 12 vote fields. ``shape`` is ``(B, S, H, D)``: the global sequence length and head count, the
    same on every rank; ``splits`` the SPLITS digest (0: even). ``window_bytes`` and ``plan_word`` only when
    this rank proposes to run that plan (both 0 otherwise). A rank capturing while a peer runs eagerly differs
    in WINDOW_BYTES: every rank then declines together."""
    row = [0] * NUM_FIELDS
    row[Field.HEADER] = header(generation)
    row[Field.SEQ] = seq
    row[Field.ELIGIBILITY] = bits
    row[Field.MODE_PHASE] = mode_phase(mode, phase)
    row[Field.DTYPE] = dtype_code(dtype)
    row[Field.B], row[Field.S], row[Field.H], row[Field.D] = shape
    row[Field.SPLITS] = splits
    if plan_word:
        row[Field.WINDOW_BYTES] = window_bytes | (WINDOW_CAPTURED if capturing else 0)
        row[Field.PLAN] = plan_word
    return row


def with_seq(row: Sequence[int], seq: int) -> list[int]:
    """A copy of ``row`` (a proposal's fields, SEQ 0) with SEQ = ``seq``: what this rank votes for one call."""
    voted = list(row)
    voted[Field.SEQ] = seq
    return voted


def outcome_code(plan_word: int, reason: DeclineReason | None) -> int:
    """What one call ran, as one int (a backward runs its forward's): the plan word (> 0) of a fused call, or
    ``-1 - reason`` (< 0) for a call that declined. 0 is reserved for a call that ran without a helper. The op
    saves ``[helper id, outcome code, SEQ word]`` per call (``OUTCOME_LEN`` int64s): its backward's plan and
    SEQ."""
    if plan_word:
        return plan_word
    return -1 - int(reason if reason is not None else DeclineReason.PEER_DISAGREEMENT)


def outcome_reason(code: int) -> DeclineReason:
    """The decline reason of a negative ``outcome_code``."""
    return DeclineReason(-1 - code)


OUTCOME_LEN = 3  # the op's saved outcome: [helper id, outcome code, SEQ word]
_BACKWARD_HINT = ("ranks ran the backward of different calls: autograd reached the backward exchanges in another order "
                  "on some rank (e.g. async exchanges waited in another order, or a loss that combines the outputs in "
                  "a rank-dependent order); every SP rank must run the same backward calls in the same order")
_HINTS = {
    Field.SEQ: "the ranks' call counts differ: a rank made more or fewer calls than its peers before this one (every "
               "SP rank must issue the same sequence of calls; a call-site tag names the call that differs)",
    Field.MODE: "ranks passed different (scatter_dim, gather_dim)",
    Field.PHASE: "ranks disagree on requires_grad/backward, which would also hang the NCCL route",
    Field.HEADER: "ranks run different contract versions or helper generations (rebuild collectively)",
    Field.S: "ranks passed different sequence lengths (S: the sum of seq_splits, S_local x P when even)",
    Field.SPLITS: "ranks passed different seq_splits/head_splits (each rank sees every rank's tables as a 63-bit "
                  "digest only; 'even': None or equal shares): pass the same tables on every rank",
}


class ContractMismatchError(RuntimeError):
    """Ranks called the all-to-all with different contracts (a caller bug). Raised on every rank.

    ``field``: the differing field (MODE or PHASE where MODE_PHASE differs); ``values``: each rank's value of it.
    ``per_rank``: each rank's value as text, where more is known than the field holds (a SPLITS mismatch's
    tables, once the helper has exchanged them; a SEQ mismatch's tags and counts). ``tags``: for a SEQ mismatch
    of tagged calls, the tags involved (in rank order, each once), else ``()``; ``hint`` replaces the field's."""

    def __init__(self, field: Field, values: list[int], per_rank: list[str] | None = None, *,
                 tags: Sequence[str] = (), hint: str | None = None):
        self.field, self.values, self.tags = field, values, tuple(tags)
        texts = per_rank if per_rank is not None else [_describe(field, v) for v in values]
        listed = ", ".join(f"rank {r}: {t}" for r, t in enumerate(texts))
        if hint is None:
            hint = _HINTS.get(field, "every SP rank must pass the same shape, dtype and mode")
            if field is Field.SPLITS and per_rank is not None:
                hint = "ranks passed different seq_splits/head_splits: pass the same tables on every rank"
            elif field is Field.SEQ and any(v & TAGGED for v in values):
                hint = ("a rank skipped or repeated a tagged call (each rank sees the others' tags as digests only: "
                        "every SP rank must issue the same sequence of calls)")
        super().__init__(f"Ulysses all-to-all contract mismatch on field {field.name} ({listed}): {hint}.")


def _describe(field: Field, value: int) -> str:
    if field == Field.DTYPE:  # the dtype whose code it is (the table's or a named one), looked up only to raise
        return str(next((d for d in vars(torch).values() if isinstance(d, torch.dtype) and dtype_code(d) == value),
                        value))
    if field == Field.PHASE and value in tuple(Phase):
        return Phase(value).name.lower()
    if field == Field.HEADER:
        return f"v{value >> 32}/gen{value & 0xFFFFFFFF}"
    if field == Field.SPLITS:
        return "even" if value == 0 else f"digest {value:#018x}"
    if field == Field.SEQ and value & TAGGED:
        return f"tagged call {value:#018x}"
    return str(value)


def tag_hint(tags: Sequence[str], backward: bool = False) -> str:
    """The hint of a SEQ mismatch between tagged calls: the tags involved, named."""
    named = " or ".join(repr(t) for t in tags)
    if backward:
        return f"{_BACKWARD_HINT} (the calls tagged {named})"
    return (f"a rank skipped or repeated a call tagged {named} (every SP rank must issue the same sequence of "
            "calls)")


def mismatch(field: Field, column: list[int], phases: Sequence[int] = ()) -> ContractMismatchError:
    """The error for a MUST_MATCH ``field`` whose ``column`` (every rank's value) differs: MODE_PHASE names the
    part that differs, MODE before PHASE; a SEQ mismatch between backwards (``phases``: every rank's MODE_PHASE)
    says that autograd ordered them differently, and one between a backward and a forward is named as the PHASE
    that differs (a backward carries its forward's word, so its SEQ differs from any forward's by construction)."""
    backward = [v >> PHASE_SHIFT == Phase.BACKWARD for v in phases]
    if field is Field.SEQ and backward and all(backward):
        return ContractMismatchError(field, column, hint=_BACKWARD_HINT)
    if field is Field.SEQ and any(backward):
        return ContractMismatchError(Field.PHASE, [v >> PHASE_SHIFT for v in phases])
    if field is Field.MODE_PHASE:
        modes = [v & _MODE_MASK for v in column]
        if any(m != modes[0] for m in modes):
            return ContractMismatchError(Field.MODE, modes)
        return ContractMismatchError(Field.PHASE, [v >> PHASE_SHIFT for v in column])
    return ContractMismatchError(field, column)


class PeerCallError(RuntimeError):
    """A rank-local step of the call raised on some rank before the exchange (invalid input there, a bad env value,
    the policy). Raised on every rank. ``ranks``: the SP ranks (indices in the group) that raised; ``errors``: each
    one's error as ``"Type: message"`` where the ranks exchanged them (``mismatch.with_detail``), else empty."""

    def __init__(self, ranks: list[int], errors: dict[int, str] | None = None):
        self.ranks = ranks
        self.errors = dict(errors or {})
        named = "; ".join(f"rank {r}: {e}" for r, e in sorted(self.errors.items()))
        super().__init__(f"Ulysses all-to-all: rank(s) {ranks} raised while preparing this call "
                         f"({named or 'their own traceback has the cause'}); every rank raises so that no rank is "
                         "left a call ahead of its peers.")


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


# RUN decisions are immutable: one object per plan word (no allocation per call).
_run_decision = functools.lru_cache(maxsize=256)(lambda plan_word: Decision(Verdict.RUN, plan_word=plan_word))


def decide(votes: torch.Tensor) -> Decision:
    """The collective verdict from the gathered ``[P, 12]`` int64 votes (pure; same on every rank)."""
    if votes.dim() != 2 or votes.shape[1] != NUM_FIELDS:
        raise ValueError(f"decide: votes must be [P, {NUM_FIELDS}], got {tuple(votes.shape)}")
    rows = votes.tolist()
    first = rows[0]
    if any(row != first for row in rows):
        # Ranks proposed different calls. (Identical rows, the common case, skip these checks: they cannot fail.)
        failed = [r for r, row in enumerate(rows) if row[Field.ELIGIBILITY] & DeclineReason.LOCAL_ERROR.bit]
        if failed:
            return Decision(Verdict.RAISE, error=PeerCallError(failed))
        for field in MUST_MATCH:
            column = [row[field] for row in rows]
            if any(v != column[0] for v in column):
                return Decision(Verdict.RAISE, error=mismatch(field, column, [row[Field.MODE_PHASE] for row in rows]))
        # The rows differ only in ELIGIBILITY, WINDOW_BYTES or PLAN: a decline bit every rank has wins, else the
        # ranks disagree.
        if any(row[Field.ELIGIBILITY] != first[Field.ELIGIBILITY] for row in rows) or not first[Field.ELIGIBILITY]:
            return Decision(Verdict.DECLINE, reason=DeclineReason.PEER_DISAGREEMENT)
    bits = first[Field.ELIGIBILITY]
    if bits & DeclineReason.LOCAL_ERROR.bit:  # every rank failed (one that did not would differ)
        return Decision(Verdict.RAISE, error=PeerCallError(list(range(len(rows)))))
    if bits:
        return Decision(Verdict.DECLINE, reason=reasons_from_bits(bits)[0])
    if first[Field.PLAN] == 0:
        # Eligible but no plan: only a policy bug gets here; never run without one.
        return Decision(Verdict.DECLINE, reason=DeclineReason.WINDOW)
    return _run_decision(first[Field.PLAN])
