"""The copy-engine plan kind's synchronisation as a property (CPU, runs in CI).

``fvk_check_ce_sync`` (csrc/ulysses_a2a/testing/ce_sync_model.cpp, in the test library) replays
``ce_schedule`` -- the schedule the launcher executes (ce_plan.h) -- on every rank for a sequence of calls,
builds the happens-before graph of stream order, event records and waits (with the reuse of the context's
events, as issued) and paired barriers, and checks that every push into a window block and every copy-out
of it are ordered in sequence order, and that the copy-stream work of a call stays inside the call.

Negative controls: each ordering the argument relies on, dropped alone, must be flagged.
"""

from __future__ import annotations

import ctypes
import itertools

import pytest

from tests.kernel.built import fastvideo_kernel, kernel_testing


@pytest.fixture(scope="module")
def lib(testing_lib):
    return testing_lib


def check(lib, world: int, chunks: list[int], drop: int = 0) -> tuple[int, str]:
    arr = (ctypes.c_int64 * len(chunks))(*chunks)
    violations = ctypes.c_int64(-1)
    msg = ctypes.create_string_buffer(512)
    status = lib.fvk_check_ce_sync(world, len(chunks), arr, drop, ctypes.byref(violations), msg, len(msg))
    assert status == 0, fastvideo_kernel.last_error(lib)
    return violations.value, msg.value.decode()


SEQUENCES = [[1], [2], [3], [7], [1, 1], [1, 4], [4, 1], [2, 3, 5], [5, 2, 1], [6, 6], [1, 2, 1, 3]]


@pytest.mark.parametrize("world", range(2, 9))
def test_schedule_is_race_free(lib, world):
    for chunks in SEQUENCES:
        violations, first = check(lib, world, chunks)
        assert violations == 0, f"P={world} chunks={chunks}: {first}"


@pytest.mark.parametrize(("drop", "needs"), [
    (kernel_testing.CE_DROP_WAIT_COPIED, ("unordered",)),
    (kernel_testing.CE_DROP_ENTRY_BARRIER, ("unordered",)),
    (kernel_testing.CE_DROP_LANDED_BARRIER, ("unordered",)),
    (kernel_testing.CE_DROP_FORK, ("before the caller's stream",)),
    # Without the join a call's copy-outs also race with the next call's pushes.
    (kernel_testing.CE_DROP_JOIN, ("after the call ended", "unordered")),
])
def test_every_ordering_is_needed(lib, drop, needs):
    """Each dropped ordering is caught; the first violation names what went wrong."""
    flagged = []
    for world, chunks in itertools.product((2, 3, 8), SEQUENCES):
        violations, first = check(lib, world, chunks, drop)
        if violations:
            assert any(n in first for n in needs), first
            flagged.append((world, tuple(chunks)))
    assert flagged, f"drop {drop} was never flagged"
    # Where each control must bite: the wait only matters from chunk 2 on (a buffer's second use in a call).
    if drop == kernel_testing.CE_DROP_WAIT_COPIED:
        assert (2, (3,)) in flagged and (2, (2,)) not in flagged
    else:
        assert (2, (1,)) in flagged or (2, (1, 1)) in flagged


@pytest.mark.parametrize("world", range(2, 9))
def test_calls_ordered_only_through_the_completion_event_are_race_free(lib, world):
    """Each call on streams of its own (CUDA-graph replays, calls on changing streams): the completion event,
    recorded after the join and waited for before the fork, is the only cross-call ordering, and suffices."""
    for chunks in SEQUENCES:
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


SM = kernel_testing.CE_SM_CALL
MIXED = [[SM, 1], [1, SM], [2, SM, 3], [SM, SM, 2], [3, SM, SM, 1], [SM, 4, SM], [1, SM, 1, SM, 2]]


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
        violations, first = check(lib, world, [2, SM], drop)
        assert violations and "SM kind" in first and "copy-out" in first, first
        assert check(lib, world, [SM, 2], drop)[0] == 0
        assert check(lib, world, [2, SM], 0)[0] == 0
        violations, first = check(lib, world, [SM, 1], kernel_testing.CE_DROP_ENTRY_BARRIER)
        assert violations and "SM kind" in first, first
        assert check(lib, world, [SM, SM], drop)[0] > 0  # across two SM calls, too


