"""From a call's signature to this rank's proposal: pure, and cached per signature by the helper.

A proposal is what this rank puts to the vote for one call: its 12 fields (``contract.py``, sequence
number left 0) and the plan it would run, or the decline bits that say why it would not. It depends only
on the call's signature (shape, dtype, device, mode, phase, the forward's outcome for a backward, capture,
contiguity, alignment, the split tables) and on what is fixed per helper (``PlanConfig``: SP size,
generation, GPU, window, tuned rows, the agreed long-training policy, what the transport can do). So
every DiT layer after the first gets its proposal from one dict lookup, and two ranks with the same
signature and configuration propose the same fields.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from fastvideo.distributed.all_to_all import EVEN, Splits
from fastvideo.distributed.ulysses import contract, policy
from fastvideo.distributed.ulysses.caches import bounded_put
from fastvideo.distributed.ulysses.contract import DeclineReason, Phase
from fastvideo.distributed.ulysses.policy import ENGINE_CE, Choice, Geometry, Plan, TunedRow, choose_plan
from fastvideo.distributed.ulysses.transport import ENTRY_CE, ENTRY_CE_CAPTURE, ENTRY_TUNED, ENTRY_UNEVEN

CACHE_LIMIT = 4096  # signatures per helper: a job has few; a pathological one re-plans


class Signature(NamedTuple):
    """What a proposal depends on, per call. ``outcome``: a backward's forward outcome
    (``contract.outcome_code``), None for a forward; ``splits``: the tables ``validate_input`` returned."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    mode: int
    phase: Phase
    outcome: int | None
    capturing: bool
    contiguous: bool
    aligned: bool
    splits: Splits = EVEN


class PlanConfig(NamedTuple):
    """What is fixed per helper (identical on every rank of a helper that was built)."""

    world_size: int
    generation: int
    gpu: str
    window_bytes: int
    long_training: str  # the agreed FASTVIDEO_ULYSSES_A2A_LONG_TRAINING
    table: tuple[TunedRow, ...]  # the rows an eager call plans from
    capture_table: tuple[TunedRow, ...]  # the rows a CUDA-graph capture plans from
    capture_engines: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...]  # what the transport moves
    device: torch.device
    declined: DeclineReason | None  # a construction decline: every call declines it (checked mode still votes)
    capture_decline: Callable[[Geometry, Plan], str | None] | None  # the transport's, None: cannot capture
    uneven: bool = False  # the transport runs plans for uneven split tables (it offers ENTRY_UNEVEN)


class Proposal(NamedTuple):
    geom: Geometry | None
    plan: Plan | None  # None: this rank declines (the bits in fields[ELIGIBILITY] say why)
    fields: tuple[int, ...]  # the 12 vote fields, SEQ = 0
    why: str  # why a capture cannot freeze the plan here (logged with the decline), else ""
    error: BaseException | None = None  # proposing failed here (a bug): voted LOCAL_ERROR, never cached
    chunks: int = 0  # the plan's chunk count on geom (0 without a plan), for the call's record


def tables(table: Sequence[TunedRow], entries: frozenset[str] | None,
           capture_engines: Sequence[str]) -> tuple[tuple[TunedRow, ...], tuple[TunedRow, ...]]:
    """(eager rows, capture rows) of ``table`` for a transport offering ``entries`` (None: not probed). A build
    with only the original entry point plans from no rows (the original plan); one without the copy-engine
    kind, or a capture that may not freeze it, plans from the SM rows (a key lists its copy-engine row
    first, then its SM row)."""
    table = tuple(table)
    if entries is None:
        return table, table
    if ENTRY_TUNED not in entries:
        return (), ()
    sm_rows = tuple(row for row in table if row.engine != ENGINE_CE)
    eager = table if ENTRY_CE in entries else sm_rows
    capture_ce = ENGINE_CE in capture_engines and ENTRY_CE in entries and ENTRY_CE_CAPTURE in entries
    return eager, (table if capture_ce else sm_rows)


def choose(cfg: PlanConfig, geom: Geometry, *, grad: bool, capturing: bool = False,
           long_training: str | None = None) -> Choice:
    """The policy's choice for ``geom`` under ``cfg`` (``long_training`` overrides the agreed value)."""
    return choose_plan(geom, gpu=cfg.gpu, window_bytes=cfg.window_bytes, grad=grad,
                       long_training=cfg.long_training if long_training is None else long_training,
                       table=cfg.capture_table if capturing else cfg.table)


# Plans are immutable: one object per agreed word (no validation and allocation per call).
plan_from_word: Callable[[int], Plan] = functools.lru_cache(maxsize=1024)(Plan.from_word)


