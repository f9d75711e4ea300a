"""Upstream FastVideo's distributed surface on gloo ranks, written from upstream's own Ulysses tests.

Upstream's parity worker (``fastvideo/tests/distributed/test_ulysses_a2a_parity.py`` in hao-ai-lab/FastVideo)
initialises with ``maybe_init_distributed_environment_and_model_parallel(1, world)``, takes the helper from
``get_sp_group().device_communicator.ulysses_a2a``, and checks ``sequence_model_parallel_all_to_all_4D``
against ``DeviceCommunicatorBase.all_to_all_4D(comm, x, ...)`` (the NCCL route) byte for byte: both
directions, the round trip, both backwards, every dtype, and a window that must survive growing operands.
Here the ranks start from torchrun's environment with nothing initialised (``run_ranks(initialize=False)``),
the fused route runs on the CPU plan transport (the helper installed as the op's default, so
``ulysses_a2a`` is it), and every check also records which route ran. The private attributes upstream's
worker reads (``helper._handle``, ``_disabled_reason``) are ``stats()`` here.

Negative controls: a transport that corrupts one element fails the parity checks (they can fail), and the
``off`` route reports no helper and no fused call (the route assertions can fail).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.conftest import bit_equal, build_helper, catch, rank_input
from tests.distributed.mp import run_ranks
from tests.plan_transport import GlooPlanTransport

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# (B, S_local, H, D): B = 3 as DistributedAttention's packed QKV, and B = 1. H divides by 2 and 3.
SHAPES = ((3, 8, 12, 8), (1, 6, 12, 16), (3, 4, 24, 8))
WINDOW = 24 * 1024  # bytes: the growth check's operands straddle it


class CorruptingTransport(GlooPlanTransport):
    """The CPU plan transport with one output element off by one: what a layout bug would look like."""

    def execute(self, x, geom, plan, **kw):
        out = super().execute(x, geom, plan, **kw)
        out.view(-1)[0] += 1
        return out


def _records(helper, since: int) -> list[str]:
    return [rec.route for rec in list(helper.history)[since:]] if helper is not None else []


def _check_shape(comm, helper, shape, dtype, world, seed) -> dict:
    """Upstream's _check_shape: forward, gather, round trip and both backwards against the NCCL route."""
    from fastvideo.distributed.communication_op import sequence_model_parallel_all_to_all_4D as a2a
    from fastvideo.distributed.device_communicators.base_device_communicator import DeviceCommunicatorBase

    b, s, h, d = shape
    rank = comm.rank_in_group
    x = rank_input(rank, shape, dtype, seed=seed)
    mark = len(helper.history) if helper is not None else 0
    got = a2a(x, scatter_dim=2, gather_dim=1)
    ok = {"scatter": bit_equal(got, DeviceCommunicatorBase.all_to_all_4D(comm, x, 2, 1))}
    y = got.contiguous()
    got_g = a2a(y, scatter_dim=1, gather_dim=2)
    ok["gather"] = bit_equal(got_g, DeviceCommunicatorBase.all_to_all_4D(comm, y, 1, 2))
    ok["round trip"] = bit_equal(got_g, x)
    xg = x.clone().requires_grad_(True)
    g = rank_input(rank, (b, s * world, h // world, d), dtype, seed=seed + 1)
    a2a(xg, 2, 1).backward(g)
    ok["backward"] = bit_equal(xg.grad, DeviceCommunicatorBase.all_to_all_4D(comm, g, 1, 2))
    yg = y.clone().requires_grad_(True)
    g2 = rank_input(rank, shape, dtype, seed=seed + 2)
    a2a(yg, 1, 2).backward(g2)
    ok["reverse backward"] = bit_equal(yg.grad, DeviceCommunicatorBase.all_to_all_4D(comm, g2, 2, 1))
    return {"ok": ok, "routes": _records(helper, mark)}


def _check_window_growth(comm, helper, world) -> list[tuple]:
    """A size change past the window must not disable the fused route for later calls that fit: for each dtype,
    a fitting operand, one past the window, and a fitting one again. H=12, D=8 has tuned rows (the big
    operand is chunked); D=16 has none (the original plan declines `window`, the NCCL route runs)."""
    from fastvideo.distributed.communication_op import sequence_model_parallel_all_to_all_4D as a2a
    from fastvideo.distributed.device_communicators.base_device_communicator import DeviceCommunicatorBase

    out = []
    for dtype in (torch.float32, torch.bfloat16):
        for d in (8, 16):
            for s_local in (8, 256, 8):
                x = rank_input(comm.rank_in_group, (3, s_local, 12, d), dtype, seed=s_local + d)
                mark = len(helper.history) if helper is not None else 0
                same = bit_equal(a2a(x, 2, 1), DeviceCommunicatorBase.all_to_all_4D(comm, x, 2, 1))
                rec = helper.history[-1] if helper is not None and len(helper.history) > mark else None
                out.append((str(dtype), d, s_local, same, rec.route if rec else None,
                            rec.reason.label if rec is not None and rec.reason is not None else None,
                            rec.chunks if rec else 0))
    return out


def _upstream_parity_worker(rank, world_size, transport_kind):
    from fastvideo.distributed import cleanup_dist_env_and_memory, maybe_init_distributed_environment_and_model_parallel
    from fastvideo.distributed.device_communicators import ulysses_a2a
    from fastvideo.distributed.parallel_state import get_sp_group, get_sp_world_size

    maybe_init_distributed_environment_and_model_parallel(1, world_size)
    try:
        w = get_sp_world_size()
        if transport_kind is not None:
            transport = CorruptingTransport() if transport_kind == "corrupting" else GlooPlanTransport()
            ulysses_a2a.install_default_helper(build_helper(transport=transport, window_bytes=WINDOW))
        comm = get_sp_group().device_communicator
        helper = comm.ulysses_a2a
        checks = {}
        for i, shape in enumerate(SHAPES):
            for dtype in DTYPES:
                checks[(shape, str(dtype))] = _check_shape(comm, helper, shape, dtype, w, seed=10 * i)
        growth = _check_window_growth(comm, helper, w)
        stats = helper.stats() if helper is not None else None
        return {"checks": checks, "growth": growth, "helper": type(helper).__name__ if helper is not None else None,
                "construction": stats["construction"] if stats else None, "fused": stats["fused"] if stats else 0,
                "enabled": ulysses_a2a.is_enabled()}
    finally:
        cleanup_dist_env_and_memory()


def _run_parity(world_size, transport_kind, route):
    return run_ranks(world_size, _upstream_parity_worker, transport_kind, initialize=False,
                     env={"FASTVIDEO_ULYSSES_A2A": route}, timeout_s=180)


@pytest.mark.parametrize("world_size", [2, 3])
def test_upstream_parity_worker_flow_on_the_fused_route(world_size):
    for result in _run_parity(world_size, "gloo-plan", "auto"):
        assert result["enabled"] and result["construction"] == "ok"
        for key, check in result["checks"].items():
            assert all(check["ok"].values()), (key, check["ok"])
            # 2 forwards + 2 grad forwards + 2 backwards, every one on the fused route
            assert check["routes"] == ["fused"] * 6, (key, check["routes"])
        for dtype, d, s_local, same, route, reason, chunks in result["growth"]:
            assert same, (dtype, d, s_local)
            if s_local == 8:  # the tuned row moves one plane per chunk; the original plan all at once
                assert (route, chunks) == ("fused", 3 if d == 8 else 1), (dtype, d, s_local, route, reason)
            elif d == 8:  # a tuned row: a plane no longer fits, so rows of it per chunk
                assert route == "fused" and chunks > 3, (dtype, s_local, route, chunks)
            else:  # the original plan cannot chunk: declined, and the next fitting call is fused again
                assert (route, reason) == ("nccl", "window"), (dtype, d, s_local, route, reason)


def test_negative_control_a_corrupting_transport_fails_the_parity_checks():
    for result in _run_parity(2, "corrupting", "auto"):
        for key, check in result["checks"].items():
            assert check["routes"] == ["fused"] * 6
            assert not check["ok"]["scatter"] and not check["ok"]["backward"], key


def test_upstream_parity_worker_flow_on_the_off_route():
    """off: ulysses_a2a is None, nothing is fused, and the op is exactly the NCCL route."""
    for result in _run_parity(2, None, "off"):
        assert result["helper"] is None and not result["enabled"] and result["fused"] == 0
        assert all(all(c["ok"].values()) and c["routes"] == [] for c in result["checks"].values())
        assert all(same and route is None for _, _, _, same, route, _, _ in result["growth"])


# ------------------------------------------------------------------------------------- initialisation


def _init_and_cleanup(rank, world_size, tp_size, rendezvous_file):
    import torch.distributed as dist

    from fastvideo.distributed import (
        cleanup_dist_env_and_memory,
        get_dp_world_size,
        get_local_torch_device,
        get_sp_group,
        get_sp_parallel_rank,
        get_tp_group,
        get_tp_rank,
        get_tp_world_size,
        get_world_group,
        maybe_init_distributed_environment_and_model_parallel,
        model_parallel_is_initialized,
        tensor_model_parallel_all_gather,
        tensor_model_parallel_all_reduce,
    )
    from fastvideo.distributed import parallel_state as ps
    from fastvideo.distributed.communication_op import sequence_model_parallel_all_to_all_4D as a2a
    from fastvideo.distributed.device_communicators import ulysses_a2a

    before = ps.state()
    maybe_init_distributed_environment_and_model_parallel(tp_size, world_size)
    sp, tp = get_sp_group(), get_tp_group()
    groups = len(dist.distributed_c10d._world.pg_map)
    maybe_init_distributed_environment_and_model_parallel(tp_size, world_size)  # again: nothing new
    again = (get_sp_group() is sp, get_tp_group() is tp, len(dist.distributed_c10d._world.pg_map) == groups)
    mismatch = catch(maybe_init_distributed_environment_and_model_parallel, tp_size, 1)[:2]
    info = {"tp": (get_tp_world_size(), get_tp_rank(), tp.ranks), "world": get_world_group().world_size,
            "sp_rank": get_sp_parallel_rank(), "dp": get_dp_world_size(), "device": str(get_local_torch_device()),
            "backend": dist.get_backend(), "initialized": model_parallel_is_initialized()}
    x = rank_input(rank, (2, 4, 6, 8))
    summed = tensor_model_parallel_all_reduce(x)  # upstream's: the sum over the TP group
    info["tp_all_reduce"] = bit_equal(summed, sum(rank_input(r, (2, 4, 6, 8)) for r in tp.ranks)) and (
        summed is x) == (tp_size == 1)
    gathered = tensor_model_parallel_all_gather(x, 1)
    info["tp_all_gather"] = bit_equal(gathered, torch.cat([rank_input(r, (2, 4, 6, 8)) for r in tp.ranks], dim=1))
    helper = sp.device_communicator.ulysses_a2a  # auto: the op's helper, built here (collectively)
    a2a(x, 2, 1)
    during = ps.state()
    cleanup_dist_env_and_memory()
    after = (ps.state(), helper.stats()["destroyed"], ulysses_a2a.current_default_helper())
    cleanup_dist_env_and_memory()  # twice: nothing left to do
    # And again from scratch: the groups come back and the op runs. A fresh rendezvous (a file): the default
    # group's names restart after it is destroyed, and the first rendezvous's store still holds its keys.
    maybe_init_distributed_environment_and_model_parallel(tp_size, world_size, f"file://{rendezvous_file}")
    rebuilt = bit_equal(a2a(x, 2, 1), get_sp_group().device_communicator.all_to_all_4D(x, 2, 1))
    cleanup_dist_env_and_memory()
    return before, again, mismatch, info, during, after, rebuilt, ps.state()


@pytest.mark.parametrize("tp_size", [1, 2])
def test_init_is_idempotent_and_cleanup_tears_everything_down_in_order(tp_size, tmp_path):
    results = run_ranks(2, _init_and_cleanup, tp_size, str(tmp_path / "rendezvous"), initialize=False,
                        env={"FASTVIDEO_ULYSSES_A2A": "auto"}, timeout_s=120)
    nothing = {"world": False, "node": False, "sp": False, "dp": False, "tp": False, "tp_process_groups": 0,
               "default_group": False}
    for rank, (before, again, mismatch, info, during, after, rebuilt, end) in enumerate(results):
        assert before == nothing and end == nothing
        assert again == (True, True, True)
        assert mismatch[0] == "ValueError" and "cleanup_dist_env_and_memory() first" in mismatch[1]
        first = rank - rank % tp_size
        assert info["tp"] == (tp_size, rank % tp_size, list(range(first, first + tp_size)))
        assert (info["world"], info["sp_rank"], info["dp"]) == (2, rank, 1)
        assert (info["device"], info["backend"], info["initialized"]) == ("cpu", "gloo", True)
        assert info["tp_all_reduce"] and info["tp_all_gather"]
        assert during["tp_process_groups"] == 2 * (2 // tp_size) and during["default_group"]
        assert after == (nothing, True, None)  # the helper went with its group, the default group last
        assert rebuilt


# ------------------------------------------------------------------------------------- SP collectives


def _collectives(rank, world_size):
    from fastvideo.distributed import (
        sequence_model_parallel_all_gather,
        sequence_model_parallel_all_gather_with_unpad,
        sequence_model_parallel_shard,
        warmup_sequence_parallel_communication,
    )
    from fastvideo.distributed.device_communicators import ulysses_a2a

    p = world_size
    # all-gather along dim 2: forward concatenates, backward sums the gradient over ranks (reduce-scatter).
    f64 = torch.float64  # sums of 3 ranks' values in another order: exact to rounding in float64
    x = rank_input(rank, (2, 3, 4, 5), f64, requires_grad=True)
    full = [rank_input(r, (2, 3, 4, 5), f64) for r in range(p)]
    y = sequence_model_parallel_all_gather(x, dim=2)
    weights = [rank_input(100 + r, y.shape, f64) for r in range(p)]
    (y * weights[rank]).sum().backward()
    gather_ok = bit_equal(y, torch.cat(full, dim=2))
    want_grad = sum(w[:, :, 4 * rank:4 * (rank + 1)] for w in weights)
    gather_grad_ok = torch.allclose(x.grad, want_grad, rtol=0, atol=1e-12)
    # shard with padding: 7 rows over p ranks, replicated input; backward all-gathers / p.
    z = rank_input(0, (2, 7, 3), f64, requires_grad=True)  # the same on every rank
    shard, original = sequence_model_parallel_shard(z, dim=1)
    padded = -(-7 // p) * p
    rows = padded // p
    zpad = torch.cat([z.detach(), z.new_zeros(2, padded - 7, 3)], dim=1)
    shard_ok = bit_equal(shard, zpad[:, rank * rows:(rank + 1) * rows]) and original == 7
    g = rank_input(200 + rank, shard.shape, f64)
    shard.backward(g)
    want = torch.cat([rank_input(200 + r, shard.shape, f64) for r in range(p)], dim=1)[:, :7] / p
    shard_grad_ok = torch.allclose(z.grad, want, rtol=0, atol=1e-12)
    unpad_ok = bit_equal(sequence_model_parallel_all_gather_with_unpad(shard.detach(), original, dim=1), z.detach())
    # The communicator's NCCL route with autograd (its backward is the inverse all-to-all) and the SUM all-reduce
    # (its gradient is the all-reduced gradient).
    from fastvideo.distributed.parallel_state import get_sp_group

    comm = get_sp_group().device_communicator
    a = rank_input(rank, (2, 3, 6, 4), f64, requires_grad=True)
    out = comm.all_to_all_4D(a, 2, 1)
    w = rank_input(300 + rank, out.shape, f64)
    (out * w).sum().backward()
    a2a_ok = bit_equal(out, comm.all_to_all_4D(a.detach(), 2, 1)) and bit_equal(a.grad, comm.all_to_all_4D(w, 1, 2))
    c = rank_input(rank, (3, 5), f64, requires_grad=True)
    summed = get_sp_group().all_reduce(c)
    (summed * rank_input(400 + rank, (3, 5), f64)).sum().backward()
    reduce_ok = (torch.allclose(summed, sum(rank_input(r, (3, 5), f64) for r in range(p)), rtol=0, atol=1e-12)
                 and torch.allclose(c.grad, sum(rank_input(400 + r, (3, 5), f64) for r in range(p)), rtol=0,
                                    atol=1e-12))
    built = ulysses_a2a.current_default_helper() is not None
    warmup_sequence_parallel_communication()
    warmed = ulysses_a2a.current_default_helper()
    calls = warmed.stats()["calls"]
    warmup_sequence_parallel_communication()  # once per set of groups
    return (gather_ok, gather_grad_ok, shard_ok, shard_grad_ok, unpad_ok, built, calls,
            warmed.stats()["calls"], tuple(shard.shape), a2a_ok, reduce_ok)


@pytest.mark.parametrize("world_size", [2, 3])
def test_sp_collectives_and_their_gradients(ranks, world_size):
    for r in ranks(world_size, _collectives, env={"FASTVIDEO_ULYSSES_A2A": "auto"}):
        gather_ok, gather_grad_ok, shard_ok, shard_grad_ok, unpad_ok, built, calls, calls_after, shape, a2a, red = r
        assert gather_ok and gather_grad_ok and shard_ok and shard_grad_ok and unpad_ok and a2a and red
        assert shape == (2, -(-7 // world_size), 3)
        assert not built and calls == 2 and calls_after == 2  # the warm-up built the helper, then did nothing


def _autograd_only_all_gather(group, counter: list[int]):
    """An all-gather registered under the Autograd dispatch key alone, as torch before 2.13 registers
    ``_c10d_functional_autograd.all_gather_into_tensor``: a tensor made under ``torch.inference_mode`` carries no
    autograd key, so the dispatcher finds no kernel for it (the GPU hosts' torch 2.11 failed so)."""
    import torch.distributed._functional_collectives as fc

    lib = torch.library.Library("fastvideo_test_autograd_only", "DEF")
    lib.define("all_gather(Tensor x, int dim) -> Tensor")

    def kernel(x, dim):
        counter[0] += 1
        return fc.wait_tensor(fc.all_gather_tensor(x.contiguous(), dim, group)).clone()

    lib.impl("all_gather", kernel, "Autograd")
    op = torch.ops.fastvideo_test_autograd_only.all_gather
    return lib, lambda x, dim, _group: op(x, dim)


def _inference_mode_gathers(rank, world_size):
    from fastvideo.distributed import communicator as base_device_communicator
    from fastvideo.distributed import sequence_model_parallel_all_gather, sequence_model_parallel_all_gather_with_unpad
    from fastvideo.distributed.parallel_state import get_sp_group

    comm = get_sp_group().device_communicator
    counter = [0]
    lib, emulated = _autograd_only_all_gather(comm.device_group, counter)
    base_device_communicator._all_gather_autograd = emulated
    table = tuple(range(1, world_size + 1))  # uneven shares: the padded path
    out = {}
    with torch.inference_mode():
        x = rank_input(rank, (2, 3, 4))
        out["even"] = bit_equal(sequence_model_parallel_all_gather(x, dim=1),
                                torch.cat([rank_input(r, (2, 3, 4)) for r in range(world_size)], dim=1))
        u = rank_input(rank, (2, table[rank], 4))
        full = torch.cat([rank_input(r, (2, table[r], 4)) for r in range(world_size)], dim=1)
        out["uneven"] = bit_equal(sequence_model_parallel_all_gather(u, dim=1, splits=table), full)
        out["unpad"] = bit_equal(sequence_model_parallel_all_gather_with_unpad(x, 5, dim=1),
                                 torch.cat([rank_input(r, (2, 3, 4)) for r in range(world_size)], dim=1)[:, :5])
        out["inference calls"] = counter[0]
        # The negative control: the emulated op itself fails on an inference tensor, as 2.11's did.
        out["direct"] = catch(emulated, x, 1, None)[:2]
    # Grad-tracked input still takes the differentiable form (here the emulation: forward only).
    g = rank_input(rank, (2, 3, 4), requires_grad=True)
    out["tracked"] = bit_equal(comm.all_gather(g, 1).detach(),
                               torch.cat([rank_input(r, (2, 3, 4)) for r in range(world_size)], dim=1))
    out["tracked calls"] = counter[0]
    del lib
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_all_gather_under_inference_mode_with_an_autograd_only_functional_collective(ranks, world_size):
    """Upstream's LingBot test runs its forward under ``torch.inference_mode``: the all-gathers (even, uneven,
    unpadded) must not reach an op that has only an Autograd kernel (torch 2.11's differentiable functional
    collectives), and grad-tracked input must still reach it."""
    for r in ranks(world_size, _inference_mode_gathers):
        assert r["even"] and r["uneven"] and r["unpad"] and r["tracked"], r
        assert r["inference calls"] == 0 and r["tracked calls"] == 1
        assert r["direct"][0] == "NotImplementedError" and "Could not run" in r["direct"][1], r["direct"]


def _gather_warnings(rank, world_size):
    """Every warning the SP all-gathers raise (even and uneven, untracked and grad-tracked) from this package's own
    files; then the control: the deprecated functional name in their place, which torch 2.13 warns about."""
    import warnings

    from fastvideo.distributed import communicator as base
    from fastvideo.distributed.parallel_state import get_sp_group

    comm = get_sp_group().device_communicator
    table = tuple(range(1, world_size + 1))

    def ours() -> list[str]:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            comm.all_gather(rank_input(rank, (2, 3, 4)), 1)
            comm.all_gather(rank_input(rank, (2, table[rank], 4)), 1, splits=table)
            comm.all_gather(rank_input(rank, (2, 3, 4), requires_grad=True), 1)
        return [f"{w.category.__name__}: {w.message} ({w.filename})" for w in seen if "/fastvideo/" in w.filename]

    clean = ours()
    import torch.distributed._functional_collectives as fc

    base._all_gather = fc.all_gather_tensor  # the call the package made before
    return clean, ours()


def test_the_all_gathers_raise_no_warning_from_this_package(ranks):
    """The untracked all-gather calls torch's current functional name (``all_gather_single`` on 2.13, the old name
    on 2.11, which lacks the new one): no ``FutureWarning`` attributed to this package's file."""
    import torch.distributed._functional_collectives as fc

    for clean, old in ranks(2, _gather_warnings):
        assert clean == [], clean
        if hasattr(fc, "all_gather_single"):  # the control: where the old name is deprecated, it is caught
            assert any("FutureWarning" in w and "communicator.py" in w for w in old), old


# ------------------------------------------------------------------------------------- ulysses_a2a itself


def _ulysses_a2a_methods(rank, world_size):
    from fastvideo.distributed.device_communicators import ulysses_a2a
    from fastvideo.distributed.parallel_state import get_dp_group, get_sp_group

    sp = get_sp_group()
    declined = sp.device_communicator.ulysses_a2a  # the default helper on CPU: declined at construction
    x = rank_input(rank, (3, 4, 12, 8))
    result = {"declined": (declined.stats()["construction"], declined.try_all_to_all_4D(x, 2, 1))}
    declined.close()
    ulysses_a2a.install_default_helper(build_helper())
    helper = sp.device_communicator.ulysses_a2a
    y = helper.try_all_to_all_4D(x, 2, 1)
    result["fused"] = (bit_equal(y, sp.device_communicator.all_to_all_4D(x, 2, 1)), helper.history[-1].route)
    result["bad dims"] = catch(helper.try_all_to_all_4D, x, 3, 1)[:2]
    result["dp"] = get_dp_group().device_communicator.ulysses_a2a
    helper.close()
    result["closed"] = helper.stats()["destroyed"]

    class WithMethods:
        def try_all_to_all_4D(self, x, s, g):
            return None

        def close(self):
            pass

    stub = WithMethods()
    result["no wrap"] = ulysses_a2a.with_upstream_methods(stub) is stub
    return result


def test_ulysses_a2a_try_and_close(ranks):
    for r in ranks(2, _ulysses_a2a_methods, env={"FASTVIDEO_ULYSSES_A2A": "auto"}):
        assert r["declined"] == ("transport_missing", None)  # every rank declined: the caller runs NCCL
        assert r["fused"] == (True, "fused")
        assert r["bad dims"][0] == "ValueError" and "(scatter_dim, gather_dim)=(3, 1)" in r["bad dims"][1]
        assert r["dp"] is None  # only the SP group's communicator has a helper
        assert r["closed"] and r["no wrap"]


def _uneven_collectives(rank, world_size, table):
    from fastvideo.distributed import (
        sequence_model_parallel_all_gather,
        sequence_model_parallel_all_gather_with_unpad,
        sequence_model_parallel_shard,
    )
    from tests.distributed.conftest import catch

    p, f64, total = world_size, torch.float64, sum(table)
    starts = [sum(table[:r]) for r in range(p)]
    # shard with seq_splits: this rank's own rows, no padding; the backward all-gathers the shares / p.
    z = rank_input(0, (2, total, 3), f64, requires_grad=True)  # the same on every rank
    shard, original = sequence_model_parallel_shard(z, dim=1, seq_splits=table)
    shard_ok = bit_equal(shard, z.detach()[:, starts[rank]:starts[rank] + table[rank]]) and original == total
    shard.backward(rank_input(200 + rank, shard.shape, f64))
    want = torch.cat([rank_input(200 + r, (2, table[r], 3), f64) for r in range(p)], dim=1) / p
    shard_grad_ok = torch.allclose(z.grad, want, rtol=0, atol=1e-12)
    # all-gather of uneven shares along dim 1 (and the unpad variant with the table): exact; the backward gives
    # each rank the sum over ranks of its own rows' gradient.
    x = rank_input(rank, (2, table[rank], 3), f64, requires_grad=True)
    y = sequence_model_parallel_all_gather(x, dim=1, splits=table)
    full = torch.cat([rank_input(r, (2, table[r], 3), f64) for r in range(p)], dim=1)
    weights = [rank_input(100 + r, y.shape, f64) for r in range(p)]
    (y * weights[rank]).sum().backward()
    gather_ok = bit_equal(y, full)
    mine = slice(starts[rank], starts[rank] + table[rank])
    gather_grad_ok = torch.allclose(x.grad, sum(w[:, mine] for w in weights), rtol=0, atol=1e-12)
    unpad_ok = bit_equal(sequence_model_parallel_all_gather_with_unpad(x.detach(), total, dim=1, seq_splits=table),
                         full)
    bad = {
        "sum": catch(sequence_model_parallel_shard, z, dim=1, seq_splits=(*table[:-1], table[-1] + 1))[:2],
        "length": catch(sequence_model_parallel_shard, z, dim=1, seq_splits=table[:-1])[:2],
        "negative": catch(sequence_model_parallel_shard, z, dim=1, seq_splits=(-1, *table[1:-1], table[-1] + 1))[:2],
        "gather rows": catch(sequence_model_parallel_all_gather, x.detach()[:, :0] if table[rank] else
                             x.detach().new_zeros(2, 1, 3), dim=1, splits=table)[:2],
        "unpad len": catch(sequence_model_parallel_all_gather_with_unpad, x.detach(), total + 1, dim=1,
                           seq_splits=table)[:2],
        "gather dim": catch(sequence_model_parallel_all_gather, x.detach(), dim=3, splits=table)[:2],
        "shard dim": catch(sequence_model_parallel_shard, z, dim=-4, seq_splits=table)[:2],
        "shard dim even": catch(sequence_model_parallel_shard, z, dim=3)[:2],
    }
    return shard_ok, shard_grad_ok, gather_ok, gather_grad_ok, unpad_ok, tuple(shard.shape), bad


@pytest.mark.parametrize("world_size,table", [(2, (5, 2)), (3, (3, 0, 4)), (4, (2, 2, 1, 2))])
def test_uneven_shard_and_all_gather_without_padding(ranks, world_size, table):
    """``sequence_model_parallel_shard(seq_splits=)`` and the all-gathers with the same table: each rank's own
    rows (a zero share included), no padding, exact forward and gradients; bad tables raise before any
    collective, naming the argument."""
    for rank, r in enumerate(ranks(world_size, _uneven_collectives, table)):
        *oks, shape, bad = r
        assert all(oks), oks
        assert shape == (2, table[rank], 3)
        assert bad["sum"][0] == "ValueError" and "seq_splits" in bad["sum"][1] and "sums to" in bad["sum"][1]
        assert bad["length"][0] == "ValueError" and "entries for SP size" in bad["length"][1]
        assert bad["negative"][0] == "ValueError" and "is negative" in bad["negative"][1]
        assert bad["gather rows"][0] == "ValueError" and f"splits[{rank}]" in bad["gather rows"][1]
        assert bad["unpad len"][0] == "ValueError" and "seq_splits" in bad["unpad len"][1]
        # a dim out of range is named as such, before any collective (not an IndexError from reading the shape)
        assert bad["gather dim"][0] == "ValueError" and "dim=3 is out of range" in bad["gather dim"][1]
        assert bad["shard dim"][0] == "ValueError" and "dim=-4 is out of range" in bad["shard dim"][1]
        assert bad["shard dim even"][0] == "ValueError" and "dim=3 is out of range" in bad["shard dim even"][1]


def test_local_device_asks_upstreams_platform_before_the_world_group_exists(monkeypatch):
    """Before the world group exists, ``get_local_torch_device`` asks upstream's ``current_platform`` as upstream's
    does (its worker test makes the platform CUDA-like on a machine without CUDA): ``cuda:LOCAL_RANK``, and the
    CPU where upstream says ``mps``. Alone (no upstream platform), torch decides: the CPU on a machine without CUDA
    (the control: the platform's answer is what moved it)."""
    import sys
    import types

    from fastvideo.distributed import parallel_state

    assert not parallel_state.model_parallel_is_initialized()
    monkeypatch.setenv("LOCAL_RANK", "3")
    platform = types.SimpleNamespace(is_npu=lambda: False, is_cuda_alike=lambda: True, is_cuda=lambda: False)
    module = types.ModuleType("fastvideo.platforms")
    module.current_platform = platform
    with monkeypatch.context() as patched:
        patched.setitem(sys.modules, "fastvideo.platforms", module)
        assert parallel_state.get_local_torch_device() == torch.device("cuda", 3)
        platform.is_cuda_alike = lambda: False
        assert parallel_state.get_local_torch_device() == torch.device("cpu")
    alone = torch.device("cuda", 3) if torch.cuda.is_available() else torch.device("cpu")
    assert parallel_state.get_local_torch_device() == alone