def test_bad_arguments_are_errors(lib):
    arr = (ctypes.c_int64 * 1)(0)
    v = ctypes.c_int64()
    assert lib.fvk_check_ce_sync(2, 1, arr, 0, ctypes.byref(v), None, 0) == 1
    assert "chunks=0" in fastvideo_kernel.last_error(lib)
    arr[0] = 1
    assert lib.fvk_check_ce_sync(2, 1, arr, 256, ctypes.byref(v), None, 0) == 1
    arr[0] = -2
    assert lib.fvk_check_ce_sync(2, 1, arr, 0, ctypes.byref(v), None, 0) == 1
    assert "SM-kind call" in fastvideo_kernel.last_error(lib)
    assert lib.fvk_check_ce_sync(9, 1, arr, 0, ctypes.byref(v), None, 0) == 1


# ------------------------------------------------------------------------------------- addressing

def addressing(lib, world, mode, dtype, shape, plan, flags=0):
    """(wrong bytes, first) of one copy-engine call on the host (``fvk_check_ce_addressing``)."""
    wrong = ctypes.c_int64(-1)
    msg = ctypes.create_string_buffer(256)
    b, s, h, d = shape
    status = lib.fvk_check_ce_addressing(world, mode, dtype, b, s, h, d, plan[0], plan[1], flags, ctypes.byref(wrong),
                                         msg, len(msg))
    assert status == 0, fastvideo_kernel.last_error(lib)
    return wrong.value, msg.value.decode()


# (B, S_local, H global, D) x plans (planes, rows per chunk): whole, planes then a smaller last, uneven
# rows, one row per chunk; fp32 (4 bytes) and bf16 (2) so runs are 32..1024 bytes.
SHAPES = [(1, 7, 8, 8), (3, 5, 16, 4), (4, 9, 8, 16), (2, 16, 24, 8)]


@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("mode", [0, 1])
def test_copy_engine_addressing_is_the_all_to_all(lib, world, mode):
    """Every byte of every rank's output equals the all-to-all's definition, for plans with chunks of
    different sizes, through the launcher's copies and the kernels' addressing (on the host)."""
    for b, s, h, d in SHAPES:
        h = h // 8 * world if h % world else h  # H divisible by P
        for dtype in (1, 3):
            for plan in ((b, s), (2, s), (1, s), (1, 3), (2, 2), (1, 1)):
                wrong, first = addressing(lib, world, mode, dtype, (b, s, h, d), plan)
                assert wrong == 0, f"P={world} mode {mode} {(b, s, h, d)} dtype {dtype} plan {plan}: {first}"


def test_swapped_buffers_are_caught(lib):
    """Negative control: copy-outs that read the other buffer give wrong bytes, with one chunk and with many."""
    for plan in ((3, 5), (1, 2)):
        wrong, first = addressing(lib, 2, 0, 3, (3, 5, 8, 8), plan, flags=kernel_testing.CE_CHECK_SWAP_BUFFERS)
        assert wrong > 0 and "wrong bytes" in first


def test_addressing_check_rejects_bad_input(lib):
    v = ctypes.c_int64()
    assert lib.fvk_check_ce_addressing(2, 0, 3, 1, 4, 7, 8, 1, 4, 0, ctypes.byref(v), None, 0) == 1  # H % P
    assert lib.fvk_check_ce_addressing(2, 0, 3, 1, 4, 8, 8, 1, 4, 2, ctypes.byref(v), None, 0) == 1  # flags
    assert lib.fvk_check_ce_addressing(2, 0, 3, 64, 1 << 20, 8, 64, 1, 4, 0, ctypes.byref(v), None, 0) == 1  # size