def propose(cfg: PlanConfig, sig: Signature) -> Proposal:
    """This rank's proposal for a call of signature ``sig``. Pure; raises only on a bug (``Planner.propose`` then
    votes LOCAL_ERROR, so every rank raises together)."""
    geom = Geometry.from_input(sig.shape, sig.mode, cfg.world_size, sig.dtype, seq_splits=sig.splits.seq,
                               head_splits=sig.splits.heads)
    plan: Plan | None = None
    why = ""
    if cfg.declined is not None:
        bits = cfg.declined.bit
    else:
        bits = ((DeclineReason.DTYPE.bit if sig.dtype not in cfg.dtypes else 0)
                | (DeclineReason.NON_CONTIGUOUS.bit if not sig.contiguous else 0)
                | (DeclineReason.DEVICE.bit if sig.device != cfg.device else 0)
                | (DeclineReason.ALIGNMENT.bit if not sig.aligned else 0)
                | (DeclineReason.UNEVEN_SPLITS.bit if geom.uneven and not cfg.uneven else 0))
        if not bits and sig.outcome is not None:  # a backward runs its forward's plan, never a re-decision
            if sig.outcome > 0:
                plan = plan_from_word(sig.outcome)
            else:
                bits = contract.outcome_reason(sig.outcome).bit
        elif not bits:
            choice = choose(cfg, geom, grad=sig.phase == Phase.FORWARD_GRAD, capturing=sig.capturing)
            plan = choice.plan
            if plan is None:
                bits = (choice.reason or DeclineReason.WINDOW).bit
        if sig.capturing and plan is not None:
            # Frozen into the graph only when its kind may be captured (also for a backward, whose plan is its
            # forward's, chosen eagerly) and this rank's transport can capture it with no host work per call.
            why = (f"the {plan.engine} plan kind is not among capture_engines {cfg.capture_engines}"
                   if plan.engine not in cfg.capture_engines else "")
            if not why:
                why = (cfg.capture_decline(geom, plan) if cfg.capture_decline is not None
                       else "this transport cannot capture") or ""
            if why:
                bits |= DeclineReason.CUDA_GRAPH_CAPTURE.bit
                plan = None  # a plan is made only where no other bit is set: this one is the bit that drops it
    row = contract.fields(cfg.generation, 0, bits, sig.mode, sig.dtype, (geom.B, geom.S_global, geom.H, geom.D),
                          sig.phase, plan.window_bytes(geom) if plan is not None else 0,
                          plan.word if plan is not None else 0, sig.capturing,
                          contract.splits_digest(geom.seq_table, geom.head_table))
    return Proposal(geom, plan, tuple(row), why, None, plan.num_chunks(geom) if plan is not None else 0)


class Planner:
    """One helper's planning state on this rank: its ``PlanConfig`` and the proposals cached per signature.
    Local. The three knobs (``table``, ``capture_engines``, ``long_training``) must be set identically on every
    rank: a rank that differs proposes another plan, and every rank then declines ``peer_disagreement``
    together. Setting one replans (the cache is dropped)."""

    def __init__(self, config: PlanConfig, table: Sequence[TunedRow], entries: frozenset[str] | None) -> None:
        self._table, self._entries = tuple(table), entries
        self.config = config._replace(uneven=entries is not None and ENTRY_UNEVEN in entries)  # fixed with the build
        self.cache: dict[Signature, Proposal] = {}  # the call reads it directly: one dict lookup per call
        self.on_replan: Callable[[], None] | None = None  # told when the cache is dropped (the helper's hot path)
        self._replan()

    def propose(self, sig: Signature) -> Proposal:
        """``propose`` for this helper, cached per signature. Where it raises (a bug), the proposal votes
        ``LOCAL_ERROR`` and carries the error (never cached), so that every rank raises it after the vote."""
        proposal = self.cache.get(sig)
        if proposal is None:
            try:
                proposal = propose(self.config, sig)
            except Exception as exc:  # noqa: BLE001 - voted, raised on every rank after the vote, never alone
                row = contract.fields(self.config.generation, 0, DeclineReason.LOCAL_ERROR.bit, sig.mode, sig.dtype,
                                      tuple(sig.shape), sig.phase)
                return Proposal(None, None, tuple(row), "", exc)
            bounded_put(self.cache, sig, proposal, CACHE_LIMIT)
        return proposal

    def replace(self, **changes) -> None:
        """Change configuration fields (``PlanConfig._replace``) and replan."""
        self.config = self.config._replace(**changes)
        self.cache.clear()
        if self.on_replan is not None:
            self.on_replan()

    def _replan(self, **changes) -> None:
        eager, capture = tables(self._table, self._entries, changes.get("capture_engines", self.config.capture_engines))
        self.replace(table=eager, capture_table=capture, **changes)

    @property
    def table(self) -> tuple[TunedRow, ...]:
        return self._table

    @table.setter
    def table(self, rows: Sequence[TunedRow]) -> None:
        self._table = tuple(rows)
        self._replan()

    @property
    def capture_engines(self) -> tuple[str, ...]:
        return self.config.capture_engines

    @capture_engines.setter
    def capture_engines(self, engines: Sequence[str]) -> None:
        for engine in engines:
            policy.check_engine("capture_engines", engine)
        self._replan(capture_engines=tuple(engines))

    @property
    def long_training(self) -> str:
        return self.config.long_training

    @long_training.setter
    def long_training(self, value: str) -> None:
        if value not in ("auto", "chunked"):
            raise ValueError(f"long_training={value!r}: choose 'auto' or 'chunked'.")
        self.replace(long_training=value)


def delegate(name: str, doc: str) -> property:
    """A helper property that reads and sets ``Planner.<name>``."""
    return property(lambda self: getattr(self.planner, name), lambda self, v: setattr(self.planner, name, v), doc=doc)
