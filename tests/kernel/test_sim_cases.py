"""The one-GPU simulated-peers check's case list on the CPU (runs in CI): ``check_sim_peers.build_cases``, its
descriptions and its oracle, through the test library's host checks.

The simulation itself needs a GPU (``tests/kernel/check_sim_peers.py``); what it runs can be checked here:

* the uneven cases cover what they claim: P = 2..8, both modes, every dtype, each table uneven alone and both
  together, shares of 0 in both tables (a rank with neither), a misaligned rank, sequences mixing even and
  uneven calls; every call's shapes are the ones the public op validates for its tables;
* every call of every uneven case, described exactly as the simulation describes it (``descriptions``), moves
  every byte to where the definition puts it through the kernels' own addressing (``fvk_check_addressing``;
  the even-only layout, the tables ignored, is wrong on every one of them: the control), and every case's call
  sequence is race-free by the host property check (``fvk_check_window_sync``) in the
  window the simulation gives it, while one byte less is refused;
* the simulation's oracle (concatenate and slice) equals the NCCL route's exchange computed locally
  (``layout.reference_all_to_all``), on even and uneven cases;
* its negative controls: every pre-fix-layout case is flagged by the host check as well;
* the runner itself (``SimRunner``: marshalling, poisoning, comparison, window guards) against a CPU stand-in
  for ``fvk_sim_a2a`` that writes the definition's outputs, or nothing (the control).
"""

from __future__ import annotations

import ctypes
import random

import pytest
import torch

from fastvideo.distributed.all_to_all import Splits, reference_all_to_all, validate_input
from fastvideo.distributed.ulysses.transport import output_shape
from tests.kernel import check_sim_peers as sim
from tests.kernel.built import fastvideo_kernel, kernel_testing


@pytest.fixture(scope="module")
def lib(testing_lib):
    return testing_lib


@pytest.fixture(scope="module")
def uneven():
    return sim.build_cases(which="uneven")


def window_sync(lib, case: sim.Case, window: int, layout: int = kernel_testing.LAYOUT_STATIC) -> tuple[int, str]:
    """(violations, first) of the host property check on ``case``'s calls, described as the simulation does."""
    descs, keep = sim.descriptions(case)
    array = (fastvideo_kernel.Call * len(descs))(*descs)
    violations, msg = ctypes.c_int64(-1), ctypes.create_string_buffer(1024)
    status = lib.fvk_check_window_sync(case.calls[0].operand.world, len(descs), array, window, layout,
                                       kernel_testing.SYNC_KERNEL, ctypes.byref(violations), msg, len(msg))
    del keep
    if status:
        return -1, fastvideo_kernel.last_error(lib)
    return violations.value, msg.value.decode()


def test_the_uneven_cases_cover_the_space(uneven):
    ops = [c.operand for case in uneven for c in case.calls]
    assert all(op.uneven_splits for case in uneven for op in [case.calls[0].operand])
    assert {op.world for op in ops} == set(range(2, 9)) and {op.mode for op in ops} == {0, 1}
    assert {op.dtype for op in ops} == set(sim.DTYPES) and {op.D for op in ops} >= {3, 128}
    seq_only = [op for op in ops if op.seq_splits is not None and op.head_splits is None]
    heads_only = [op for op in ops if op.seq_splits is None and op.head_splits is not None]
    both = [op for op in ops if op.seq_splits is not None and op.head_splits is not None]
    assert min(len(seq_only), len(heads_only), len(both)) > 100
    assert sum(0 in op.seq_splits for op in both + seq_only) > 100 and sum(0 in op.head_splits for op in both) > 100
    idle = [op for op in both if any(op.seq(r) == op.heads(r) == 0 for r in range(op.world))]
    assert {op.world for op in idle} == set(range(3, 9)), "a rank with neither rows nor heads at every P >= 3"
    assert any(op.misaligned_rank >= 0 and op.seq(op.misaligned_rank) == 0 for op in ops)
    assert any(op.misaligned_rank >= 0 and op.seq(op.misaligned_rank) == op.S for op in ops)
    sequences = [case for case in uneven if len(case.calls) > 1]
    assert {case.calls[0].operand.world for case in sequences} == set(range(2, 9))
    assert all(any(not c.operand.uneven_splits for c in case.calls) for case in sequences)
    assert any(c.uneven() for case in uneven for c in case.calls), "chunks of different sizes too"
    assert len(sim.build_cases(quick=True, which="uneven")) < len(uneven) < 2000
    assert len(sim.build_cases()) == len(sim.build_cases(which="even")) + len(uneven)


