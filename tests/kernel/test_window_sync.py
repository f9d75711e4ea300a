"""The fused kernel's synchronisation argument as a property over the plan space (CPU, runs in CI).

``fvk_check_window_sync`` (csrc/ulysses_a2a/testing/sync_model.cu) runs the kernel body itself (``run_call``)
for every rank and CTA of a sequence of calls on the host, recording every window access and barrier point,
and checks that every pair of conflicting accesses is ordered by the kernel's per-CTA barriers and the stream
order between calls, that the CTA slices tile exactly the block the call's shares define, that they stay in
their regions and that nothing leaves the window. Calls are described as the native transport describes them
(``launch.call_description``, split tables included).

* The plan space: P 2..8, B 1..4, CTA counts 1..144, windows from 1 MiB to 1 GiB, plans from the
  policy (whole operand, planes per chunk, window-limited sub-plane rows) and by hand (uneven planes,
  uneven rows, one row per chunk), single calls and consecutive calls whose CTA counts and plans
  differ; the same for uneven sequence and head splits (both modes, shares of 0, chunks and windows sized by
  the largest share), and consecutive calls whose split tables and plans differ, even and uneven mixed.
* Negative controls: the pre-fix layout (regions at the current chunk's stride: the race the first 2-GPU
  run found, docs/kernel.md) must be flagged on the plans 2x H200 found wrong, on most uneven multi-CTA
  plans and on uneven split tables; the even-only layout (the split tables ignored) on every uneven table;
  schedules with a barrier removed must be flagged: without chunk 0's entry barrier between consecutive calls,
  without any entry barrier between the chunks of one call, without the barrier between stores and copy-out,
  with even and uneven tables alike.

The check is in the test library (``libfastvideo_ulysses_a2a_testing.so``, csrc/ulysses_a2a/testing/), which
``scripts/build_kernel.sh 2.28.9`` builds (the test command builds it wherever nvcc exists, as on CI); without
it the tests skip, except under ``CI=true`` where they fail.
"""

from __future__ import annotations

import random

import pytest
import torch

from fastvideo.distributed.ulysses.policy import Geometry, Plan, TunedRow, choose_plan
from tests.kernel.built import kernel_testing
from tests.kernel.host_checks import EVEN_ONLY, MOVING, STATIC, uneven_geometry, window_sync

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


def check(lib, geom: Geometry | list[Geometry], plans: list[Plan], window: int, *, layout: int = STATIC,
          schedule: int = KERNEL) -> tuple[int, str]:
    """(violations, first) for consecutive calls of ``geom`` (one, or one per plan) with ``plans``."""
    geoms = geom if isinstance(geom, list) else [geom] * len(plans)
    return window_sync(lib, list(zip(geoms, plans, strict=True)), window, layout=layout, schedule=schedule)


def uneven(geom: Geometry, plan: Plan) -> bool:
    """Whether the plan's chunks differ in size (the case the pre-fix layout got wrong)."""
    return len({(p1 - p0) * (r1 - r0) for p0, p1, r0, r1 in plan.chunks(geom)}) > 1


