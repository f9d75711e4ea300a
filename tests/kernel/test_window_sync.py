"""The fused kernel's synchronisation argument as a property over the plan space (CPU, runs in CI).

``fvk_check_window_sync`` (csrc/ulysses_a2a/sync_model.cpp) enumerates every window access of a
sequence of calls with the layout functions the kernel runs (layout.h) and checks that every pair of
conflicting accesses is ordered by the kernel's per-CTA barriers and the stream order between calls,
that the CTA slices tile every block and that nothing leaves the window.

* The plan space: P 2..8, B 1..4, CTA counts 1..144, windows from 1 MiB to 1 GiB, plans from the
  policy (whole operand, planes per chunk, window-limited sub-plane rows) and by hand (uneven planes,
  uneven rows, one row per chunk), single calls and consecutive calls whose CTA counts and plans
  differ.
* Negative controls: the pre-fix layout (regions at the current chunk's stride: the race the first 2-GPU
  run found, docs/kernel.md) must be flagged on the plans 2x H200 found wrong, and on most uneven multi-CTA
  plans; schedules with a barrier removed must be flagged: without chunk 0's entry barrier between consecutive
  calls, without any entry barrier between the chunks of one call, without the barrier between stores and
  copy-out.

The check is in the test library (``libfastvideo_ulysses_a2a_testing.so``, csrc/ulysses_a2a/testing/), which
``scripts/build_kernel.sh 2.28.9`` builds (the test command builds it wherever nvcc exists, as on CI); without
it the tests skip, except under ``CI=true`` where they fail.
"""

from __future__ import annotations

import ctypes
import random

import pytest
import torch

from fastvideo.distributed.ulysses.contract import dtype_code
from fastvideo.distributed.ulysses.policy import Geometry, Plan, TunedRow, choose_plan
from tests.kernel.built import fastvideo_kernel, kernel_testing

STATIC, MOVING = kernel_testing.LAYOUT_STATIC, kernel_testing.LAYOUT_MOVING
# fvk_check_window_sync schedules (testing/ulysses_a2a_testing.h): the kernel's, and negative controls without a
# barrier.
NO_FIRST_ENTRY, KERNEL, NO_ENTRY, NO_MIDDLE = (kernel_testing.SYNC_NO_FIRST_ENTRY, kernel_testing.SYNC_KERNEL,
                                               kernel_testing.SYNC_NO_ENTRY, kernel_testing.SYNC_NO_MIDDLE)
MIB, GIB = 1 << 20, 1 << 30
WINDOWS = (MIB, 3 * MIB + 4096, 64 * MIB, GIB)
CTAS = (1, 2, 3, 5, 7, 36, 64, 97, 131, 144)
MAX_CHUNKS = 40  # per plan: the check costs O(chunks x CTAs x P^2); many-chunk plans add no new shapes


@pytest.fixture(scope="module")
def lib(testing_lib):
    return testing_lib


def check(lib, geom: Geometry, plans: list[Plan], window: int, *, layout: int = STATIC,
          schedule: int = KERNEL) -> tuple[int, str]:
    """(violations, first) for consecutive calls of ``geom`` with ``plans``."""
    rows = [(dtype_code(geom.dtype), geom.B, geom.S, geom.H, geom.D, p.ctas, p.planes_per_chunk, p.rows_per_chunk)
            for p in plans]
    flat = (ctypes.c_int64 * (8 * len(rows)))(*(v for row in rows for v in row))
    violations = ctypes.c_int64(-1)
    msg = ctypes.create_string_buffer(1024)
    status = lib.fvk_check_window_sync(geom.world_size, len(rows), flat, window, layout, schedule,
                                       ctypes.byref(violations), msg, len(msg))
    assert status == 0, fastvideo_kernel.last_error(lib)
    return violations.value, msg.value.decode()


def uneven(geom: Geometry, plan: Plan) -> bool:
    """Whether the plan's chunks differ in size (the case the pre-fix layout got wrong)."""
    return len({(p1 - p0) * (r1 - r0) for p0, p1, r0, r1 in plan.chunks(geom)}) > 1


