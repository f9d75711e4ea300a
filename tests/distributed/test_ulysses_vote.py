"""Multi-rank (gloo) agreement and lifecycle of the Ulysses helper on the CPU plan transport.

Every parity check also asserts which route and plan actually ran (``helper.history``,
``transport.executed``), so parity cannot pass with the fused route silently off.
Rank functions are module-level: the harness imports them by module and name on every rank.
"""

from __future__ import annotations

import pytest
import torch

from fastvideo.distributed.ulysses.policy import ORIGINAL_CTAS, Plan, even_rows
from tests.distributed.conftest import (
    READS_LONG_TRAINING,
    a2a,
    bit_equal,
    build_helper,
    catch,
    last,
    oracle,
    rank_input,
)

B, S, H, D = 3, 16, 12, 8  # S = S_local; H = global heads (divisible by 2, 3 and 4)
ROW_BYTES = H * D * 4  # fp32


def input_shape(mode: int, world_size: int) -> tuple[int, int, int, int]:
    """The op's input for mode 0 ([B, S_local, H, D]) or mode 1 ([B, S_global, H/P, D])."""
    return (B, S, H, D) if mode == 0 else (B, S * world_size, H // world_size, D)


# ------------------------------------------------------------------------------------- construction


def _construct(rank, world_size):
    h = build_helper()
    out = (h.stats()["construction"], h.fused_available, h.stats()["transport"], h.generation, h.world_size)
    h.destroy()
    return out


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_construction_agrees_on_every_rank(ranks, world_size):
    """Same capability, one host, every step succeeded: construction is 'ok' on every rank, same generation."""
    results = ranks(world_size, _construct)
    assert len(set(results)) == 1
    construction, available, transport, _, ws = results[0]
    assert (construction, available, transport, ws) == ("ok", True, "gloo-plan", world_size)


# ------------------------------------------------------------------------------------- parity


def _parity(rank, world_size, mode):
    """Four helpers (tuned/untuned x big/small window); each call's output, record and executed plan."""
    x = rank_input(rank, input_shape(mode, world_size), seed=mode)
    want = oracle(x, mode)
    out = []
    for tuned, window in ((True, 1 << 20), (True, 4096), (False, 1 << 20), (False, 4096)):
        h = build_helper(window_bytes=window, tuned=tuned)
        y = a2a(h, x, mode)
        executed = [(p.word, n) for p, n in h.transport.executed]
        out.append((bit_equal(y, want), last(h), executed))
        h.destroy()
    return out


@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("world_size", [2, 3, 4])
@READS_LONG_TRAINING
def test_fused_is_bit_exact_vs_nccl_route_with_the_expected_plans(ranks, world_size, mode):
    """Fused output equals the NCCL route bit for bit for: tuned one-plane chunks, tuned sub-plane chunks
    through a 4 KiB window, the original whole-operand plan; and the original policy declines WINDOW."""
    rows = even_rows(S, 4096 // ROW_BYTES)  # at most 10 rows fit: two even chunks of 8 rows
    expected = [
        ("fused", Plan(144, 1, S, True).word, None, B),
        ("fused", Plan(144, 1, rows, True).word, None, B * 2),
        ("fused", Plan(ORIGINAL_CTAS, B, S, False).word, None, 1),
        ("nccl", 0, "window", 0),
    ]
    for rank_result in ranks(world_size, _parity, mode):
        for (equal, record, executed), (route, word, reason, chunks) in zip(rank_result, expected):
            assert equal
            assert record == (route, word, reason, chunks, "FORWARD_NO_GRAD")
            assert executed == ([(word, chunks)] if route == "fused" else [])


def _parity_bf16(rank, world_size):
    x = rank_input(rank, (4, 8, 12, 8), torch.bfloat16, seed=5)
    h = build_helper(window_bytes=2 * 8 * 12 * 8 * 2)  # two bf16 planes fit, the tuned row asks for one
    y = a2a(h, x, 0)
    result = (bit_equal(y, oracle(x, 0)), last(h))
    h.destroy()
    return result


@READS_LONG_TRAINING
def test_fused_bf16_is_bit_exact(ranks):
    """bf16 moves as raw bits: the fused route matches the NCCL route exactly, one plane per chunk."""
    for equal, record in ranks(2, _parity_bf16):
        assert equal and record == ("fused", Plan(144, 1, 8, True).word, None, 4, "FORWARD_NO_GRAD")


# ------------------------------------------------------------------------------------- outputs own storage


def _retained(rank, world_size, window):
    h = build_helper(window_bytes=window)
    x1, x2 = rank_input(rank, (B, S, H, D), seed=1), rank_input(rank, (B, S, H, D), seed=2)
    y1 = a2a(h, x1, 0)
    kept = y1.clone()
    y2 = a2a(h, x2, 0)
    window = h.transport._window
    w0, w1 = window.data_ptr(), window.data_ptr() + window.numel()
    y1_start = y1.untyped_storage().data_ptr()
    y1_end = y1_start + y1.untyped_storage().nbytes()
    result = (
        bit_equal(y1, kept),
        bit_equal(y1, oracle(x1, 0)) and bit_equal(y2, oracle(x2, 0)),
        not bit_equal(y1, y2),
        y1_end <= w0 or y1_start >= w1,  # no overlap with the transport window
        y1.untyped_storage().data_ptr() != y2.untyped_storage().data_ptr(),
        [r.route for r in h.history],
    )
    h.destroy()
    return result


@pytest.mark.parametrize("window", [4096, 1 << 20], ids=["sub-plane-window", "whole-output-fits-window"])
@READS_LONG_TRAINING
def test_retained_output_is_unchanged_by_a_later_call(ranks, window):
    """Output 1 survives call 2 unchanged and shares no storage with the window or with output 2 (also when
    the window could hold the whole output, where returning a window view would be tempting)."""
    for unchanged, exact, differ, outside_window, distinct, routes in ranks(2, _retained, window):
        assert unchanged and exact and differ and outside_window and distinct
        assert routes == ["fused", "fused"]


# ------------------------------------------------------------------------------------- stats and logging


def _stats_and_logging(rank, world_size):
    from fastvideo.distributed.ulysses import stats as stats_mod

    warnings: list[str] = []
    original = stats_mod.logger.warning
    stats_mod.logger.warning = lambda msg, *a, **k: (warnings.append(msg % a), original(msg, *a, **k))
    try:
        h = build_helper()
        x = rank_input(rank, (B, S, H, D))
        x64 = x.double()  # the transport does not move float64: DTYPE
        strided = rank_input(rank, (B, S, D, H)).transpose(2, 3)  # valid [B, S, H, D], not contiguous
        exact = True
        for t in (x64, x64, x64, strided, strided, x, x):
            exact &= bit_equal(a2a(h, t, 0), oracle(t, 0))
        stats = h.stats()
        h.destroy()
    finally:
        stats_mod.logger.warning = original
    return exact, stats["calls"], stats["fused"], stats["declines"], warnings


@READS_LONG_TRAINING
def test_stats_count_every_decline_and_log_once_per_reason(ranks):
    """Three DTYPE and two NON_CONTIGUOUS declines are all counted; each reason is logged exactly once."""
    for exact, calls, fused, declines, warnings in ranks(2, _stats_and_logging):
        assert exact and calls == 7 and fused == 2
        assert declines == {"dtype": 3, "non_contiguous": 2}
        assert len(warnings) == 2
        assert "(dtype)" in warnings[0] and "(non_contiguous)" in warnings[1]


# ------------------------------------------------------------------------------------- the public op


def _public_op(rank, world_size):
    from fastvideo.distributed.communication_op import sequence_model_parallel_all_to_all_4D
    from fastvideo.distributed.ulysses import registry

    h = build_helper()
    registry.install_default_helper(h)
    x = rank_input(rank, (B, S, H, D))
    try:
        y = sequence_model_parallel_all_to_all_4D(x, scatter_dim=2, gather_dim=1)
        back = sequence_model_parallel_all_to_all_4D(y, scatter_dim=1, gather_dim=2)
        return bit_equal(y, oracle(x, 0)), bit_equal(back, x), [(r.route, r.mode) for r in h.history]
    finally:
        registry.destroy_default_helper()


@READS_LONG_TRAINING
@pytest.mark.parametrize("route, expected", [("auto", [("fused", 0), ("fused", 1)]), ("off", [])])
def test_public_op_routes_through_the_helper_only_under_auto(ranks, route, expected):
    """auto: the op votes through the installed helper (history grows, fused); off: the helper is not called."""
    for exact, round_trip, history in ranks(2, _public_op, env={"FASTVIDEO_ULYSSES_A2A": route}):
        assert exact and round_trip and history == expected


# ------------------------------------------------------------------------------------- lifecycle


def _lifecycle(rank, world_size):
    x = rank_input(rank, (B, S, H, D))
    h1 = build_helper()
    first = last(h1) if bit_equal(a2a(h1, x, 0), oracle(x, 0)) else None
    h1.destroy()
    h1.destroy()  # a no-op, not an error
    after = catch(a2a, h1, x, 0)
    stats1 = h1.stats()
    h2 = build_helper()
    second = last(h2) if bit_equal(a2a(h2, x, 0), oracle(x, 0)) else None
    gens = (h1.generation, h2.generation)
    h2.destroy()
    return first, after[0], stats1["destroyed"], stats1["declines"], second, gens, h1.fused_available


@READS_LONG_TRAINING
def test_lifecycle_destroy_rebuild_generation(ranks):
    """Use after destroy raises HelperDisposedError; destroy twice is a no-op; a rebuilt helper has a larger
    generation and runs fused again."""
    results = ranks(2, _lifecycle)
    for first, after, destroyed, declines, second, (g1, g2), available in results:
        assert first is not None and first[0] == "fused"
        assert after == "HelperDisposedError" and destroyed and not available
        assert declines == {"disposed": 1}
        assert second is not None and second[0] == "fused"
        assert g2 > g1
    assert len({r[5] for r in results}) == 1  # same generations on every rank (they are in the HEADER field)


def _rebuild_many(rank, world_size, rounds):
    x = rank_input(rank, (B, S, H, D))
    routes = []
    for _ in range(rounds):
        h = build_helper(vote_timeout_s=5.0)
        y = a2a(h, x, 0)
        routes.append(last(h)[0] if bit_equal(y, oracle(x, 0)) else "wrong")
        h.destroy()
    return routes


@READS_LONG_TRAINING
def test_helpers_rebuilt_in_sequence_each_construct_and_run(ranks):
    """Regression: destroying a helper must not make the next one reuse its vote group's name and store
    keys (torch names local-sync groups by len(pg_names); deregistering on destroy recycled the name and
    peers connected to stale addresses, timing out)."""
    for routes in ranks(3, _rebuild_many, 5):
        assert routes == ["fused"] * 5


# ------------------------------------------------------------------------------------- what bounds a vote


def _timeout_without_set_timeout(rank, world_size, per_call):
    """rank 0 votes alone with set_timeout refused (torch 2.11 under DETAIL); ``per_call`` False also takes
    away the per-call timeout, leaving the vote group's own. Returns (error type, seconds) on rank 0."""
    import time

    import torch.distributed as dist

    from fastvideo.distributed.ulysses import vote

    def refuse(self, timeout):
        raise RuntimeError("Backend gloo does not support setting timeout")

    dist.ProcessGroup.set_timeout = refuse
    if not per_call:
        vote._allgather_options = lambda timeout_s: None
    # The gloo vote pinned: where the kernel library loads, "auto" votes over shared memory, which this is not about.
    h = build_helper(vote_timeout_s=1.5, vote="gloo")
    result = None
    if rank == 0:  # rank 1 never calls
        start = time.monotonic()
        kind = catch(h.all_to_all, rank_input(rank, (B, S, H, D)), 0)[0]
        result = (kind, time.monotonic() - start)
    dist.barrier()
    h.destroy()
    return result


GROUP_TIMEOUT_S = "8"  # the vote group's own timeout (FASTVIDEO_ULYSSES_A2A_VOTE_TIMEOUT_S when it was created)


def test_a_vote_is_bounded_by_the_helpers_timeout_where_the_group_timeout_cannot_be_set(ranks):
    """The helper asks for 1.5 s; the group was created with 8 s and refuses set_timeout: the vote still
    times out after about 1.5 s, because each exchange carries the helper's timeout."""
    kind, seconds = ranks(2, _timeout_without_set_timeout, True,
                          env={"FASTVIDEO_ULYSSES_A2A_VOTE_TIMEOUT_S": GROUP_TIMEOUT_S}, timeout_s=60)[0]
    assert kind == "VoteTimeoutError" and seconds < 5, seconds


def test_negative_control_without_the_per_call_timeout_the_group_timeout_bounds_the_vote(ranks):
    kind, seconds = ranks(2, _timeout_without_set_timeout, False,
                          env={"FASTVIDEO_ULYSSES_A2A_VOTE_TIMEOUT_S": GROUP_TIMEOUT_S}, timeout_s=60)[0]
    assert kind == "VoteTimeoutError" and seconds >= float(GROUP_TIMEOUT_S) - 1, seconds
