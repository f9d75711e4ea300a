#!/usr/bin/env python3
"""One-GPU faithful check of the fused all-to-all: the real chunk loop, P ranks in ONE launch.

``fvk_sim_a2a`` (the test library's: ``fastvideo_kernel.testing.load``, the test library beside the product
library, or ``$FASTVIDEO_KERNEL_TESTING_LIBRARY``) runs the fused kernel's own body (``run_call`` in
movement.cuh) with P simulated ranks as CTA groups of a single launch of P x ctas co-resident CTAs on one
GPU. Each group has its own input, window and output; the barrier between them is a same-device barrier
with the LSA barrier's per-CTA semantics (slot i synchronises CTA i of every rank, nothing else, epochs
persist across chunks and calls), and consecutive calls are ordered per rank as its stream would order them.
So a missing or too-weak barrier argument shows up here; the pre-2026-11-29 check separated every
phase with a kernel launch, a full barrier that hid exactly the bug 2x H200 found.

Every case runs twice, both times with random skew (delays around every barrier, so CTA indices
drift apart as they can on real hardware):
* plain: every call's every rank's output is compared bit for bit with the all-to-all's definition
  (every rank's input concatenated along the dimension it splits, this rank's share sliced out; the CPU tests
  check it equals the NCCL route's exchange, ``layout.reference_all_to_all``); windows and outputs start
  poisoned (0xFF: NaN in every dtype, never in the inputs) and the bytes past the plan's window must stay so;
* epoch-checked: the kernel stamps every window granule at copy-out and a store asserts the stamp it
  overwrites (``FVK_SIM_EPOCH_CHECK``): any byte two CTA indices could race on is reported on every
  schedule, whether or not the data happened to be corrupted; outputs are compared as well.

Coverage: bf16/fp16/fp32, both modes, P = 2..8, B = 1..4, whole-operand, one-plane, uneven-plane and
uneven sub-plane chunk plans (a smaller last chunk, multi-plane row chunks, one row per chunk), CTA
counts 1..144 (as many as P x ctas co-resident CTAs allow), 16-byte aligned rows (D=128) and rows
only 2/4/8-byte aligned, a rank whose input pointer is misaligned (narrower vectors through the same
partition), and sequences of consecutive calls whose CTA counts and plans differ.

Uneven splits (``--set uneven``): P = 2..8, both modes, every dtype, uneven sequence shares, uneven head
shares and both, with shares of 0 (a rank with no rows, one with no heads, one with neither: it moves nothing
and still meets every barrier), chunks over the largest share (a shorter share contributes fewer rows or
none), aligned and 2-byte-aligned rows, a misaligned rank, and sequences mixing even and uneven calls whose
tables, modes and plans differ. The same case list runs on the CPU through the test library's host checks
(tests/kernel/test_sim_cases.py: the kernels' addressing and barrier points on exactly these descriptions).

Negative controls: the pre-fix window layout (``FVK_SIM_MOVING_LAYOUT``) must be reported by the
epoch checker on every uneven plan and every seed, and on uneven split tables (blocks of different sizes
overlap there); a flipped reference bit and a wrong peer order must be caught; a window one byte short,
ctas=0 and a launch too large to be co-resident are refused.

    FASTVIDEO_KERNEL_LIBRARY=build/kernel/libfastvideo_ulysses_a2a.so python tests/kernel/check_sim_peers.py
    python tests/kernel/check_sim_peers.py --json out.json [--quick] [--set even|uneven|all]

Exits non-zero on any failure.
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
try:
    import fastvideo_kernel
except ImportError:  # a checkout without the wheel installed: use the loader from the source tree
    sys.path.insert(0, str(REPO / "fastvideo-kernel"))
    import fastvideo_kernel
import torch  # noqa: E402
from fastvideo_kernel import testing as kernel_testing  # noqa: E402

from fastvideo.distributed.ulysses.launch import call_description  # noqa: E402
from fastvideo.distributed.ulysses.policy import Geometry, Plan  # noqa: E402

BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
GUARD_BYTES = 256  # past the plan's window: must stay poisoned (no chunk writes beyond its size)
POISON = 0xFF
SKEW, EPOCH, MOVING = kernel_testing.SIM_SKEW, kernel_testing.SIM_EPOCH_CHECK, kernel_testing.SIM_MOVING_LAYOUT


@dataclass(frozen=True)
class Operand:
    """One call's data shape: every simulated rank's input and the reference outputs. Even unless a split table
    is given: ``seq_splits`` every rank's sequence rows (the largest is ``S``), ``head_splits`` every rank's heads
    (``heads_local`` is unused then)."""

    dtype: torch.dtype
    mode: int
    world: int
    B: int
    S: int  # S_local: the largest sequence share
    heads_local: int
    D: int
    misaligned_rank: int = -1  # this rank's input starts one element past an aligned address
    seq_splits: tuple[int, ...] | None = None
    head_splits: tuple[int, ...] | None = None

    @property
    def H(self) -> int:
        return sum(self.head_splits) if self.head_splits is not None else self.heads_local * self.world

    @property
    def uneven_splits(self) -> bool:
        return self.seq_splits is not None or self.head_splits is not None

    def seq(self, rank: int) -> int:
        return self.seq_splits[rank] if self.seq_splits is not None else self.S

    def heads(self, rank: int) -> int:
        return self.head_splits[rank] if self.head_splits is not None else self.heads_local

    def geometry(self) -> Geometry:
        return Geometry(self.mode, self.dtype, self.B, self.S, self.H, self.D, self.world, self.seq_splits,
                        self.head_splits)

    def input_shape(self, rank: int) -> tuple[int, int, int, int]:
        total = sum(self.seq(r) for r in range(self.world))
        if self.mode == 0:
            return (self.B, self.seq(rank), self.H, self.D)
        return (self.B, total, self.heads(rank), self.D)

    def output_shape(self, rank: int) -> tuple[int, int, int, int]:
        total = sum(self.seq(r) for r in range(self.world))
        if self.mode == 0:
            return (self.B, total, self.heads(rank), self.D)
        return (self.B, self.seq(rank), self.H, self.D)

    def label(self) -> str:
        dt = str(self.dtype).removeprefix("torch.")
        mis = f" misaligned@{self.misaligned_rank}" if self.misaligned_rank >= 0 else ""
        heads = f"heads{list(self.head_splits)}" if self.head_splits is not None else f"Hl{self.heads_local}"
        seq = f" seq{list(self.seq_splits)}" if self.seq_splits is not None else ""
        return f"{dt} mode{self.mode} P{self.world} B{self.B} S{self.S}{seq} {heads} D{self.D}{mis}"


@dataclass(frozen=True)
class Call:
    operand: Operand
    plan: Plan
    plan_name: str

    def label(self) -> str:
        p = self.plan
        return f"{self.operand.label()} {self.plan_name}({p.planes_per_chunk}x{p.rows_per_chunk}) ctas={p.ctas}"

    def uneven(self) -> bool:
        geom = self.operand.geometry()
        return len({(p1 - p0) * (r1 - r0) for p0, p1, r0, r1 in self.plan.chunks(geom)}) > 1


@dataclass(frozen=True)
class Case:
    calls: tuple[Call, ...]

    def label(self) -> str:
        return " ; ".join(c.label() for c in self.calls)

    def window_bytes(self) -> int:
        return max(c.plan.window_bytes(c.operand.geometry()) for c in self.calls)

    def max_ctas(self) -> int:
        return max(c.plan.ctas for c in self.calls)


def random_bits(numel: int, dtype: torch.dtype, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """Random bit patterns of ``dtype`` that are never zero and never the all-ones poison."""
    bits = BITS[dtype]
    width = torch.iinfo(bits).bits
    values = torch.randint(1, (1 << width) - 1, (numel,), generator=gen, dtype=torch.int64)
    values = torch.where(values >= 1 << (width - 1), values - (1 << width), values)  # two's complement
    return values.to(bits).to(device).view(dtype)


def make_inputs(op: Operand, gen: torch.Generator, device: torch.device) -> list[torch.Tensor]:
    inputs = []
    for rank in range(op.world):
        shape = op.input_shape(rank)
        numel = shape[0] * shape[1] * shape[2] * shape[3]
        flat = random_bits(numel + 1, op.dtype, gen, device)
        start = 1 if rank == op.misaligned_rank else 0
        inputs.append(flat[start:start + numel].view(shape))
    return inputs


def references(op: Operand, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The oracle, on raw bits (the exchange is pure data movement): the all-to-all's definition. Mode 0: every
    rank's rows concatenated into the whole sequence, rank r's heads sliced out; mode 1: every rank's heads
    concatenated, rank r's rows sliced out."""
    bits = BITS[op.dtype]
    whole = torch.cat([x.view(bits) for x in inputs], dim=1 if op.mode == 0 else 2)
    at = list(itertools.accumulate((op.heads(r) if op.mode == 0 else op.seq(r) for r in range(op.world)),
                                   initial=0))
    if op.mode == 0:
        return [whole[:, :, at[r]:at[r + 1]].contiguous() for r in range(op.world)]
    return [whole[:, at[r]:at[r + 1]].contiguous() for r in range(op.world)]


