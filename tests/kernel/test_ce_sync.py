"""The copy-engine plan kind's synchronisation as a property (CPU, runs in CI).

``fvk_check_ce_sync`` (csrc/ulysses_a2a/testing/ce_sync_model.cpp, in the test library) replays
``ce_schedule`` -- the schedule the launcher executes (ce_plan.h) -- on every rank for a sequence of calls,
each rank from its own description of the call, builds the happens-before graph of stream order, event records
and waits (with the reuse of the context's events, as issued) and paired barriers, and checks that every push
into window bytes (the launcher's own copies, ``ce_push_copies``) and every copy-out of them are ordered in
sequence order, that every push stays in its block and moves the bytes the call's shares define, and that the
copy-stream work of a call stays inside the call. Calls are described as the native transport describes them
(``launch.call_description``): even and uneven sequence and head splits, shares of 0 (a rank that pushes
nothing still issues every barrier), consecutive calls whose tables and chunks differ, SM-kind calls between.

Negative controls: each ordering the argument relies on, dropped alone, must be flagged, with even and uneven
tables; the even-only layout (the split tables ignored) on uneven tables.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from fastvideo.distributed.ulysses.policy import ENGINE_CE, Geometry, Plan
from tests.kernel.built import kernel_testing
from tests.kernel.host_checks import CE, EVEN_ONLY, SM, ce_sync, uneven_geometry

SM_CALL = "sm"  # in a sequence: an SM-kind call (the fused kernel) between copy-engine calls


@pytest.fixture(scope="module")
def lib(testing_lib):
    return testing_lib


def chunked(world: int, chunks: int, geom: Geometry | None = None) -> tuple[Geometry, Plan]:
    """A copy-engine call of ``chunks`` chunks (one plane each) on ``geom``, or on a small even geometry."""
    geom = geom or Geometry(0, torch.bfloat16, chunks, 4, 2 * world, 8, world)
    geom = Geometry(geom.mode, geom.dtype, chunks, geom.S, geom.H, geom.D, world, geom.seq_splits, geom.head_splits)
    return geom, Plan(7, 1, geom.S, tuned=True, engine=ENGINE_CE)


def check(lib, world: int, sequence: list, drop: int = 0, *, layout: int = 0) -> tuple[int, str]:
    """(violations, first) for a sequence of calls: chunk counts (an even copy-engine call), (geometry, plan)
    pairs, or SM_CALL."""
    calls, kinds = [], []
    for item in sequence:
        if item == SM_CALL:
            calls.append((Geometry(0, torch.bfloat16, 1, 4, 2 * world, 8, world), Plan(36, 1, 4, tuned=True)))
            kinds.append(SM)
        else:
            calls.append(chunked(world, item) if isinstance(item, int) else item)
            kinds.append(CE)
    return ce_sync(lib, calls, kinds=kinds, layout=layout, drop=drop)


SEQUENCES = [[1], [2], [3], [7], [1, 1], [1, 4], [4, 1], [2, 3, 5], [5, 2, 1], [6, 6], [1, 2, 1, 3]]


def uneven_sequences(world: int, seed: int = 20261201) -> list[list[tuple[Geometry, Plan]]]:
    """Sequences of copy-engine calls with uneven tables: both modes, shares of 0, plans whose chunks differ
    (planes then a smaller last plane range, uneven row ranges, one row per chunk), tables that change from call
    to call, even calls among them."""
    rng = random.Random(seed + world)
    calls = []
    for n in range(6):
        heads = rng.randint(world + 1, 3 * world) if n != 5 else world * rng.randint(1, 3)  # an even table divides
        geom = uneven_geometry(rng, n % 2, torch.bfloat16, world, rng.randint(1, 3), rng.randint(2, 9), heads, 8,
                               zero=n % 3 != 2, seq=n != 4, head=n != 5)
        rows = rng.choice([geom.S, max(1, geom.S // 2), (geom.S + 2) // 3, 1])
        calls.append((geom, Plan(rng.choice([1, 7, 66]), rng.randint(1, 2), rows, tuned=True, engine=ENGINE_CE)))
    calls.append(chunked(world, 2))
    return [[calls[i]] for i in range(len(calls))] + [rng.sample(calls, k) for k in (2, 3, 3, 4)]


@pytest.mark.parametrize("world", range(2, 9))
def test_schedule_is_race_free(lib, world):
    for chunks in SEQUENCES:
        violations, first = check(lib, world, chunks)
        assert violations == 0, f"P={world} chunks={chunks}: {first}"


@pytest.mark.parametrize("world", range(2, 9))
def test_uneven_calls_are_race_free_and_move_their_shares(lib, world):
    """Uneven sequence and head shares, shares of 0, uneven chunks, across consecutive calls whose tables differ:
    race-free, every push inside its block, each pair's bytes the shares' (both checked by the same model)."""
    sequences = uneven_sequences(world)
    assert any(0 in (g.seq_splits or ()) + (g.head_splits or ()) for seq in sequences for g, _ in seq)
    assert any(len({g for g, _ in seq}) > 1 for seq in sequences)
    for seq in sequences:
        violations, first = check(lib, world, seq)
        assert violations == 0, f"P={world} {seq}: {first}"
    violations, first = check(lib, world, [*sequences[-1][:1], SM_CALL, *sequences[-1][1:]])
    assert violations == 0, first


@pytest.mark.parametrize(("drop", "needs"), [
    (kernel_testing.CE_DROP_WAIT_COPIED, ("unordered",)),
    (kernel_testing.CE_DROP_ENTRY_BARRIER, ("unordered",)),
    (kernel_testing.CE_DROP_LANDED_BARRIER, ("unordered",)),
    (kernel_testing.CE_DROP_FORK, ("before the caller's stream",)),
    # Without the join a call's copy-outs also race with the next call's pushes.
    (kernel_testing.CE_DROP_JOIN, ("after the call ended", "unordered")),
])
def test_every_ordering_is_needed(lib, drop, needs):
    """Each dropped ordering is caught, with even and with uneven tables; the first violation names what went
    wrong."""
    flagged, uneven_flagged = [], 0
    for world, chunks in itertools.product((2, 3, 8), SEQUENCES):
        violations, first = check(lib, world, chunks, drop)
        if violations:
            assert any(n in first for n in needs), first
            flagged.append((world, tuple(chunks)))
    for world in (2, 3, 8):
        for seq in uneven_sequences(world):
            violations, first = check(lib, world, seq, drop)
            if violations:
                assert any(n in first for n in needs), first
                uneven_flagged += 1
    assert flagged and uneven_flagged, f"drop {drop} was never flagged ({len(flagged)}, {uneven_flagged})"
    # Where each control must bite: the wait only matters from chunk 2 on (a buffer's second use in a call).
    if drop == kernel_testing.CE_DROP_WAIT_COPIED:
        assert (2, (3,)) in flagged and (2, (2,)) not in flagged
    else:
        assert (2, (1,)) in flagged or (2, (1, 1)) in flagged


def test_negative_control_even_only_layout_is_flagged_on_uneven_tables(lib):
    """The split tables ignored (every share taken as even): the pushes are not the bytes the shares define, on
    every uneven call; on even calls it is the kernels' layout and nothing is flagged."""
    for world in (2, 3, 5, 8):
        for seq in uneven_sequences(world):
            geom, _ = seq[0]
            violations, first = check(lib, world, seq[:1], layout=EVEN_ONLY)
            assert (violations > 0) == geom.uneven, (world, seq[0], first)
            if geom.uneven:
                assert "the shares define" in first or "leaves its block" in first, first
        assert check(lib, world, [2, 3], layout=EVEN_ONLY) == (0, "")