def plans_for(rng: random.Random, geom: Geometry, window: int, ctas: list[int]) -> list[Plan]:
    """The policy's plans for tuned rows of ``geom``'s shape at these CTA counts, and hand-made ones (uneven rows,
    one row per chunk, uneven planes), each fitting ``window`` with at most MAX_CHUNKS chunks."""
    b, s = geom.B, geom.S
    plans = []
    for c in ctas:
        for planes in (1, 2, 3):
            row = TunedRow("H200", geom.world_size, geom.dtype, geom.H, geom.D, ctas=c, planes_per_chunk=planes,
                           source="property test")
            choice = choose_plan(geom, gpu="H200", window_bytes=window, table=(row,))
            if choice.plan is not None and choice.plan.num_chunks(geom) <= MAX_CHUNKS:
                plans.append(choice.plan)
        max_rows = window // (geom.row_bytes * min(2, b))
        for rows in {s, (s + 1) // 2, s - 1, max(1, s // 60), 1}:
            for planes in {1, min(2, b), b}:
                plan = Plan(c, planes, min(max(rows, 1), max(1, max_rows)), tuned=True)
                if plan.window_bytes(geom) <= window and plan.num_chunks(geom) <= MAX_CHUNKS:
                    plans.append(plan)
    return list(dict.fromkeys(plans))


def plan_space(seed: int = 20261129):
    """(geometry, window, plans-in-sequence) cases with even split tables; deterministic."""
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
                    plans = plans_for(rng, geom, window, rng.sample(CTAS, 3))
                    for plan in plans:
                        cases.append((geom, window, [plan]))
                    # Consecutive calls whose CTA counts and chunking differ.
                    for _ in range(3):
                        seq = rng.sample(plans, min(len(plans), rng.randint(2, 3)))
                        if len({p.ctas for p in seq}) > 1:
                            cases.append((geom, window, seq))
    return cases


def uneven_space(seed: int = 20261201):
    """(geometries, window, plans) cases with uneven split tables: both modes, sequence and head shares uneven
    alone and together, every other geometry with a share of 0, and consecutive calls whose tables, modes and
    plans differ (even tables among them). Deterministic."""
    rng = random.Random(seed)
    cases = []
    for world in range(2, 9):
        for b in range(1, 5):
            for heads, d, dtype, s in ((2 * world + 1, 128, torch.bfloat16, 1000), (world + 2, 3, torch.bfloat16, 777),
                                       (3 * world - 1, 5, torch.float32, 131), (7 * world + 3, 128, torch.bfloat16,
                                                                                4099)):
                window = rng.choice(WINDOWS[1:])
                geoms = []
                for n, (seq, head) in enumerate(((True, True), (True, False), (False, True))):
                    h = heads if head else world * max(1, heads // world)
                    geom = uneven_geometry(rng, rng.randint(0, 1), dtype, world, b, s, h, d, zero=(n + b) % 2 == 0,
                                           seq=seq, head=head)
                    if geom.row_bytes > window:
                        continue
                    plans = plans_for(rng, geom, window, rng.sample(CTAS, 2))
                    cases += [([geom], window, [plan]) for plan in plans]
                    geoms.append((geom, plans))
                even = Geometry(0, dtype, b, s, world * max(1, heads // world), d, world)
                geoms.append((even, plans_for(rng, even, window, rng.sample(CTAS, 1))))
                # Consecutive calls: other tables, modes, CTA counts and chunking, even and uneven mixed.
                for _ in range(3):
                    picks = [rng.choice(geoms) for _ in range(rng.randint(2, 3))]
                    calls = [(g, rng.choice(p)) for g, p in picks if p]
                    if len(calls) > 1:
                        cases.append(([g for g, _ in calls], window, [p for _, p in calls]))
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


# ---------------------------------------------------------------------- uneven sequence and head splits


def test_uneven_space_is_race_free(lib):
    cases = uneven_space()
    geoms = [g for gs, _, _ in cases for g in gs]
    assert {g.world_size for g in geoms} == set(range(2, 9)) and {g.mode for g in geoms} == {0, 1}
    assert sum(g.seq_splits is not None and g.head_splits is not None for g in geoms) > 500
    assert sum(g.seq_splits is None for g in geoms) > 100 and sum(g.head_splits is None for g in geoms) > 100
    assert sum(0 in (g.seq_splits or ()) + (g.head_splits or ()) for g in geoms) > 500, "idle ranks"
    sequences = [gs for gs, _, _ in cases if len(gs) > 1]
    assert len(sequences) > 150 and sum(any(not g.uneven for g in gs) for gs in sequences) > 30
    assert sum(len({(g.mode, g.seq_splits, g.head_splits) for g in gs}) > 1 for gs in sequences) > 100
    failures = []
    for geoms_, window, seq in cases:
        violations, first = check(lib, geoms_, seq, window)
        if violations:
            failures.append(f"{geoms_} window {window} plans {seq}: {violations} violations, first: {first}")
    assert not failures, f"{len(failures)} of {len(cases)} cases race:\n" + "\n".join(failures[:5])


def test_idle_ranks_meet_every_barrier_and_move_nothing(lib):
    """Shares of 0 (a rank with no sequence rows, one with no heads, one with neither), both modes, many chunks:
    race-free; the same calls without the entry barrier or the middle one race (the idle ranks' barriers are
    the ones the others' pairs need)."""
    for mode in (0, 1):
        geom = Geometry(mode, torch.bfloat16, 2, 9, 10, 8, 4, (9, 0, 4, 0), (0, 3, 7, 0))
        plans = [Plan(7, 1, 2, tuned=True), Plan(36, 2, 9, tuned=True), Plan(1, 1, 1, tuned=True)]
        assert check(lib, geom, plans, MIB) == (0, "")
        assert check(lib, geom, plans[:1], MIB, schedule=NO_ENTRY)[0] > 0
        assert check(lib, geom, plans[:1], MIB, schedule=NO_MIDDLE)[0] > 0
        assert check(lib, geom, plans, MIB, schedule=NO_FIRST_ENTRY)[0] > 0


def test_negative_control_even_only_layout_is_flagged_on_uneven_tables(lib):
    """The layout before uneven splits applied to uneven tables (every share taken as even) is flagged on every
    uneven single call: its blocks are not the ones the shares define. On even tables it is the kernels' layout,
    and nothing is flagged (the control's control)."""
    flagged = total = 0
    for geoms, window, seq in uneven_space():
        if len(seq) == 1 and geoms[0].uneven:
            total += 1
            violations, first = check(lib, geoms, seq, window, layout=EVEN_ONLY)
            flagged += violations > 0 and "bytes rank" in first
    assert total > 1000 and flagged == total, f"even-only flagged on {flagged}/{total} uneven calls"
    for geom, window, seq in plan_space()[::50]:
        assert check(lib, geom, seq, window, layout=EVEN_ONLY) == (0, "")


def test_negative_control_moving_layout_is_flagged_on_uneven_tables(lib):
    """Regions that move with the block size race on uneven tables even where every chunk has one shape: the
    blocks of different pairs differ in size. Flagged on most uneven multi-CTA calls of several chunks (a block's
    region moves from chunk to chunk), and on some of one chunk (a longer source block overlaps the next one)."""
    flagged = {True: 0, False: 0}
    total = {True: 0, False: 0}
    for geoms, window, seq in uneven_space():
        if len(seq) == 1 and geoms[0].uneven and seq[0].ctas > 1:
            several = seq[0].num_chunks(geoms[0]) > 1
            total[several] += 1
            flagged[several] += check(lib, geoms, seq, window, layout=MOVING)[0] > 0
    assert total[True] > 1000 and flagged[True] > 0.8 * total[True], f"moving flagged: {flagged} of {total}"
    assert flagged[False] > 0.2 * total[False], f"moving flagged: {flagged} of {total}"


def test_negative_control_dropped_barriers_are_flagged_with_uneven_tables(lib):
    """Each barrier dropped alone is flagged on uneven tables: within a multi-chunk call (entry, middle) and
    between consecutive calls whose tables differ (chunk 0's entry)."""
    first_call = Geometry(0, torch.bfloat16, 3, 1000, 113, 128, 4, (1000, 0, 999, 400), (30, 41, 0, 42))
    second = Geometry(1, torch.bfloat16, 2, 900, 112, 128, 4, (900, 1, 899, 0), None)
    plan = Plan(36, 1, 400, tuned=True)
    assert check(lib, first_call, [plan], GIB) == (0, "")
    for schedule in (NO_ENTRY, NO_MIDDLE):
        violations, first = check(lib, first_call, [plan], GIB, schedule=schedule)
        assert violations > 0 and "store" in first and "copy-out" in first, (schedule, first)
    calls = [first_call, second]
    seq = [Plan(144, 1, 1000, tuned=True), Plan(36, 2, 300, tuned=True)]
    assert check(lib, calls, seq, GIB) == (0, "")
    violations, first = check(lib, calls, seq, GIB, schedule=NO_FIRST_ENTRY)
    assert violations > 0 and "call 1 chunk 0 store" in first


def test_bad_split_tables_are_refused(lib):
    """make_problem's checks of the tables, the same for every launcher: a negative share, a largest sequence
    share that is not S, head shares that do not sum to H."""
    plan = Plan(5, 1, 10, tuned=True)
    for seq, heads, message in (((10, -1), None, r"seq_split\[1\] = -1 is negative"),
                                ((9, 3), None, "largest share of 9"), (None, (3, 4), "summing to 7")):
        geom = Geometry(0, torch.bfloat16, 1, 10, 8, 8, 2, seq, heads)
        with pytest.raises(AssertionError, match=message):
            check(lib, geom, [plan], GIB)


def test_the_policy_s_window_is_exactly_what_an_uneven_call_needs(lib):
    """``Plan.window_bytes`` (the policy's sizing by the largest shares) is what the library requires of an uneven
    call: that window passes, one byte less is refused; the policy's own plan for a window of exactly that size
    runs in it."""
    rng = random.Random(5)
    for world in (2, 3, 5, 8):
        for mode in (0, 1):
            geom = uneven_geometry(rng, mode, torch.bfloat16, world, 2, 37, 3 * world + 1, 8, zero=True)
            for plan in (Plan(36, 2, 37, tuned=True), Plan(5, 1, 10, tuned=True), Plan(144, 1, 1, tuned=True)):
                need = plan.window_bytes(geom)
                assert check(lib, geom, [plan], need) == (0, ""), (geom, plan)
                with pytest.raises(AssertionError, match="window"):
                    check(lib, geom, [plan], need - 1)
                choice = choose_plan(geom, gpu="H200", window_bytes=need, table=(
                    TunedRow("H200", world, geom.dtype, geom.H, geom.D, ctas=plan.ctas,
                             planes_per_chunk=plan.planes_per_chunk, source="property test"),))
                assert choice.plan is not None and check(lib, geom, [choice.plan], need) == (0, "")
