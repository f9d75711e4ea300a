#!/usr/bin/env python3
"""Single-GPU check of the fused all-to-all's movement code, with P simulated ranks on one device.

``fvk_sim_a2a`` runs the same store/copy-out device functions as the fused kernel, with P separate
inputs, windows and outputs on one GPU and kernel-launch boundaries in place of the LSA barriers
(per chunk: the store phase of every simulated rank, then the copy-out phase of every rank, with
the fused kernel's CTA partition). Every simulated rank's output is compared bit for bit with
``communication_op.reference_all_to_all`` (the NCCL route's exchange, computed locally).

Coverage: bf16/fp16/fp32, both modes, P = 2..8, B = 1..4, whole-operand, one-plane and sub-plane
chunk plans (including a smaller last chunk and multi-plane row chunks), CTA counts 1..144, 16-byte
aligned rows (D=128) and rows only 2/4/8-byte aligned (D=3, 4, 5, odd S), and a rank whose input
pointer is misaligned (it moves narrower vectors than its peers through the same CTA partition).
Outputs and windows are poisoned with 0xFF bytes before each run (NaN for every dtype; inputs never
contain the pattern), and the bytes just past the plan's window must still hold the poison after.
Negative controls prove the comparison catches a corrupted reference and a wrong peer order.

    FASTVIDEO_KERNEL_LIBRARY=build/kernel/libfastvideo_ulysses_a2a.so python tests/kernel/check_sim_peers.py
    python tests/kernel/check_sim_peers.py --json out.json [--quick]

Exits non-zero on any failure.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
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

from fastvideo.distributed.communication_op import reference_all_to_all  # noqa: E402
from fastvideo.distributed.ulysses.contract import dtype_code  # noqa: E402
from fastvideo.distributed.ulysses.policy import Geometry, Plan  # noqa: E402

BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
GUARD_BYTES = 256  # past the plan's window: must stay poisoned (no chunk writes beyond its size)
POISON = 0xFF


@dataclass(frozen=True)
class Operand:
    """The data of one group of cases: every simulated rank's input and the reference outputs."""

    dtype: torch.dtype
    mode: int
    world: int
    B: int
    S: int  # S_local
    heads_local: int
    D: int
    misaligned_rank: int  # -1: none; else this rank's input starts one element past an aligned address

    @property
    def H(self) -> int:
        return self.heads_local * self.world

    def geometry(self) -> Geometry:
        return Geometry(self.mode, self.dtype, self.B, self.S, self.H, self.D, self.world)

    def input_shape(self) -> tuple[int, int, int, int]:
        if self.mode == 0:
            return (self.B, self.S, self.H, self.D)
        return (self.B, self.world * self.S, self.heads_local, self.D)

    def label(self) -> str:
        dt = str(self.dtype).removeprefix("torch.")
        mis = f" misaligned@{self.misaligned_rank}" if self.misaligned_rank >= 0 else ""
        return f"{dt} mode{self.mode} P{self.world} B{self.B} S{self.S} Hl{self.heads_local} D{self.D}{mis}"


@dataclass(frozen=True)
class Case:
    operand: Operand
    plan_name: str
    ctas: int
    planes_per_chunk: int
    rows_per_chunk: int

    @property
    def plan(self) -> Plan:
        return Plan(self.ctas, self.planes_per_chunk, self.rows_per_chunk, tuned=True)

    def label(self) -> str:
        return (f"{self.operand.label()} plan={self.plan_name}({self.planes_per_chunk}x{self.rows_per_chunk}) "
                f"ctas={self.ctas}")