@pytest.mark.parametrize("world", range(2, 9))
def test_calls_ordered_only_through_the_completion_event_are_race_free(lib, world):
    """Each call on streams of its own (CUDA-graph replays, calls on changing streams): the completion event,
    recorded after the join and waited for before the fork, is the only cross-call ordering, and suffices."""
    for chunks in SEQUENCES + uneven_sequences(world)[-4:]:
        violations, first = check(lib, world, chunks, kernel_testing.CE_MODEL_STREAM_PER_CALL)
        assert violations == 0, f"P={world} chunks={chunks}: {first}"


def test_without_the_completion_event_wait_calls_race(lib):
    """Negative control of that model: without the wait, a call's pushes race with the previous call's
    copy-outs (or its copy-stream work escapes the call) wherever there are two calls."""
    model = kernel_testing.CE_MODEL_STREAM_PER_CALL | kernel_testing.CE_DROP_DONE_WAIT
    for world, chunks in itertools.product((2, 3, 8), SEQUENCES):
        violations, first = check(lib, world, chunks, model)
        assert (violations > 0) == (len(chunks) > 1), f"P={world} chunks={chunks}: {violations} {first}"
    # The same drop without the per-call model changes nothing: there the streams carry the order on.
    assert check(lib, 2, [2, 3], kernel_testing.CE_DROP_DONE_WAIT)[0] == 0