def test_every_call_s_shapes_are_what_the_op_validates(uneven):
    """The simulation's operands are the public op's: each rank's input passes ``validate_input`` with the call's
    tables and its output has the shape the transports give it."""
    for case in uneven:
        for call in case.calls:
            op, geom = call.operand, call.operand.geometry()
            assert max(geom.seq_table) == geom.S and sum(geom.head_table) == geom.H
            for r in range(op.world):
                x = torch.empty(op.input_shape(r))
                splits = validate_input(x, op.mode, op.world, rank=r, seq_splits=op.seq_splits,
                                        head_splits=op.head_splits)
                assert splits == Splits(op.seq_splits, op.head_splits)
                assert output_shape(geom, r) == op.output_shape(r)


def test_the_uneven_cases_move_every_byte_and_are_race_free_on_the_host(lib, uneven):
    """What the simulation launches, checked on the host through the kernels' own code: every call's data
    movement against the definition (and the even-only layout's, wrong on every uneven call), every case's call
    sequence in the simulation's window; one byte less is refused (the window check the simulation's launch
    makes too)."""
    failures = []
    seen = set()
    for case in uneven:
        descs, keep = sim.descriptions(case)
        for call, desc in zip(case.calls, descs, strict=True):
            key = (call.operand, call.plan)
            if key in seen:
                continue
            seen.add(key)
            for layout in (kernel_testing.LAYOUT_STATIC, kernel_testing.LAYOUT_EVEN_ONLY):
                wrong, msg = ctypes.c_int64(-1), ctypes.create_string_buffer(512)
                status = lib.fvk_check_addressing(call.operand.world, ctypes.byref(desc), layout, 0,
                                                  ctypes.byref(wrong), msg, len(msg))
                # The control: the even-only layout (the tables ignored) must be wrong on every uneven call.
                if status or (wrong.value > 0) != (layout == kernel_testing.LAYOUT_EVEN_ONLY and
                                                   call.operand.uneven_splits):
                    failures.append(f"addressing (layout {layout}) {call.label()}: {status} {wrong.value} "
                                    f"{msg.value.decode()}")
        del keep
        violations, first = window_sync(lib, case, case.window_bytes())
        if violations:
            failures.append(f"sync {case.label()}: {violations} {first}")
    assert not failures, f"{len(failures)} failed:\n" + "\n".join(failures[:5])
    case = uneven[0]
    assert window_sync(lib, case, case.window_bytes() - 1)[0] == -1


def test_the_oracle_is_the_nccl_route_s_exchange():
    """The simulation's reference (concatenate every rank's input, slice this rank's share) equals
    ``layout.reference_all_to_all`` (the NCCL route's send/receive layouts), on a sample of even and uneven
    cases; a wrong peer order differs (the control)."""
    rng = random.Random(7)
    cases = sim.build_cases(quick=True)
    gen = torch.Generator().manual_seed(3)
    checked = 0
    for case in rng.sample(cases, 120):
        for call in case.calls:
            op = call.operand
            inputs = sim.make_inputs(op, gen, torch.device("cpu"))
            bits = [x.view(sim.BITS[op.dtype]) for x in inputs]
            route = reference_all_to_all(bits, op.mode, splits=Splits(op.seq_splits, op.head_splits))
            assert all(torch.equal(a, b) for a, b in zip(sim.references(op, inputs), route, strict=True))
            checked += op.uneven_splits
    assert checked > 20
    op = sim.Operand(torch.bfloat16, 0, 3, 1, 4, 0, 8, seq_splits=(4, 2, 3), head_splits=(1, 2, 3))
    inputs = sim.make_inputs(op, gen, torch.device("cpu"))
    assert not torch.equal(sim.references(op, inputs)[0], sim.references(op, inputs[::-1])[0])


