"""The public op over real gloo process groups: both directions, SP 2-4, B 1-4, three dtypes,
gradients, bad input, and the SP attention block against its single-device reference.

Every rank builds the same full tensor from a shared seed, takes its shard, and compares what the
op returns with the slice of the full tensor it must hold, bit for bit (data movement must not
change a bit). The NCCL route runs here (``FASTVIDEO_ULYSSES_A2A=off`` is forced per rank so the
ambient environment cannot change which route is tested). Inputs with a step run under ``off`` and
``auto``, with the route of every call asserted (the NCCL route); their negative control runs the same
calls fused through a helper on the CPU plan transport, where that assertion fails.
"""

from __future__ import annotations

import pytest
import torch

from fastvideo.distributed.communication_op import sequence_model_parallel_all_to_all_4D as a2a
from fastvideo.distributed.parallel_state import get_sp_group
from tests.distributed.mp import RankError, run_ranks

OFF = {"FASTVIDEO_ULYSSES_A2A": "off"}
DTYPES = (torch.float32, torch.float64, torch.bfloat16)


def _full(b: int, s: int, h: int, d: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, s, h, d, generator=g, dtype=torch.float64).to(dtype)


def _shards(p: int, r: int, s: int, h: int) -> tuple[slice, slice]:
    return slice(r * s // p, (r + 1) * s // p), slice(r * h // p, (r + 1) * h // p)


def forward_both_directions(rank: int, world: int) -> int:
    checked = 0
    for b in (1, 2, 3, 4):
        for dtype in DTYPES:
            s, h, d = 6 * world, 2 * world, 5
            full = _full(b, s, h, d, dtype, seed=100 * b + world)
            seq, heads = _shards(world, rank, s, h)
            y = a2a(full[:, seq].contiguous(), scatter_dim=2, gather_dim=1)
            assert y.shape == (b, s, h // world, d) and y.dtype == dtype
            assert torch.equal(y, full[:, :, heads]), f"mode 0 b={b} {dtype}"
            z = a2a(y, scatter_dim=1, gather_dim=2)
            assert torch.equal(z, full[:, seq]), f"mode 1 b={b} {dtype}"
            checked += 2
    return checked


@pytest.mark.parametrize("world", [2, 3, 4])
def test_forward_both_directions_bit_exact(world):
    assert run_ranks(world, forward_both_directions, env=OFF) == [24] * world


def gradients_match_reference(rank: int, world: int) -> None:
    b, s, h, d = 3, 4 * world, 2 * world, 4
    full = _full(b, s, h, d, torch.float64, seed=7)
    weight = _full(b, s, h, d, torch.float64, seed=8)  # loss = sum(out * weight-slice)
    seq, heads = _shards(world, rank, s, h)
    for mode, (sd, gd) in enumerate(((2, 1), (1, 2))):
        ref_in = full.clone().requires_grad_()
        if mode == 0:  # rank r holds a sequence shard, receives a head shard
            x = full[:, seq].clone().requires_grad_()
            out_slice = (slice(None), slice(None), heads)
            in_slice = (slice(None), seq)
        else:  # rank r holds a head shard of the whole sequence, receives a sequence shard
            x = full[:, :, heads].clone().requires_grad_()
            out_slice = (slice(None), seq)
            in_slice = (slice(None), slice(None), heads)
        y = a2a(x, scatter_dim=sd, gather_dim=gd)
        (y * weight[out_slice]).sum().backward()
        # Single-device reference: every rank's loss term on the full tensor.
        total = 0
        for r in range(world):
            sq, hd = _shards(world, r, s, h)
            sl = (slice(None), slice(None), hd) if mode == 0 else (slice(None), sq)
            total = total + (ref_in[sl] * weight[sl]).sum()
        total.backward()
        assert torch.equal(x.grad, ref_in.grad[in_slice]), f"mode {mode}"


@pytest.mark.parametrize("world", [2, 3, 4])
def test_gradients_match_single_device_reference_float64(world):
    run_ranks(world, gradients_match_reference, env=OFF)


def stepped_inputs_are_exact(rank: int, world: int, fused: bool = False) -> tuple[list[str], tuple]:
    """Inputs with a step in the last dim (``full[..., ::2]``'s layout), B = 1 and 2, both modes, sync and in
    flight, with and without autograd: each output against the slice of the full tensor it must hold, and each
    gradient against the weights. With B = 1 and one row per rank, mode 0's input flattens to a 1-D view with a
    step: the layout the backends cannot send. Also what ran: the route of each start in flight (the forwards' and
    the backwards'), whether the agreed route is resolved, and the (route, decline reason) of each call its helper
    recorded (None without one: the NCCL route). ``fused`` (the route assertion's negative control): contiguous
    copies of the same inputs through a helper on the CPU plan transport, which runs them fused."""
    from fastvideo.distributed.ulysses import registry
    from tests.distributed.conftest import build_helper, in_flight_routes

    if fused:
        registry.install_default_helper(build_helper())
    wrong = []
    with in_flight_routes() as starts:
        for b, rows in ((1, 1), (1, 2), (2, 1)):
            s, h, d = rows * world, 2 * world, 3
            full = _full(b, s, h, 2 * d, torch.float32, seed=11 + b + rows)[..., ::2]
            seq, heads = _shards(world, rank, s, h)
            for mode, (x, want) in enumerate(((full[:, seq], full[:, :, heads]), (full[:, :, heads], full[:, seq]))):
                assert not x.is_contiguous()
                x = x.contiguous() if fused else x
                for async_op in (False, True):
                    for grad in (False, True):
                        leaf = x.detach().requires_grad_(grad) if grad else x
                        y = a2a(leaf, *((2, 1), (1, 2))[mode], async_op=async_op)
                        y = y.wait() if async_op else y
                        if not torch.equal(y, want):
                            wrong.append(f"b={b} rows={rows} mode={mode} async={async_op} grad={grad}")
                        if grad:
                            (y * 2).sum().backward()
                            if not torch.equal(leaf.grad, torch.full_like(x, 2)):
                                wrong.append(f"b={b} rows={rows} mode={mode} async={async_op} gradient")
    resolved, helper = registry.resolved()
    records = None if helper is None else [(r.route, r.reason.label if r.reason else None) for r in helper.history]
    return wrong, (starts, resolved, records)


def nccl_route_ran(route: str) -> tuple:
    """What ``stepped_inputs_are_exact`` reports where the NCCL route ran every call: each of the 18 starts in flight
    (6 without autograd, 6 forwards and their 6 backwards) on gloo's threads (``nccl-async``); the agreed route
    resolved; under ``off`` no helper, under ``auto`` the default helper, declined at construction (no transport on
    CPU), recording all 36 calls (18 synchronous, 18 in flight) on the NCCL route."""
    return ["nccl-async"] * 18, True, None if route == "off" else [("nccl", "transport_missing")] * 36


@pytest.mark.parametrize("route", ["off", "auto"])
def test_inputs_with_a_step_are_exact(route):
    """Exact on every rank, and the NCCL route ran every call (``nccl_route_ran``)."""
    results = run_ranks(2, stepped_inputs_are_exact, env={"FASTVIDEO_ULYSSES_A2A": route}, timeout_s=90)
    for wrong, ran in results:
        assert wrong == [] and ran == nccl_route_ran(route), (wrong, ran)


def test_negative_control_the_route_assertion_fails_where_another_route_ran():
    """The same calls on contiguous copies through a helper on the CPU plan transport run fused (every start and every
    record ``fused``): exact, and the route assertion above fails on them."""
    results = run_ranks(2, stepped_inputs_are_exact, True, env={"FASTVIDEO_ULYSSES_A2A": "auto"}, timeout_s=90)
    for wrong, ran in results:
        assert wrong == [] and ran == (["fused"] * 18, True, [("fused", None)] * 36), (wrong, ran)
        assert ran != nccl_route_ran("auto")


def bad_input(rank: int, world: int, case: str) -> None:
    x = torch.zeros(2, 4, 4, 8)
    if case == "ndim":
        a2a(torch.zeros(2, 4, 32))
    elif case == "dims":
        a2a(x, scatter_dim=3, gather_dim=1)
    elif case == "heads":
        a2a(torch.zeros(1, 4, 3, 8), scatter_dim=2, gather_dim=1)
    elif case == "seq":
        a2a(torch.zeros(1, 3, 4, 8), scatter_dim=1, gather_dim=2)


@pytest.mark.parametrize(
    "case,needle",
    [
        ("ndim", "must be 4-D"),
        ("dims", "(scatter_dim, gather_dim)=(3, 1)"),
        ("heads", "heads (dim 2) = 3"),
        ("seq", "sequence (dim 1) = 3"),
    ],
)
@pytest.mark.parametrize("route", ["off", "auto"])
def test_bad_input_raises_value_error_on_every_rank_before_any_collective(case, needle, route):
    with pytest.raises(RankError) as info:
        run_ranks(2, bad_input, case, env={"FASTVIDEO_ULYSSES_A2A": route}, timeout_s=60)
    assert sorted(info.value.errors) == [0, 1]
    for kind, message, _ in info.value.errors.values():
        assert kind == "ValueError" and needle in message


def sp_size_one_is_identity(rank: int, world: int) -> bool:
    x = torch.randn(2, 3, 5, 4)
    return a2a(x) is x and a2a(x, 1, 2) is x and get_sp_group().world_size == 1


def test_sp_size_one_returns_input():
    assert run_ranks(1, sp_size_one_is_identity, env=OFF) == [True]


def attention_block_matches_reference(rank: int, world: int) -> float:
    from sp_recipes.attention_block import SPSelfAttention

    torch.manual_seed(0)
    block = SPSelfAttention(48, 2 * world, dtype=torch.float64)
    x = torch.randn(2, 8 * world, 48, dtype=torch.float64)
    seq, _ = _shards(world, rank, 8 * world, 2 * world)
    x_local = x[:, seq].clone().requires_grad_()
    x_ref = x.clone().requires_grad_()
    y = block(x_local)
    y.square().sum().backward()
    grads = [p.grad.clone() for p in block.parameters()]
    for g in grads:
        torch.distributed.all_reduce(g, group=get_sp_group().device_group)
    block.zero_grad()
    y_ref = block.forward_reference(x_ref)
    y_ref.square().sum().backward()
    torch.testing.assert_close(y, y_ref[:, seq], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x_local.grad, x_ref.grad[:, seq], rtol=1e-12, atol=1e-12)
    for g, p in zip(grads, block.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-10, atol=1e-12)
    return (y - y_ref[:, seq]).abs().max().item()


@pytest.mark.parametrize("world", [2, 4])
def test_attention_block_matches_single_device_reference(world):
    run_ranks(world, attention_block_matches_reference, env=OFF)


def vmap_raises(rank: int, world: int) -> str:
    try:
        torch.func.vmap(lambda t: a2a(t))(torch.zeros(3, 2, 4, 4, 8))
    except RuntimeError as exc:
        return str(exc)
    return ""


def test_vmap_over_the_op_raises():
    assert all("vmap" in m for m in run_ranks(2, vmap_raises, env=OFF))