MIXED = [[SM_CALL, 1], [1, SM_CALL], [2, SM_CALL, 3], [SM_CALL, SM_CALL, 2], [3, SM_CALL, SM_CALL, 1],
         [SM_CALL, 4, SM_CALL], [1, SM_CALL, 1, SM_CALL, 2]]


@pytest.mark.parametrize("model", [0, kernel_testing.CE_MODEL_STREAM_PER_CALL], ids=["one-stream", "stream-per-call"])
@pytest.mark.parametrize("world", range(2, 9))
def test_copy_engine_calls_interleaved_with_sm_calls_are_race_free(lib, world, model):
    """SM-kind calls (the fused kernel, its stores and copy-out over the whole window) between copy-engine
    calls: every copy-engine access is ordered with every SM access of another call, on one stream or on
    streams of their own ordered through the completion event."""
    for chunks in MIXED:
        violations, first = check(lib, world, chunks, model)
        assert violations == 0, f"P={world} chunks={chunks}: {first}"


def test_sm_calls_without_their_entry_barrier_race_with_copy_engine_calls(lib):
    """Negative controls, both directions. An SM call whose CTAs store into peers' windows before meeting them
    races with the copy-outs of the copy-engine call before it (with none before it, nothing is flagged: SM
    pairs within one call are the per-CTA check's, tests/kernel/test_window_sync.py, while SM pairs across
    calls are checked here too). A copy-engine call without its entry barrier races with the SM call before
    it."""
    drop = kernel_testing.CE_DROP_SM_ENTRY_BARRIER
    for world in (2, 3, 8):
        violations, first = check(lib, world, [2, SM_CALL], drop)
        assert violations and "SM kind" in first and "copy-out" in first, first
        assert check(lib, world, [SM_CALL, 2], drop)[0] == 0
        assert check(lib, world, [2, SM_CALL], 0)[0] == 0
        violations, first = check(lib, world, [SM_CALL, 1], kernel_testing.CE_DROP_ENTRY_BARRIER)
        assert violations and "SM kind" in first, first
        assert check(lib, world, [SM_CALL, SM_CALL], drop)[0] > 0  # across two SM calls, too


def test_bad_arguments_are_errors(lib):
    with pytest.raises(AssertionError, match="257 chunks"):
        check(lib, 2, [257])
    with pytest.raises(AssertionError, match="drop 0x100"):
        check(lib, 2, [1], 256)
    with pytest.raises(AssertionError, match="layout 1"):
        check(lib, 2, [1], layout=kernel_testing.LAYOUT_MOVING)
    with pytest.raises(AssertionError, match="world size 9"):
        check(lib, 9, [1])