def plans(B: int, S: int) -> list[tuple[str, int, int]]:
    """(name, planes_per_chunk, rows_per_chunk): even and uneven chunkings of a [B, S] operand."""
    out = [("whole", B, S), ("plane", 1, S)]
    if B > 2:
        out.append(("planes2", 2, S))  # 2 planes, then 1 (h3-32k at 2 planes per chunk on 2x H200)
    if S > 1:
        out.append(("rows", 1, (S + 1) // 2))  # the last chunk is smaller
        out.append(("rows1", 1, 1))
        if B > 1:
            out.append(("planes2_rows", 2, S - 1))
    return out


def fit(world: int, ctas: int, coresident: int) -> int:
    """``ctas`` capped so that ``world`` x ctas simulation CTAs are co-resident."""
    return max(1, min(ctas, coresident // world))


def build_cases(quick: bool = False, coresident: int = 1188, which: str = "all") -> list[Case]:
    """The matrix (``which``: the even cases, the uneven ones or all); CTA counts are capped so that P x ctas CTAs
    are co-resident on the device."""
    cases = build_even_cases(quick, coresident) if which in ("even", "all") else []
    return cases + (build_uneven_cases(quick, coresident) if which in ("uneven", "all") else [])


def build_even_cases(quick: bool, coresident: int) -> list[Case]:
    """Even split tables (every share S rows, H / P heads)."""
    worlds = (2, 3, 8) if quick else tuple(range(2, 9))
    dtypes = (torch.bfloat16, torch.float32) if quick else DTYPES
    aligned_b = (1, 3) if quick else (1, 2, 3, 4)
    aligned_ctas = (36, 144) if quick else (1, 5, 36, 144)
    unaligned_shapes = ((7, 1, 3),) if quick else ((7, 1, 3), (3, 3, 5), (5, 1, 4))
    unaligned_b = (3,) if quick else (1, 3)
    unaligned_ctas = (144,) if quick else (7, 144)
    cases: list[Case] = []

    def add(op: Operand, ctas_list: tuple[int, ...]) -> None:
        for name, planes, rows in plans(op.B, op.S):
            for ctas in dict.fromkeys(fit(op.world, c, coresident) for c in ctas_list):
                cases.append(Case((Call(op, Plan(ctas, planes, rows, tuned=True), name),)))

    for dtype in dtypes:
        for mode in (0, 1):
            for world in worlds:
                for b in aligned_b:
                    add(Operand(dtype, mode, world, b, 5, 2, 128), aligned_ctas)
                for s, hl, d in unaligned_shapes:
                    for b in unaligned_b:
                        add(Operand(dtype, mode, world, b, s, hl, d), unaligned_ctas)
                add(Operand(dtype, mode, world, 3, 5, 2, 128, misaligned_rank=1), (144,))
                # Consecutive calls: another CTA count, another chunking, another mode and shape.
                a = Operand(dtype, mode, world, 3, 9, 2, 128)
                b2 = Operand(dtype, 1 - mode, world, 2, 6, 1, 64)
                cases.append(Case((Call(a, Plan(fit(world, 144, coresident), 2, 9, tuned=True), "planes2"),
                                   Call(a, Plan(fit(world, 36, coresident), 1, 4, tuned=True), "rows"),
                                   Call(b2, Plan(fit(world, 5, coresident), 2, 6, tuned=True), "whole"))))
            if not quick:
                # Larger operands: many units per thread, so the strided, unrolled loop, partial
                # unroll tails and CTA slices that end mid-row all run (the small cases fit in one pass).
                for world in (2, 4, 7):
                    for planes, rows, name in ((3, 1000, "whole"), (2, 1000, "planes2"), (1, 333, "rows")):
                        op = Operand(dtype, mode, world, 3, 1000, 7, 128)
                        for ctas in (36, 144):
                            plan = Plan(fit(world, ctas, coresident), planes, rows, tuned=True)
                            cases.append(Case((Call(op, plan, name),)))
                    op = Operand(dtype, mode, world, 2, 999, 5, 3)
                    cases.append(Case((Call(op, Plan(fit(world, 144, coresident), 1, 400, tuned=True), "rows"),)))
    return cases


def split_tables(rng: random.Random, world: int, largest: int, heads: int, kind: str, zero: bool):
    """(seq_splits, head_splits) of one kind ("both", "seq", "heads": which tables are uneven; the other is None,
    the even one). Uneven sequence shares lie in [0, ``largest``] with one of them ``largest``; uneven head shares
    sum to ``heads``. With ``zero``: one rank has no rows and another no heads, and at P >= 3 a third has
    neither (where both tables are uneven). Deterministic for a seeded ``rng``."""
    ranks = list(range(world))
    rng.shuffle(ranks)
    seq = heads_t = None
    if kind in ("both", "seq"):
        table = [rng.randint(1, largest) for _ in range(world)]
        table[ranks[0]] = largest
        if zero:
            table[ranks[1]] = 0
            if kind == "both" and world >= 3:
                table[ranks[2]] = 0
        if len(set(table)) == 1:  # uneven, always
            table[ranks[1]] = largest - 1
        seq = tuple(table)
    if kind in ("both", "heads"):
        idle = ({ranks[0]} | ({ranks[2]} if kind == "both" and world >= 3 else set())) if zero else set()
        busy = [r for r in range(world) if r not in idle]
        table = [0] * world
        for r in busy:
            table[r] = 1
        for _ in range(heads - len(busy)):  # the rest at random: shares of different sizes
            table[rng.choice(busy)] += 1
        if len(set(table)) == 1:
            table[busy[0]] += 1
            table[busy[-1]] -= 1
        heads_t = tuple(table)
    return seq, heads_t


def build_uneven_cases(quick: bool, coresident: int) -> list[Case]:
    """Uneven split tables: P = 2..8, both modes, every dtype, each table uneven alone and both together, shares of
    0, aligned and 2-byte-aligned rows, a misaligned rank, and consecutive calls mixing even and uneven tables.
    The dtype only sets the unit sizes, so the single calls take the dtypes in turn (the sequences take each)."""
    rng = random.Random(20261201)
    worlds = (2, 3, 8) if quick else tuple(range(2, 9))
    dtypes = (torch.bfloat16, torch.float32) if quick else DTYPES
    kinds = (("both", True), ("seq", True), ("heads", False)) if quick else (
        ("both", True), ("both", False), ("seq", True), ("heads", True))
    # (B, largest sequence share, heads per rank (P x this, plus one where the head table is uneven), D, CTAs)
    shapes = ((3, 7, 2, 128, (36, 144)),) if quick else ((1, 9, 2, 128, (36, 144)), (3, 7, 2, 128, (5, 144)),
                                                        (2, 5, 1, 3, (144,)))
    cases: list[Case] = []
    turn = itertools.cycle(dtypes)
    for mode, world in itertools.product((0, 1), worlds):
        for (kind, zero), (b, largest, per_rank, d, ctas_list) in itertools.product(kinds, shapes):
            heads = per_rank * world + (kind != "seq")  # an uneven head table: heads P does not divide
            seq, head = split_tables(rng, world, largest, heads, kind, zero)
            op = Operand(next(turn), mode, world, b, largest, heads // world, d, seq_splits=seq, head_splits=head)
            for name, planes, rows in plans(b, largest):
                for ctas in dict.fromkeys(fit(world, c, coresident) for c in ctas_list):
                    cases.append(Case((Call(op, Plan(ctas, planes, rows, tuned=True), name),)))
        for dtype in dtypes:
            # A misaligned rank (narrower vectors) that holds a share of its own, and one with a share of 0.
            seq, head = split_tables(rng, world, 6, 3 * world + 1, "both", True)
            for rank in (seq.index(max(seq)), seq.index(0)):
                op = Operand(dtype, mode, world, 3, 6, 3, 128, misaligned_rank=rank, seq_splits=seq, head_splits=head)
                cases.append(Case((Call(op, Plan(fit(world, 144, coresident), 1, 4, tuned=True), "rows"),)))
            # Consecutive calls: uneven, even and uneven again, with other tables, modes, CTA counts and chunking.
            seq_a, head_a = split_tables(rng, world, 9, 2 * world + 1, "both", True)
            seq_b, head_b = split_tables(rng, world, 6, world + 1, "both", False)
            a = Operand(dtype, mode, world, 3, 9, 2, 128, seq_splits=seq_a, head_splits=head_a)
            even = Operand(dtype, 1 - mode, world, 2, 6, 1, 64)
            c = Operand(dtype, 1 - mode, world, 2, 6, 1, 64, seq_splits=seq_b, head_splits=head_b)
            cases.append(Case((Call(a, Plan(fit(world, 144, coresident), 2, 9, tuned=True), "planes2"),
                               Call(even, Plan(fit(world, 36, coresident), 1, 4, tuned=True), "rows"),
                               Call(c, Plan(fit(world, 5, coresident), 2, 6, tuned=True), "whole"),
                               Call(a, Plan(fit(world, 36, coresident), 1, 2, tuned=True), "rows"))))
    return cases


@dataclass
class Result:
    label: str
    ok: bool
    detail: str
    seconds: float
    violations: int = 0
    extra: dict = field(default_factory=dict)


@dataclass
class Run:
    status: int
    message: str
    report: list[int]
    outs: list[list[torch.Tensor]]  # per call, per rank
    windows: list[torch.Tensor]

    @property
    def violations(self) -> int:
        return self.report[0]

    def first_violation(self) -> str:
        r = self.report
        if not r[0]:
            return ""
        kind = {1: "store", 2: "copy-out"}.get(r[1] & 0xFF, "?")
        return (f"{r[0]} epoch violation(s); first: {kind} by rank {r[1] >> 8 & 0xFF} (peer {r[1] >> 16 & 0xFF}) "
                f"granule {r[2]}, found stamp {r[3]:#x}, wrote {r[4]:#x}")


def descriptions(case: Case, ctas: int | None = None) -> tuple[list, list]:
    """Every call's ``fvk_call`` as the native transport describes it (``launch.call_description``: geometry,
    split tables, plan; an SM-kind call), and the split tables they point at (keep them alive as long as the
    descriptions). ``ctas`` overrides every call's CTA count (to test refusals). The simulation and the CPU
    host checks of this case list (tests/kernel/test_sim_cases.py) run exactly these."""
    descs, keep = [], []
    for call in case.calls:
        geom = call.operand.geometry()
        desc, tables = call_description(fastvideo_kernel, geom, call.operand.dtype, kind=fastvideo_kernel.KIND_SM,
                                        ctas=call.plan.ctas if ctas is None else ctas,
                                        planes=call.plan.planes_per_chunk, rows=call.plan.rows_per_chunk)
        descs.append(desc)
        keep.append(tables)
    return descs, keep


class SimRunner:
    """Runs ``fvk_sim_a2a`` on poisoned windows and outputs and checks the result."""

    def __init__(self, lib: ctypes.CDLL, device: torch.device, seed: int = 1) -> None:
        self.lib, self.device, self.seed = lib, device, seed

    def run(self, case: Case, inputs: list[list[torch.Tensor]], flags: int, window_bytes: int | None = None,
            seed: int | None = None, ctas: int | None = None) -> Run:
        """One simulated launch; ``ctas`` overrides every call's CTA count (to test refusals)."""
        world = case.calls[0].operand.world
        need = case.window_bytes() if window_bytes is None else window_bytes
        windows = [torch.full((max(need, 0) + GUARD_BYTES,), POISON, dtype=torch.uint8, device=self.device)
                   for _ in range(world)]
        outs = []
        calls = (kernel_testing.SimCall * len(case.calls))()
        descs, tables = descriptions(case, ctas)
        for n, call in enumerate(case.calls):
            op = call.operand
            per_rank = [torch.empty(op.output_shape(r), dtype=op.dtype, device=self.device) for r in range(world)]
            for out in per_rank:
                out.view(torch.uint8).fill_(POISON)
            outs.append(per_rank)
            c = calls[n]
            c.call = descs[n]
            for r in range(world):  # an empty operand (a share of 0) as null: the library reads nothing there
                c.x[r] = inputs[n][r].data_ptr() if inputs[n][r].numel() else None
                c.out[r] = per_rank[r].data_ptr() if per_rank[r].numel() else None
        report = (ctypes.c_uint64 * 5)()
        table = (ctypes.c_void_p * world)(*(w.data_ptr() for w in windows))
        self.seed += 1
        status = self.lib.fvk_sim_a2a(world, len(case.calls), calls, table, need, flags, 0,
                                      self.seed if seed is None else seed, report,
                                      torch.cuda.current_stream(self.device).cuda_stream)
        torch.cuda.synchronize(self.device)
        del tables  # read by the launch (its Problems hold their own copies of the shares)
        message = fastvideo_kernel.last_error(self.lib) if status else ""
        return Run(status, message, list(report), outs, windows)

    def check(self, case: Case, inputs: list[list[torch.Tensor]], refs: list[list[torch.Tensor]],
              flags: int) -> tuple[str, int]:
        """('' when every output matches bit for bit, the guards hold and no epoch violation, else why; violations)."""
        run = self.run(case, inputs, flags)
        if run.status:
            return f"fvk_sim_a2a returned {run.status}: {run.message}", 0
        problems = [compare(outs, ref, call.operand.dtype, f"call {n} ")
                    for n, (call, outs, ref) in enumerate(zip(case.calls, run.outs, refs, strict=True))]
        need = case.window_bytes()
        for rank, window in enumerate(run.windows):
            if not bool((window[need:] == POISON).all()):
                problems.append(f"rank {rank} wrote past its {need}-byte window")
        problems.append(run.first_violation())
        return "; ".join(p for p in problems if p), run.violations


def compare(outs: list[torch.Tensor], refs: list[torch.Tensor], dtype: torch.dtype, where: str = "") -> str:
    """'' if every output equals its reference bit for bit, else the first differences."""
    bits = BITS[dtype]
    problems = []
    for rank, (out, ref) in enumerate(zip(outs, refs, strict=True)):
        got = out.view(bits)
        if got.shape != ref.shape:
            problems.append(f"{where}rank {rank}: shape {tuple(got.shape)} != {tuple(ref.shape)}")
        elif not torch.equal(got, ref):
            bad = (got != ref).nonzero()
            poisoned = int((got == -1).sum())
            problems.append(f"{where}rank {rank}: {bad.shape[0]} of {ref.numel()} elements differ "
                            f"({poisoned} still poisoned), first at {tuple(bad[0].tolist())}")
    return "; ".join(problems)


def data(case: Case, gen: torch.Generator, device: torch.device):
    inputs = [make_inputs(c.operand, gen, device) for c in case.calls]
    return inputs, [references(c.operand, x) for c, x in zip(case.calls, inputs, strict=True)]


# The pre-fix layout's negative controls: plans whose chunks differ in size (the bug 2x H200 found), and uneven split
# tables whose chunks are all one size (the blocks of different pairs differ in size there: the pre-fix layout's
# regions, at each block's own stride, overlap). The CPU tests check the host property check flags each of them.
MOVING_CASES = (
    Case((Call(Operand(torch.bfloat16, 0, 2, 3, 64, 28, 128), Plan(36, 2, 64, tuned=True), "planes2"),)),
    Case((Call(Operand(torch.bfloat16, 1, 2, 1, 250, 28, 128), Plan(144, 1, 150, tuned=True), "rows"),)),
    Case((Call(Operand(torch.float32, 0, 4, 4, 7, 1, 3), Plan(72, 1, 3, tuned=True), "rows"),)),
    Case((Call(Operand(torch.bfloat16, 0, 4, 1, 8, 0, 128, seq_splits=(8, 3, 0, 5), head_splits=(1, 4, 2, 3)),
               Plan(36, 1, 8, tuned=True), "whole"),)),
    Case((Call(Operand(torch.bfloat16, 1, 3, 2, 12, 0, 64, seq_splits=(12, 7, 12), head_splits=(5, 0, 2)),
               Plan(72, 1, 4, tuned=True), "rows"),)),
)


def negative_controls(runner: SimRunner, device: torch.device, gen: torch.Generator, coresident: int,
                      seeds: int = 8) -> list[Result]:
    """The checks must catch known-bad kernels and results; the C API must refuse bad launches."""
    results = []

    def expect(label: str, failure: str, **extra) -> None:
        results.append(Result(f"negative control: {label}", bool(failure), failure or "NOT caught", 0.0,
                              extra=extra))

    # The pre-fix layout: 2x H200 gave wrong data on uneven plans. The epoch checker must report it
    # on every seed (it flags the shared bytes whichever access comes first).
    corrupted_runs = 0
    for case in MOVING_CASES:
        assert all(c.uneven() or c.operand.uneven_splits for c in case.calls)
        inputs, refs = data(case, gen, device)
        flagged = 0
        for seed in range(seeds):
            run = runner.run(case, inputs, SKEW | EPOCH | MOVING, seed=seed)
            flagged += run.status == 0 and run.violations > 0
            plain = runner.run(case, inputs, SKEW | MOVING, seed=seed)
            corrupted_runs += plain.status == 0 and bool(compare(plain.outs[0], refs[0], case.calls[0].operand.dtype))
        expect(f"pre-fix layout reported by the epoch checker on {flagged}/{seeds} seeds: {case.label()}",
               f"flagged on {flagged}/{seeds} seeds" if flagged == seeds else "")
    # Informational: how often the pre-fix layout actually corrupted data in this simulation.
    results.append(Result("info: pre-fix layout corrupted outputs (skew, no checker)", True,
                          f"{corrupted_runs} of {len(MOVING_CASES) * seeds} runs", 0.0))

    case = Case((Call(Operand(torch.bfloat16, 0, 4, 2, 5, 2, 128), Plan(144, 1, 3, tuned=True), "rows"),))
    inputs, refs = data(case, gen, device)
    corrupted = [r.clone() for r in refs[0]]
    flat = corrupted[2].view(-1)
    flat[flat.numel() // 2] ^= 1
    baseline = runner.check(case, inputs, refs, SKEW)[0]
    results.append(Result("negative controls' baseline passes", not baseline, baseline, 0.0))
    expect("one flipped bit in rank 2's reference", runner.check(case, inputs, [corrupted], SKEW)[0])
    expect("peers' inputs in the wrong order", runner.check(case, [inputs[0][::-1]], refs, SKEW)[0])
    run = runner.run(case, inputs, 0, window_bytes=case.window_bytes() - 1)
    expect("window one byte too small is refused", f"status {run.status}: {run.message}" if run.status else "")
    run = runner.run(case, inputs, 0, ctas=0)
    expect("ctas=0 is refused", f"status {run.status}: {run.message}" if run.status else "")
    big = Case((Call(Operand(torch.bfloat16, 0, 8, 1, 5, 2, 128), Plan(144, 1, 5, tuned=True), "whole"),))
    if 8 * 144 > coresident:
        big_inputs, _ = data(big, gen, device)
        run = runner.run(big, big_inputs, 0)
        expect("a launch too large to be co-resident is refused",
               f"status {run.status}: {run.message}" if run.status == 4 else "")
    return results


def run_all(cases: list[Case], lib: ctypes.CDLL, device: torch.device, coresident: int,
            log: Callable[[str], None] = print) -> list[Result]:
    runner = SimRunner(lib, device)
    gen = torch.Generator().manual_seed(20261129)
    results: list[Result] = []
    for index, case in enumerate(cases):
        inputs, refs = data(case, gen, device)
        for name, flags in (("plain", SKEW), ("epoch-checked", SKEW | EPOCH)):
            start = time.perf_counter()
            failure, violations = runner.check(case, inputs, refs, flags)
            result = Result(f"[{name}] {case.label()}", not failure, failure, time.perf_counter() - start, violations)
            results.append(result)
            if not result.ok:
                log(f"FAIL {result.label}: {failure}")
        if (index + 1) % 200 == 0 or index + 1 == len(cases):
            failed = sum(not r.ok for r in results)
            log(f"[{index + 1}/{len(cases)} cases] {len(results)} runs, {failed} failed")
    for result in negative_controls(runner, device, gen, coresident):
        results.append(result)
        log(f"{'PASS' if result.ok else 'FAIL'} {result.label}: {result.detail}")
    return results


def coresident_sim_ctas(lib: ctypes.CDLL) -> int:
    """How many 128-thread simulation CTAs the device holds: probe the C API's own refusal."""
    device = torch.device("cuda", torch.cuda.current_device())
    op = Operand(torch.bfloat16, 0, 8, 1, 1, 1, 8)
    runner = SimRunner(lib, device)
    inputs, _ = data(Case((Call(op, Plan(1, 1, 1, tuned=True), "whole"),)), torch.Generator().manual_seed(0), device)
    lo, hi = 1, 144
    while lo < hi:  # largest ctas with 8 x ctas co-resident
        mid = (lo + hi + 1) // 2
        run = runner.run(Case((Call(op, Plan(mid, 1, 1, tuned=True), "whole"),)), inputs, 0)
        if run.status not in (0, 4):  # 4: FVK_ERR_NOT_CORESIDENT; anything else is a broken library
            raise RuntimeError(f"probing co-residency at 8 x {mid} CTAs: status {run.status}: {run.message}")
        lo, hi = (mid, hi) if run.status == 0 else (lo, mid - 1)
    return 8 * lo if lo < 144 else 8 * 144


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="write the per-case log here")
    parser.add_argument("--quick", action="store_true", help="a representative subset")
    parser.add_argument("--set", choices=("even", "uneven", "all"), default="all", dest="which",
                        help="the even split tables' cases, the uneven ones', or both (default)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("check_sim_peers: no CUDA device", file=sys.stderr)
        return 2
    info = kernel_testing.info()
    print("library:", json.dumps(info))
    try:
        lib = kernel_testing.load()
    except fastvideo_kernel.KernelUnavailable as exc:
        print(f"check_sim_peers: the simulated ranks are in the test library: {exc}", file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    coresident = coresident_sim_ctas(lib)
    print(f"co-resident simulation CTAs: {coresident} (P x ctas is capped to this)")
    cases = build_cases(args.quick, coresident, args.which)
    start = time.perf_counter()
    results = run_all(cases, lib, device, coresident)
    passed = sum(r.ok for r in results)
    failed = len(results) - passed
    elapsed = time.perf_counter() - start
    gpu = torch.cuda.get_device_name(device)
    print(f"{passed} passed, {failed} failed ({len(cases)} cases, {elapsed:.1f} s, {gpu})")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "library": info, "device": torch.cuda.get_device_name(device), "torch": torch.__version__,
            "coresident_sim_ctas": coresident, "cases": len(cases), "passed": passed, "failed": failed,
            "seconds": elapsed, "results": [asdict(r) for r in results],
        }, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