def test_the_pre_fix_layout_cases_are_flagged_on_the_host(lib):
    """Every case the simulation's pre-fix-layout control runs (uneven chunks, and uneven tables with chunks of
    one size) races by the host property check too, and is race-free in the kernels' layout."""
    for case in sim.MOVING_CASES:
        assert window_sync(lib, case, case.window_bytes()) == (0, "")
        assert window_sync(lib, case, case.window_bytes(), kernel_testing.LAYOUT_MOVING)[0] > 0, case.label()
    uneven_tables = [case for case in sim.MOVING_CASES if case.calls[0].operand.uneven_splits]
    assert len(uneven_tables) == 2 and not uneven_tables[0].calls[0].uneven()


class StandIn:
    """``fvk_sim_a2a`` on the CPU, for the runner's own code: checks what ``SimRunner.run`` marshalled (every call's
    description with readable split tables, every rank's pointers, null for an empty operand) and writes the
    definition's outputs (``refs``), or nothing with ``write=False``."""

    def __init__(self, case: sim.Case, inputs, refs, *, write: bool = True) -> None:
        self.case, self.inputs, self.refs, self.write = case, inputs, refs, write

    def fvk_sim_a2a(self, world, ncalls, calls, windows, need, flags, skew, seed, report, stream) -> int:
        assert ncalls == len(self.case.calls) and need == self.case.window_bytes() and flags == sim.SKEW
        for n, call in enumerate(self.case.calls):
            got, op = calls[n], call.operand
            assert (got.call.kind, got.call.ctas, got.call.mode, got.call.S, got.call.H) == (
                fastvideo_kernel.KIND_SM, call.plan.ctas, op.mode, op.S, op.H)
            tables = [None if not p else tuple(ctypes.cast(p, ctypes.POINTER(ctypes.c_int64))[:world])
                      for p in (got.call.seq_split, got.call.head_split)]
            assert tables == [op.seq_splits, op.head_splits]
            for r in range(world):
                x = self.inputs[n][r]
                assert got.x[r] == (x.data_ptr() if x.numel() else None)
                assert (got.out[r] is None) == (self.refs[n][r].numel() == 0)
                if self.write and got.out[r] is not None:
                    ref = self.refs[n][r]
                    ctypes.memmove(got.out[r], ref.data_ptr(), ref.numel() * ref.element_size())
        return 0


def test_the_runner_marshals_every_call_and_checks_every_byte(monkeypatch, uneven):
    """``SimRunner`` on the CPU against the stand-in: a simulation that writes the definition's outputs passes
    every check of the runner (outputs bit for bit, the window guards, no epoch report); one that writes nothing
    fails every case with poisoned outputs (the control)."""
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: type("S", (), {"cuda_stream": 0})())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device: None)
    gen = torch.Generator().manual_seed(11)
    cpu = torch.device("cpu")
    for case in random.Random(2).sample(uneven, 40) + [c for c in uneven if len(c.calls) > 1][:5]:
        inputs, refs = sim.data(case, gen, cpu)
        assert sim.SimRunner(StandIn(case, inputs, refs), cpu).check(case, inputs, refs, sim.SKEW) == ("", 0)
        failure, _ = sim.SimRunner(StandIn(case, inputs, refs, write=False), cpu).check(case, inputs, refs, sim.SKEW)
        assert "still poisoned" in failure, case.label()