def plan_space(seed: int = 20261129):
    """(geometry, window, plans-in-sequence) cases; deterministic."""
    rng = random.Random(seed)
    cases = []
    for world in range(2, 9):
        for b in range(1, 5):
            # Small rows (many granules per CTA slice boundary), unaligned rows (2-byte granules),
            # and an H3-like row, each with S that splits unevenly.
            for heads_local, d, dtype, s in ((2, 128, torch.bfloat16, 1000), (1, 3, torch.bfloat16, 777),
                                             (3, 5, torch.float32, 131), (7, 128, torch.bfloat16, 4099)):
                geom = Geometry(0, dtype, b, s, heads_local * world, d, world)
                for window in WINDOWS:
                    if geom.row_bytes > window:
                        continue
                    ctas = rng.sample(CTAS, 3)
                    plans = []
                    for c in ctas:
                        # The policy's own plans for a tuned row of this shape.
                        for planes in (1, 2, 3):
                            row = TunedRow("H200", world, dtype, geom.H, d, ctas=c, planes_per_chunk=planes,
                                           source="property test")
                            choice = choose_plan(geom, gpu="H200", window_bytes=window, table=(row,))
                            if choice.plan is not None and choice.plan.num_chunks(geom) <= MAX_CHUNKS:
                                plans.append(choice.plan)
                        # Hand-made: uneven rows, one row per chunk (capped), uneven planes.
                        max_rows = window // (geom.row_bytes * min(2, b))
                        for rows in {s, (s + 1) // 2, s - 1, max(1, s // 60), 1}:
                            for planes in {1, min(2, b), b}:
                                plan = Plan(c, planes, min(rows, max(1, max_rows)), tuned=True)
                                if plan.window_bytes(geom) <= window and plan.num_chunks(geom) <= MAX_CHUNKS:
                                    plans.append(plan)
                    plans = list(dict.fromkeys(plans))
                    for plan in plans:
                        cases.append((geom, window, [plan]))
                    # Consecutive calls whose CTA counts and chunking differ.
                    for _ in range(3):
                        seq = rng.sample(plans, min(len(plans), rng.randint(2, 3)))
                        if len({p.ctas for p in seq}) > 1:
                            cases.append((geom, window, seq))
    return cases


def test_plan_space_is_race_free(lib):
    cases = plan_space()
    worlds = {g.world_size for g, _, _ in cases}
    ctas = {p.ctas for _, _, seq in cases for p in seq}
    assert worlds == set(range(2, 9)) and {1, 144} <= ctas and len(ctas) >= 8
    assert sum(uneven(g, p) for g, _, seq in cases for p in seq) > 1000, "the space must be full of uneven plans"
    assert sum(len(seq) > 1 for _, _, seq in cases) > 300
    failures = []
    for geom, window, seq in cases:
        violations, first = check(lib, geom, seq, window)
        if violations:
            failures.append(f"{geom} window {window} plans {seq}: {violations} violations, first: {first}")
    assert not failures, f"{len(failures)} of {len(cases)} cases race:\n" + "\n".join(failures[:5])


# The plans the first 2x H200 run found wrong (bf16, SP2; docs/kernel.md): h3-32k QKV at 2 planes per chunk, and
# 250k with window-limited rows (74898, then 50102), at 36, 72 and 144 CTAs.
H200_WRONG = [
    (Geometry(0, torch.bfloat16, 3, 16384, 56, 128, 2), Plan(ctas, 2, 16384, tuned=True)) for ctas in (36, 72, 144)
] + [(Geometry(0, torch.bfloat16, 3, 125000, 56, 128, 2), Plan(ctas, 1, 74898, tuned=True)) for ctas in (36, 72, 144)]


@pytest.mark.parametrize("geom,plan", H200_WRONG, ids=lambda v: str(v.ctas) if isinstance(v, Plan) else "")
def test_negative_control_moving_layout_is_flagged_where_h200_was_wrong(lib, geom, plan):
    assert uneven(geom, plan)
    moving, first = check(lib, geom, [plan], GIB, layout=MOVING)
    assert moving > 0 and "race" in first, "the pre-fix layout must be flagged"
    fixed, first = check(lib, geom, [plan], GIB)
    assert fixed == 0, first


def test_negative_control_moving_layout_is_flagged_across_the_space(lib):
    """The pre-fix layout races on most uneven multi-CTA plans (not on even ones, nor with one CTA)."""
    flagged = total = even_flagged = 0
    for geom, window, seq in plan_space():
        if len(seq) != 1:
            continue
        plan = seq[0]
        violations, _ = check(lib, geom, seq, window, layout=MOVING)
        if uneven(geom, plan) and plan.ctas > 1:
            total += 1
            flagged += violations > 0
        elif not uneven(geom, plan):
            even_flagged += violations > 0
    assert total > 500 and flagged > 0.8 * total, f"moving flagged on {flagged}/{total} uneven plans"
    assert even_flagged == 0, "with chunks of one size the pre-fix layout was right (as 2x H200 showed)"


def test_negative_control_missing_entry_barrier_is_flagged_between_calls(lib):
    geom = Geometry(0, torch.bfloat16, 3, 1000, 112, 128, 2)
    seq = [Plan(144, 1, 1000, tuned=True), Plan(36, 2, 300, tuned=True)]
    assert check(lib, geom, seq, GIB) == (0, "")
    violations, first = check(lib, geom, seq, GIB, schedule=NO_FIRST_ENTRY)
    assert violations > 0 and "call 1 chunk 0 store" in first


def test_negative_control_missing_barriers_within_a_call_are_flagged(lib):
    """Without the barrier before each chunk's stores (write-after-read between chunks of one call) or
    without the one between stores and copy-out (read-after-write), one call of a multi-chunk plan
    races, even in the static layout."""
    geom = Geometry(0, torch.bfloat16, 3, 1000, 112, 128, 2)
    plan = Plan(36, 1, 400, tuned=True)
    assert check(lib, geom, [plan], GIB) == (0, "")
    war, first = check(lib, geom, [plan], GIB, schedule=NO_ENTRY)
    assert war > 0 and "store" in first and "copy-out" in first
    raw, first = check(lib, geom, [plan], GIB, schedule=NO_MIDDLE)
    assert raw > 0 and "store" in first and "copy-out" in first
    one_chunk = Plan(36, 3, 1000, tuned=True)  # one chunk, one call: no entry barrier is ever needed...
    assert check(lib, geom, [one_chunk], GIB, schedule=NO_ENTRY) == (0, "")
    assert check(lib, geom, [one_chunk], GIB, schedule=NO_MIDDLE)[0] > 0  # ...but the middle one always is
    with pytest.raises(AssertionError, match="schedule 9"):
        check(lib, geom, [plan], GIB, schedule=9)


def test_window_bounds_and_bad_arguments(lib):
    geom = Geometry(0, torch.bfloat16, 2, 10, 4, 8, 2)
    plan = Plan(5, 1, 10, tuned=True)
    with pytest.raises(AssertionError, match="window"):
        check(lib, geom, [plan], plan.window_bytes(geom) - 1)
    with pytest.raises(AssertionError, match="ctas=145"):
        check(lib, geom, [Plan(145, 1, 10, tuned=True)], GIB)
    assert check(lib, geom, [plan], plan.window_bytes(geom)) == (0, "")
