"""Autograd through the helper (backward runs the forward's plan and still votes), gradient exactness,
and a 100-round random-shape stress against the NCCL route with the plan of every round asserted."""

from __future__ import annotations

import pytest
import torch

from fastvideo.distributed.ulysses.policy import ORIGINAL_CTAS, Geometry, Plan, choose_plan, even_rows
from tests.distributed.conftest import (
    GPU_NAME,
    a2a,
    bit_equal,
    build_helper,
    fixture_rows,
    local_config,
    oracle,
    rank_input,
)

B, S, H, D = 3, 16, 12, 8


def input_shape(mode, world_size, b=B, s=S, h=H, d=D):
    return (b, s, h, d) if mode == 0 else (b, s * world_size, h // world_size, d)


def nccl_forward_backward(x, w, mode):
    """Output and input gradient of ``(a2a(x) * w).sum()`` from the plain NCCL route (the oracle)."""
    from tests.distributed.conftest import nccl_reference

    return nccl_reference(x, w, mode)


def single_device_reference(rank, world_size, mode, dtype, x_seed, w_seed):
    """Every rank's forward and gradient computed on one device (no collective), returned for ``rank``."""
    from fastvideo.distributed.communication_op import reference_all_to_all

    shape = input_shape(mode, world_size)
    xs = [rank_input(r, shape, dtype, seed=x_seed, requires_grad=True) for r in range(world_size)]
    outs = reference_all_to_all(xs, mode)
    ws = [rank_input(r, outs[r].shape, dtype, seed=w_seed) for r in range(world_size)]
    sum((o * w).sum() for o, w in zip(outs, ws)).backward()
    return outs[rank].detach(), xs[rank].grad


def records(h, n):
    return [(r.phase.name, r.route, r.plan.word if r.plan else 0, None if r.reason is None else r.reason.label,
             r.chunks) for r in list(h.history)[-n:]]


# ------------------------------------------------------------------------------------- exact gradients


def _grad_parity(rank, world_size, mode, dtype):
    h = build_helper(window_bytes=4096)  # fp32: at most 10 rows fit; 16 rows become two even chunks of 8
    x = rank_input(rank, input_shape(mode, world_size), dtype, seed=3, requires_grad=True)
    y = a2a(h, x, mode)
    w = rank_input(rank, y.shape, dtype, seed=4)
    (y * w).sum().backward()
    y_nccl, g_nccl = nccl_forward_backward(x, w, mode)
    y_ref, g_ref = single_device_reference(rank, world_size, mode, dtype, 3, 4)
    result = (bit_equal(y, y_nccl), bit_equal(x.grad, g_nccl), bit_equal(y, y_ref), bit_equal(x.grad, g_ref),
              records(h, 2))
    h.destroy()
    return result


@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("world_size", [2, 4])
def test_fused_gradients_bit_exact_vs_nccl_route_and_single_device(ranks, world_size, mode):
    """fp32 forward and input gradient through the fused route (sub-plane chunks both ways) equal the NCCL
    route and the single-device reference bit for bit; backward ran fused with the forward's plan."""
    plan = Plan(144, 1, even_rows(S, 4096 // (H * D * 4)), True).word
    env = {"FASTVIDEO_ULYSSES_A2A_LONG_TRAINING": "auto"}
    for *exact, recs in ranks(world_size, _grad_parity, mode, torch.float32, env=env):
        assert all(exact)
        assert recs == [("FORWARD_GRAD", "fused", plan, None, 6), ("BACKWARD", "fused", plan, None, 6)]


def _ce_parity(rank, world_size, mode, entries):
    from dataclasses import replace

    from tests.plan_transport import GlooPlanTransport

    transport = GlooPlanTransport()
    if entries is not None:  # a build without the copy-engine entry point
        transport = GlooPlanTransport(capability_override=replace(GlooPlanTransport().capability(),
                                                                  entry_points=frozenset(entries)))
    h = build_helper(window_bytes=4096, transport=transport, table=fixture_rows(engine="ce"))
    x = rank_input(rank, input_shape(mode, world_size), torch.float32, seed=3, requires_grad=True)
    y = a2a(h, x, mode)
    w = rank_input(rank, y.shape, torch.float32, seed=4)
    (y * w).sum().backward()
    y_nccl, g_nccl = nccl_forward_backward(x, w, mode)
    result = (bit_equal(y, y_nccl), bit_equal(x.grad, g_nccl), records(h, 2))
    h.destroy()
    return result


@pytest.mark.parametrize("mode", [0, 1])
def test_copy_engine_rows_run_double_buffered_plans_exactly(ranks, mode):
    """A ``ce`` row gives a copy-engine plan whose chunks fit half the window (4 KiB: 5 fp32 rows of 768 B,
    so 16 rows become 4 even chunks of 4); forward and backward run it and equal the NCCL route bit for bit.
    A build without the ``ce`` entry point ignores the row and runs the original plan (the control)."""
    ce = Plan(144, 1, even_rows(S, 2048 // (H * D * 4)), True, engine="ce").word
    env = {"FASTVIDEO_ULYSSES_A2A_LONG_TRAINING": "auto"}
    for y_ok, g_ok, recs in ranks(2, _ce_parity, mode, None, env=env):
        assert y_ok and g_ok
        assert recs == [("FORWARD_GRAD", "fused", ce, None, 12), ("BACKWARD", "fused", ce, None, 12)]
    for y_ok, g_ok, recs in ranks(2, _ce_parity, mode, ("original", "tuned"), env=env):
        assert y_ok and g_ok
        assert [r[2] for r in recs] != [ce, ce] and all(r[1] == "nccl" for r in recs)  # 18 KiB > 4 KiB: WINDOW


def test_float64_gradients_exact_through_the_dtype_decline(ranks):
    """float64 is not moved by the kernel: forward and backward both decline DTYPE collectively, and the
    NCCL-route results still equal the NCCL route and the single-device reference exactly."""
    env = {"FASTVIDEO_ULYSSES_A2A_LONG_TRAINING": "auto"}
    for *exact, recs in ranks(2, _grad_parity, 0, torch.float64, env=env):
        assert all(exact)
        assert recs == [("FORWARD_GRAD", "nccl", 0, "dtype", 0), ("BACKWARD", "nccl", 0, "dtype", 0)]


# ------------------------------------------------------------------------------------- backward keeps the plan


def _backward_keeps_forward_plan(rank, world_size, forward_lt, backward_lt, window, drop_table):
    from fastvideo import envs
    from fastvideo.distributed.ulysses import policy

    # Shrink the 512 MiB long-training threshold (a policy module constant) so a test-sized grad-tracked
    # plane counts as "long training"; the real threshold is covered by the pure policy tests.
    policy.LONG_TRAINING_PLANE_BYTES = 64
    with envs.override(FASTVIDEO_ULYSSES_A2A_LONG_TRAINING=forward_lt):
        h = build_helper(window_bytes=window)  # agrees forward_lt at construction
    x = rank_input(rank, (B, S, H, D), seed=5, requires_grad=True)
    y = a2a(h, x, 0)
    w = rank_input(rank, y.shape, seed=6)
    # The policy changes under the backward's feet, on every rank: another long-training value, and for the
    # tuned case no tuned rows either.
    with local_config(h, long_training=backward_lt, table=() if drop_table else h.planner.config.table):
        geom = Geometry.from_input(x.shape, 0, world_size, x.dtype)
        now = h.plan_for(geom, grad=True)  # what the policy would choose at backward time
        (y * w).sum().backward()
    _, g_nccl = nccl_forward_backward(x, w, 0)
    result = (bit_equal(x.grad, g_nccl), records(h, 2), now.plan.word if now.plan else now.reason.label)
    h.destroy()
    return result


def test_backward_runs_the_forwards_tuned_plan_after_the_policy_changed(ranks):
    """Forward under LONG_TRAINING=chunked runs the tuned plan; switching to auto (and dropping the tuned
    rows) before backward makes the policy pick the original plan, yet BACKWARD runs the forward's tuned plan."""
    tuned, original = Plan(144, 1, S, True).word, Plan(ORIGINAL_CTAS, B, S, False).word
    for exact, recs, now in ranks(2, _backward_keeps_forward_plan, "chunked", "auto", 1 << 20, True):
        assert exact and now == original
        assert recs == [("FORWARD_GRAD", "fused", tuned, None, B), ("BACKWARD", "fused", tuned, None, B)]


def test_backward_keeps_the_forwards_decline_after_the_policy_changed(ranks):
    """Forward under auto declines WINDOW (original policy, operand > 4 KiB window); switching to chunked
    would now allow a tuned sub-plane plan, yet BACKWARD declines WINDOW like its forward."""
    for exact, recs, now in ranks(2, _backward_keeps_forward_plan, "auto", "chunked", 4096, False):
        assert exact and now == Plan(144, 1, even_rows(S, 4096 // (H * D * 4)), True).word
        assert recs == [("FORWARD_GRAD", "nccl", 0, "window", 0), ("BACKWARD", "nccl", 0, "window", 0)]


def _backward_disagreement(rank, world_size):
    h = build_helper()
    x = rank_input(rank, (B, S, H, D), seed=7, requires_grad=True)
    y = a2a(h, x, 0)
    w = rank_input(rank, y.shape, seed=8)
    with local_config(h, dtypes=() if rank == 1 else h.planner.config.dtypes):  # rank 1's transport moves nothing now
        (y * w).sum().backward()
    _, g_nccl = nccl_forward_backward(x, w, 0)
    result = (bit_equal(x.grad, g_nccl), records(h, 2))
    h.destroy()
    return result


def test_backward_still_votes_and_declines_together(ranks):
    """Rank 1 loses eligibility between forward and backward: the backward vote declines PEER_DISAGREEMENT on
    every rank (no rank runs the fused plan alone) and the gradient is still exact."""
    plan = Plan(144, 1, S, True).word
    env = {"FASTVIDEO_ULYSSES_A2A_LONG_TRAINING": "auto"}
    for exact, recs in ranks(2, _backward_disagreement, env=env):
        assert exact
        assert recs == [("FORWARD_GRAD", "fused", plan, None, B), ("BACKWARD", "nccl", 0, "peer_disagreement", 0)]


def _non_contiguous_grad(rank, world_size):
    h = build_helper()
    x = rank_input(rank, (B, S, H, D), seed=9, requires_grad=True)
    y = a2a(h, x, 0)
    y.sum().backward()  # the incoming gradient is an expanded (stride-0, non-contiguous) tensor of ones
    result = (bit_equal(x.grad, torch.ones_like(x)), records(h, 2))
    h.destroy()
    return result


def test_non_contiguous_incoming_gradient_is_made_contiguous(ranks):
    """An expanded incoming gradient is made contiguous before the backward vote, so it runs fused."""
    plan = Plan(144, 1, S, True).word
    env = {"FASTVIDEO_ULYSSES_A2A_LONG_TRAINING": "auto"}
    for exact, recs in ranks(2, _non_contiguous_grad, env=env):
        assert exact and recs[1] == ("BACKWARD", "fused", plan, None, B)


# ------------------------------------------------------------------------------------- stress


def _stress(rank, world_size, rounds):
    p = world_size
    dtypes = (torch.float32, torch.bfloat16)
    table = fixture_rows(world_sizes=(p,), heads=(p, 2 * p), head_dims=(4, 8), dtypes=dtypes)
    windows = (256, 1 << 16)  # 256 B: most tuned planes need sub-plane chunks
    helpers = {w: build_helper(window_bytes=w, table=table) for w in windows}
    g = torch.Generator().manual_seed(1234)  # same draws on every rank

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=g))]

    failures, counts = [], {"fused": 0, "sub_plane": 0, "nccl": 0, "grad": 0}
    for i in range(rounds):
        b, s = pick((1, 2, 3, 4)), pick((1, 2, 5, 8, 12))
        h_, d = p * pick((1, 2, 3)), pick((2, 4, 8))
        mode, dtype, window = pick((0, 1)), pick(dtypes), pick(windows)
        grad = i % 10 == 0
        helper = helpers[window]
        x = rank_input(rank, input_shape(mode, p, b, s, h_, d), dtype, seed=100 + i, requires_grad=grad)
        geom = Geometry.from_input(x.shape, mode, p, dtype)
        expected = choose_plan(geom, gpu=GPU_NAME, window_bytes=window, grad=grad, long_training="auto",
                               table=table)
        y = a2a(helper, x, mode)
        if grad:
            w = rank_input(rank, y.shape, dtype, seed=500 + i)
            (y * w).sum().backward()
            _, g_nccl = nccl_forward_backward(x, w, mode)
            fwd, bwd = list(helper.history)[-2:]
            if not bit_equal(x.grad, g_nccl) or bwd.plan != fwd.plan or bwd.phase.name != "BACKWARD":
                failures.append((i, "grad", geom))
            rec = fwd
            counts["grad"] += 1
        else:
            rec = helper.history[-1]
        if not bit_equal(y, oracle(x, mode)):
            failures.append((i, "output", geom))
        if expected.plan is not None:
            ok = rec.route == "fused" and rec.plan == expected.plan and rec.chunks == expected.plan.num_chunks(geom)
            counts["fused"] += 1
            counts["sub_plane"] += expected.plan.sub_plane(geom)
        else:
            ok = rec.route == "nccl" and rec.reason == expected.reason
            counts["nccl"] += 1
        if not ok:
            failures.append((i, "plan", geom, rec, expected))
    for helper in helpers.values():
        helper.destroy()
    return [str(f) for f in failures], counts


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_random_shape_stress_is_bit_exact_with_the_expected_plan_every_round(ranks, world_size):
    """100 rounds of random B, S, H (multiple of P), D, mode, dtype (fp32/bf16), window (some force sub-plane
    chunks) and every tenth round grad-tracked: every output (and gradient) equals the NCCL route bit for bit
    and every round ran exactly the plan (or decline) the pure policy predicts."""
    results = ranks(world_size, _stress, 100, env={"FASTVIDEO_ULYSSES_A2A_LONG_TRAINING": "auto"}, timeout_s=180)
    for failures, counts in results:
        assert failures == []
        assert counts["fused"] > 0 and counts["sub_plane"] > 0 and counts["nccl"] > 0 and counts["grad"] == 10