def random_bits(numel: int, dtype: torch.dtype, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """Random bit patterns of ``dtype`` that are never zero and never the all-ones poison."""
    bits = BITS[dtype]
    width = torch.iinfo(bits).bits
    values = torch.randint(1, (1 << width) - 1, (numel,), generator=gen, dtype=torch.int64)
    values = torch.where(values >= 1 << (width - 1), values - (1 << width), values)  # two's complement
    return values.to(bits).to(device).view(dtype)


def make_inputs(op: Operand, gen: torch.Generator, device: torch.device) -> list[torch.Tensor]:
    shape = op.input_shape()
    numel = op.B * op.S * op.H * op.D
    inputs = []
    for rank in range(op.world):
        flat = random_bits(numel + 1, op.dtype, gen, device)
        start = 1 if rank == op.misaligned_rank else 0
        inputs.append(flat[start:start + numel].view(shape))
    return inputs


def references(op: Operand, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The oracle, on raw bits (the exchange is pure data movement)."""
    bits = BITS[op.dtype]
    return [r.contiguous() for r in reference_all_to_all([x.view(bits) for x in inputs], op.mode)]


def plans(B: int, S: int) -> Iterator[tuple[str, int, int]]:
    yield "whole", B, S
    yield "plane", 1, S
    if S > 1:
        yield "rows", 1, (S + 1) // 2  # the last chunk is smaller
        yield "rows1", 1, 1
        if B > 1:
            yield "planes2_rows", 2, S - 1
    elif B > 1:
        yield "planes2", 2, S


def build_cases(quick: bool = False) -> list[Case]:
    worlds = (2, 3, 8) if quick else tuple(range(2, 9))
    dtypes = (torch.bfloat16, torch.float32) if quick else DTYPES
    aligned_b = (1, 3) if quick else (1, 2, 3, 4)
    aligned_ctas = (36, 144) if quick else (36, 144, 5)
    # (S, heads_local, D): rows of 16-byte multiples, then rows only 2/4/8-byte aligned.
    unaligned_shapes = ((7, 1, 3),) if quick else ((7, 1, 3), (3, 3, 5), (5, 1, 4))
    unaligned_b = (3,) if quick else (1, 3)
    unaligned_ctas = (144,) if quick else (1, 36, 144)
    cases: list[Case] = []

    def add(op: Operand, ctas_list: tuple[int, ...]) -> None:
        for name, planes, rows in plans(op.B, op.S):
            for ctas in ctas_list:
                cases.append(Case(op, name, ctas, planes, rows))

    for dtype in dtypes:
        for mode in (0, 1):
            for world in worlds:
                for b in aligned_b:
                    add(Operand(dtype, mode, world, b, 5, 2, 128, -1), aligned_ctas)
                for s, hl, d in unaligned_shapes:
                    for b in unaligned_b:
                        add(Operand(dtype, mode, world, b, s, hl, d, -1), unaligned_ctas)
                add(Operand(dtype, mode, world, 2, 5, 2, 128, 1), (144,))
            if not quick:
                # Larger operands: many units per thread, so the strided, unrolled loop, partial
                # unroll tails and CTA slices that end mid-row all run (the small cases fit in one pass).
                for world in (2, 4, 7):
                    add(Operand(dtype, mode, world, 3, 1000, 7, 128, -1), (36, 144))
                    add(Operand(dtype, mode, world, 2, 999, 5, 3, -1), (36, 144))
    return cases


@dataclass
class Result:
    label: str
    ok: bool
    detail: str
    seconds: float


class SimRunner:
    """Runs ``fvk_sim_a2a`` on poisoned windows and outputs and checks the result."""

    def __init__(self, lib: ctypes.CDLL, device: torch.device) -> None:
        self.lib, self.device = lib, device

    def run(self, case: Case, inputs: list[torch.Tensor], window_bytes: int | None = None
            ) -> tuple[int, str, list[torch.Tensor], list[torch.Tensor]]:
        op = case.operand
        geom = op.geometry()
        need = case.plan.window_bytes(geom) if window_bytes is None else window_bytes
        windows = [torch.full((need + GUARD_BYTES,), POISON, dtype=torch.uint8, device=self.device)
                   for _ in range(op.world)]
        out_shape = (op.B, op.world * op.S, op.heads_local, op.D) if op.mode == 0 else (op.B, op.S, op.H, op.D)
        outs = [torch.empty(out_shape, dtype=op.dtype, device=self.device) for _ in range(op.world)]
        for out in outs:
            out.view(torch.uint8).fill_(POISON)
        table = ctypes.c_void_p * op.world
        status = self.lib.fvk_sim_a2a(
            op.world, table(*(x.data_ptr() for x in inputs)), table(*(w.data_ptr() for w in windows)), need,
            table(*(o.data_ptr() for o in outs)), op.mode, dtype_code(op.dtype), geom.B, geom.S, geom.H, geom.D,
            case.ctas, case.planes_per_chunk, case.rows_per_chunk, torch.cuda.current_stream(self.device).cuda_stream)
        torch.cuda.synchronize(self.device)
        message = fastvideo_kernel.last_error(self.lib) if status else ""
        return status, message, outs, windows

    def check(self, case: Case, inputs: list[torch.Tensor], refs: list[torch.Tensor]) -> str:
        """'' when every rank's output matches bit for bit and the guard bytes are intact, else why not."""
        status, message, outs, windows = self.run(case, inputs)
        if status:
            return f"fvk_sim_a2a returned {status}: {message}"
        problems = [compare(outs, refs, case.operand.dtype)]
        need = case.plan.window_bytes(case.operand.geometry())
        for rank, window in enumerate(windows):
            if not bool((window[need:] == POISON).all()):
                problems.append(f"rank {rank} wrote past its {need}-byte window")
        return "; ".join(p for p in problems if p)


def compare(outs: list[torch.Tensor], refs: list[torch.Tensor], dtype: torch.dtype) -> str:
    """'' if every output equals its reference bit for bit, else the first differences."""
    bits = BITS[dtype]
    problems = []
    for rank, (out, ref) in enumerate(zip(outs, refs, strict=True)):
        got = out.view(bits)
        if got.shape != ref.shape:
            problems.append(f"rank {rank}: shape {tuple(got.shape)} != {tuple(ref.shape)}")
        elif not torch.equal(got, ref):
            bad = (got != ref).nonzero()
            poisoned = int((got == -1).sum())
            problems.append(f"rank {rank}: {bad.shape[0]} of {ref.numel()} elements differ "
                            f"({poisoned} still poisoned), first at {tuple(bad[0].tolist())}")
    return "; ".join(problems)


def negative_controls(runner: SimRunner, device: torch.device, gen: torch.Generator) -> list[Result]:
    """The check must catch known-bad results, and the C API must reject bad plans with a message."""
    op = Operand(torch.bfloat16, 0, 4, 2, 5, 2, 128, -1)
    case = Case(op, "rows", 144, 1, 3)
    inputs = make_inputs(op, gen, device)
    refs = references(op, inputs)
    results = []

    def expect(label: str, failure: str) -> None:
        start = time.perf_counter()
        ok = bool(failure)
        results.append(Result(f"negative control: {label}", ok, failure or "NOT caught", time.perf_counter() - start))

    corrupted = [r.clone() for r in refs]
    flat = corrupted[2].view(-1)
    flat[flat.numel() // 2] ^= 1
    expect("one flipped bit in rank 2's reference", runner.check(case, inputs, corrupted))
    expect("peers' inputs in the wrong order", runner.check(case, inputs[::-1], refs))
    status, message, _, _ = runner.run(case, inputs, window_bytes=case.plan.window_bytes(op.geometry()) - 1)
    expect("window one byte too small is refused", f"status {status}: {message}" if status else "")
    bad_ctas = Case(op, "rows", 0, 1, 3)
    status, message, _, _ = runner.run(bad_ctas, inputs, window_bytes=case.plan.window_bytes(op.geometry()))
    expect("ctas=0 is refused", f"status {status}: {message}" if status else "")
    return results


def run_all(cases: list[Case], lib: ctypes.CDLL, device: torch.device, log=print) -> list[Result]:
    runner = SimRunner(lib, device)
    gen = torch.Generator().manual_seed(20261129)
    results: list[Result] = []
    current: Operand | None = None
    inputs: list[torch.Tensor] = []
    refs: list[torch.Tensor] = []
    for case in cases:
        if case.operand != current:
            current = case.operand
            inputs = make_inputs(current, gen, device)
            refs = references(current, inputs)
        start = time.perf_counter()
        failure = runner.check(case, inputs, refs)
        result = Result(case.label(), not failure, failure, time.perf_counter() - start)
        results.append(result)
        log(f"{'PASS' if result.ok else 'FAIL'} {result.label}{': ' + failure if failure else ''}")
    for result in negative_controls(runner, device, gen):
        results.append(result)
        log(f"{'PASS' if result.ok else 'FAIL'} {result.label}: {result.detail}")
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="write the per-case log here")
    parser.add_argument("--quick", action="store_true", help="a representative subset")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("check_sim_peers: no CUDA device", file=sys.stderr)
        return 2
    info = fastvideo_kernel.info()
    print("library:", json.dumps(info))
    lib = fastvideo_kernel.load()
    if "sim" not in fastvideo_kernel.entry_points(lib):
        print("check_sim_peers: this library has no fvk_sim_a2a", file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    cases = build_cases(args.quick)
    start = time.perf_counter()
    results = run_all(cases, lib, device)
    passed = sum(r.ok for r in results)
    failed = len(results) - passed
    elapsed = time.perf_counter() - start
    print(f"{passed} passed, {failed} failed ({elapsed:.1f} s, {torch.cuda.get_device_name(device)})")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "library": info, "device": torch.cuda.get_device_name(device), "torch": torch.__version__,
            "passed": passed, "failed": failed, "seconds": elapsed, "results": [asdict(r) for r in results],
        }, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
