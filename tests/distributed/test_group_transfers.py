"""Upstream FastVideo's coordinator transfers and parallel_state extras on gloo ranks, with upstream's semantics.

``GroupCoordinator``: point-to-point objects (upstream's training pipeline calls ``send_object`` / ``recv_object``),
``send`` / ``recv``, broadcasts of tensors, objects and object lists, tensor dictionaries (broadcast, and sent with
and without an all-gather group), ``graph_capture`` off CUDA, ``all_to_all_4D``, upstream's constructor and
``destroy``. ``parallel_state``: the node group, ``patch_tensor_parallel_group``, the further TP group, the
name-addressed ``all_reduce``. ``utils.StatelessProcessGroup``; ``DistributedAutograd``; upstream's
``ulysses_a2a`` names over the op's helper (on the CPU plan transport).

Each worker returns plain values and the parent asserts them. Negative controls: every comparison is also made
against a value it must not match (another rank's dictionary, another rank's object), and rank arguments outside
the group raise before any communication.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.conftest import bit_equal, build_helper, catch, rank_input
from tests.distributed.mp import run_ranks


def same_dict(a: dict, b: dict) -> bool:
    """Equal keys in the same order, tensors bit-equal (and of the same dtype and shape), other values equal."""
    if list(a) != list(b):
        return False
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if isinstance(x, torch.Tensor):
            if x.dtype != y.dtype or x.shape != y.shape or not bit_equal(x.contiguous(), y.contiguous()):
                return False
        elif x != y:
            return False
    return True


def tensor_dict(rank: int) -> dict:
    base = rank_input(rank, (4, 6))
    return {"hidden": rank_input(rank, (2, 3, 4)), "step": 7 + rank, "empty": torch.empty(0, 3),
            "half": rank_input(rank, (5,), torch.float16), "strided": base.t(), "name": f"rank{rank}",
            "ids": torch.arange(6, dtype=torch.int64) * (rank + 1)}


def _transfers(rank, world_size):
    from fastvideo.distributed import (
        cleanup_dist_env_and_memory,
        maybe_init_distributed_environment_and_model_parallel,
    )
    from fastvideo.distributed.parallel_state import GraphCaptureContext, get_sp_group

    maybe_init_distributed_environment_and_model_parallel(1, world_size)
    sp = get_sp_group()
    peer = 1 - rank
    out: dict = {}
    # Objects, point to point (both directions, so each rank both sends and receives).
    mine = {"rank": rank, "payload": list(range(rank + 3)), "nested": ("x", {"y": rank})}
    if rank == 0:
        sp.send_object(mine, dst=1)
        got = sp.recv_object(src=1)
    else:
        got = sp.recv_object(src=0)
        sp.send_object(mine, dst=0)
    out["object"] = got == {"rank": peer, "payload": list(range(peer + 3)), "nested": ("x", {"y": peer})}
    out["object is not mine"] = got != mine
    out["to self"] = catch(sp.send_object, mine, rank)[:2]
    out["bad src"] = catch(sp.recv_object, 5)[:2]
    # Tensors, point to point: default dst/src are the next/previous rank.
    t = rank_input(rank, (3, 5))
    if rank == 0:
        sp.send(t)
        received = sp.recv(torch.Size([3, 5]), torch.float32)
    else:
        received = sp.recv(torch.Size([3, 5]), torch.float32)
        sp.send(t)
    out["tensor"] = bit_equal(received, rank_input(peer, (3, 5))) and not bit_equal(received, t)
    # Broadcasts from group rank 1.
    b = rank_input(rank, (2, 4))
    same = sp.broadcast(b, src=1)
    out["broadcast"] = same is b and bit_equal(b, rank_input(1, (2, 4)))
    out["broadcast_object"] = sp.broadcast_object({"from": rank}, src=1) == {"from": 1}
    lst = [rank, f"r{rank}"] if rank == 0 else [None, None]
    out["broadcast_object_list"] = sp.broadcast_object_list(lst, src=0) is lst and lst == [0, "r0"]
    out["bad broadcast src"] = catch(sp.broadcast, b, 2)[:2]
    # Tensor dictionaries: broadcast from 0, then sent 0 -> 1 (default dst/src).
    d = tensor_dict(rank)
    got_d = sp.broadcast_tensor_dict(d if rank == 0 else None, src=0)
    out["broadcast_tensor_dict"] = (got_d is d) if rank == 0 else same_dict(got_d, tensor_dict(0))
    out["broadcast_tensor_dict vs other rank"] = same_dict(got_d, tensor_dict(1))  # rank 0's: must differ on 1
    if rank == 0:
        out["send_tensor_dict"] = sp.send_tensor_dict(d) is None
    else:
        out["send_tensor_dict"] = same_dict(sp.recv_tensor_dict(), tensor_dict(0))
    # The rest of upstream's coordinator.
    with sp.graph_capture() as ctx:
        out["graph_capture"] = isinstance(ctx, GraphCaptureContext) and ctx.stream is None
    x = rank_input(rank, (2, 3, 4, 5))
    out["all_to_all_4D"] = bit_equal(sp.all_to_all_4D(x, 2, 1), sp.device_communicator.all_to_all_4D(x, 2, 1))
    cleanup_dist_env_and_memory()
    return out


def test_coordinator_transfers_have_upstreams_semantics():
    for rank, r in enumerate(run_ranks(2, _transfers, initialize=False, timeout_s=90)):
        assert r["object"] and r["object is not mine"] and r["tensor"], rank
        assert r["broadcast"] and r["broadcast_object"] and r["broadcast_object_list"], rank
        assert r["broadcast_tensor_dict"] and r["send_tensor_dict"], rank
        assert r["broadcast_tensor_dict vs other rank"] is False  # the control: the comparison can fail
        assert r["graph_capture"] and r["all_to_all_4D"], rank
        for key, fix in (("to self", "this rank"), ("bad src", "must be a rank of the group"),
                         ("bad broadcast src", "must be a rank of the group")):
            assert r[key][0] == "ValueError" and fix in r[key][1], (key, r[key])


def _tensor_dict_with_all_gather(rank, world_size):
    """Upstream's pipeline pattern at 4 ranks: the pipeline groups are {0, 2} and {1, 3}, the TP groups {0, 1} and
    {2, 3}. Ranks 0 and 1 each send their TP share of a dictionary to 2 and 3, which all-gather it over their TP
    group."""
    import torch.distributed as dist

    from fastvideo.distributed.parallel_state import GroupCoordinator, init_model_parallel_group

    pp = GroupCoordinator([[0, 2], [1, 3]], rank, "gloo", True, group_name="pp")
    tp = init_model_parallel_group([[0, 1], [2, 3]], rank, "gloo", group_name="tp_extra")
    whole = {"act": rank_input(0, (4, 6)), "odd": rank_input(1, (3,)), "tag": "step"}  # 3 does not divide by 2
    if pp.rank_in_group == 0:
        result = pp.send_tensor_dict(whole, dst=1, all_gather_group=tp)
        ok = result is None
    else:
        ok = same_dict(pp.recv_tensor_dict(src=0, all_gather_group=tp), whole)
    names = (pp.unique_name, tp.unique_name, pp.ranks)
    pp.destroy()
    tp.destroy()
    pp.destroy()  # twice: nothing left
    dist.barrier()
    return ok, names, pp.device_group is None and pp.cpu_group is None


def test_tensor_dict_with_an_all_gather_group_and_upstreams_constructor():
    results = run_ranks(4, _tensor_dict_with_all_gather, sp_size=1, timeout_s=90)
    for rank, (ok, names, destroyed) in enumerate(results):
        assert ok and destroyed, rank
        assert names[0].startswith("pp:") and names[1].startswith("tp_extra:")
        assert names[2] == ([0, 2] if rank % 2 == 0 else [1, 3])


def _parallel_state_extras(rank, world_size):
    import torch.distributed as dist

    from fastvideo.distributed import (
        cleanup_dist_env_and_memory,
        maybe_init_distributed_environment_and_model_parallel,
    )
    from fastvideo.distributed import parallel_state as ps
    from fastvideo.distributed.device_communicators.base_device_communicator import DistributedAutograd
    from fastvideo.distributed.utils import StatelessProcessGroup

    maybe_init_distributed_environment_and_model_parallel(1, world_size)
    out: dict = {}
    node = ps.get_node_group()
    out["node"] = (node.ranks, ps._NODE is node, ps.get_same_node_ranks(ps.get_world_group().cpu_group),
                   ps.is_the_same_node_as(ps.get_world_group().cpu_group, source_rank=1))
    tp = ps.get_tp_group()
    extra = ps.initialize_tensor_parallel_group(2, group_name_suffix="draft")
    with ps.patch_tensor_parallel_group(extra):
        inside = ps.get_tp_group() is extra and ps.get_tp_world_size() == 2
        nested = catch(ps.patch_tensor_parallel_group(tp).__enter__)[:2]
    out["patch"] = (inside, nested[0], ps.get_tp_group() is tp, extra.unique_name.startswith("tp_draft:"))
    sp = ps.get_sp_group()
    c = rank_input(rank, (3,))
    out["all_reduce"] = bit_equal(ps.all_reduce(c, sp.unique_name), rank_input(0, (3,)) + rank_input(1, (3,)))
    out["all_reduce unknown"] = catch(ps.all_reduce, c, "nope:0")[0]
    # DistributedAutograd: upstream's call convention, differentiable.
    x = rank_input(rank, (2, 3), torch.float64, requires_grad=True)
    y = DistributedAutograd.AllGather.apply(sp.device_group, x, world_size, 0)
    w = rank_input(10 + rank, y.shape, torch.float64)
    (y * w).sum().backward()
    want = sum(rank_input(10 + r, y.shape, torch.float64) for r in range(world_size))[2 * rank:2 * rank + 2]
    out["autograd all_gather"] = bit_equal(y, torch.cat([rank_input(r, (2, 3), torch.float64) for r in range(2)]))
    out["autograd grad"] = torch.allclose(x.grad, want, rtol=0, atol=1e-12)
    out["autograd world"] = catch(DistributedAutograd.AllGather.apply, sp.device_group, x, 3, 0)[0]
    # StatelessProcessGroup over the job's store (its keys under a prefix of their own).
    store = dist.PrefixStore("stateless", dist.distributed_c10d._get_default_store())
    spg = StatelessProcessGroup(rank=rank, world_size=world_size, store=store)
    if rank == 0:
        spg.send_obj({"hello": 1}, dst=1)
    got = spg.recv_obj(src=0) if rank == 1 else None
    out["stateless"] = (got, spg.broadcast_obj(f"from{rank}" if rank == 1 else None, src=1),
                        spg.all_gather_obj(rank * 10))
    spg.barrier()
    out["stateless node"] = ps.get_same_node_ranks(spg)
    out["bad rank"] = catch(StatelessProcessGroup, 2, 2, store)[0]
    cleanup_dist_env_and_memory()
    out["after"] = ps.state()["node"]
    return out


def test_parallel_state_extras_and_stateless_groups():
    for rank, r in enumerate(run_ranks(2, _parallel_state_extras, initialize=False, timeout_s=90)):
        assert r["node"] == ([0, 1], True, [0, 1], [0, 1])  # both ranks on this machine
        assert r["patch"] == (True, "RuntimeError", True, True)
        assert r["all_reduce"] and r["all_reduce unknown"] == "ValueError"
        assert r["autograd all_gather"] and r["autograd grad"] and r["autograd world"] == "ValueError"
        assert r["stateless"] == ({"hello": 1} if rank == 1 else None, "from1", [0, 10])
        assert r["stateless node"] == [0, 1] and r["bad rank"] == "ValueError"
        assert r["after"] is False


def _upstream_helper_api(rank, world_size):
    from fastvideo.distributed.device_communicators import ulysses_a2a
    from fastvideo.distributed.parallel_state import get_dp_group, get_sp_group

    sp = get_sp_group()
    comm = sp.device_communicator
    out = {"cpu device": ulysses_a2a.maybe_create_helper(sp.cpu_group, sp.device_group, world_size,
                                                         torch.device("cpu"), None)}
    ulysses_a2a.install_default_helper(build_helper())
    wrapper = ulysses_a2a.UlyssesA2AHelper(sp.cpu_group, sp.device_group, world_size, sp.device, None)
    x = rank_input(rank, (3, 4, 12, 8))
    y = wrapper.try_all_to_all_4D(x, 2, 1)
    out["fused"] = (bit_equal(y, comm.all_to_all_4D(x, 2, 1)), wrapper.history[-1].route)
    xg = x.clone().requires_grad_(True)
    yg = wrapper.try_all_to_all_4D(xg, 2, 1)
    g = rank_input(10 + rank, yg.shape)
    yg.backward(g)
    out["grad"] = (bit_equal(yg.detach(), y), bit_equal(xg.grad, comm.all_to_all_4D(g, 1, 2)),
                   wrapper.history[-1].route)
    out["run_armed"] = bit_equal(wrapper.run_armed(y, 1), x)
    dp = get_dp_group()
    other = ulysses_a2a.UlyssesA2AHelper(dp.cpu_group, dp.device_group, dp.world_size, dp.device, None)
    out["other group"] = other.try_all_to_all_4D(x, 2, 1)
    helper = ulysses_a2a.current_default_helper()
    out["close"] = (wrapper.close(), helper.stats()["destroyed"])
    return out


def test_upstream_ulysses_a2a_names_over_the_ops_helper(ranks):
    for r in ranks(2, _upstream_helper_api, env={"FASTVIDEO_ULYSSES_A2A": "auto"}):
        assert r["cpu device"] is None  # upstream's factory builds nothing off CUDA
        assert r["fused"] == (True, "fused")
        assert r["grad"] == (True, True, "fused")  # differentiable, as upstream's helper
        assert r["run_armed"] and r["other group"] is None
        assert r["close"] == (True, True)


def test_negative_control_the_dictionary_comparison_sees_one_element():
    """``same_dict`` (every dictionary check above) flags one changed element, a dtype, a key order and a value."""
    d = tensor_dict(0)
    assert same_dict(d, tensor_dict(0))
    changed = tensor_dict(0)
    changed["hidden"].view(-1)[5] += 1
    assert not same_dict(d, changed)
    assert not same_dict(d, {**tensor_dict(0), "half": tensor_dict(0)["half"].float()})
    assert not same_dict(d, dict(reversed(list(tensor_dict(0).items()))))
    assert not same_dict(d, {**tensor_dict(0), "step": 8})


def test_upstream_helper_declines_under_compile_before_any_distributed_state(monkeypatch):
    """Upstream's own check: built from placeholders, it must decline while compiling without touching them."""
    from fastvideo.distributed.device_communicators import ulysses_a2a

    helper = ulysses_a2a.UlyssesA2AHelper(object(), object(), 4, torch.device("cuda:0"), object())
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert helper.try_all_to_all_4D(torch.empty(1), 2, 1) is None
    assert ulysses_a2a.SUPPORTED_WORLD_SIZES[0] == 2 and {2, 4, 6, 8} <= set(ulysses_a2a.SUPPORTED_WORLD_SIZES)
    assert ulysses_a2a.MAX_WINDOW_BYTES == 1 << 30


@pytest.mark.parametrize(("caller", "fix"), [("send", "dst=0 is this rank; pass another rank of the group"),
                                             ("recv", r"src=3 must be a rank of the group \(0\.\.1\)")])
def test_communicator_point_to_point_rejects_a_bad_rank(caller, fix):
    """Local validation, before any communication (no process group needed to reach it): this rank itself, and a
    rank outside the group."""
    from fastvideo.distributed.device_communicators.base_device_communicator import DeviceCommunicatorBase

    comm = DeviceCommunicatorBase.__new__(DeviceCommunicatorBase)
    comm.world_size, comm.rank_in_group, comm.ranks = 2, 0, [0, 1]
    call = (lambda: comm.send(torch.zeros(1), 0)) if caller == "send" else (
        lambda: comm.recv(torch.Size([1]), torch.float32, 3))
    with pytest.raises(ValueError, match=f"{caller}: {fix}"):
        call()


def _same_node_late_look(rank, world_size, source_waits):
    """get_same_node_ranks over a stateless group whose non-source rank looks at the offered segment late; with
    ``source_waits`` False the source publishes its verdicts without waiting for the others' (the negative control:
    it then removes the segment before the late rank has looked)."""
    import time

    import torch.distributed as dist

    from fastvideo.distributed.node_groups import get_same_node_ranks
    from fastvideo.distributed.utils import StatelessProcessGroup

    class LateLook(StatelessProcessGroup):
        looked = False

        def broadcast_obj(self, obj, src):
            value = super().broadcast_obj(obj, src)
            if self.rank != src and not self.looked:  # the source's offer has arrived: look only later
                self.looked = True
                time.sleep(0.5)
            return value

        def all_gather_obj(self, obj):
            if source_waits or self.rank != 0:
                return super().all_gather_obj(obj)
            return [self.broadcast_obj(obj, src=0)] + [torch.zeros_like(obj)] * (self.world_size - 1)

    store = dist.PrefixStore(f"late_look_{source_waits}", dist.distributed_c10d._get_default_store())
    return get_same_node_ranks(LateLook(rank=rank, world_size=world_size, store=store))


def test_same_node_ranks_removes_the_segment_only_after_every_rank_has_looked():
    """The verdicts' exchange is the barrier before the source unlinks its segment: a rank that looks late still
    finds it. The negative control (a source that does not wait for the verdicts) loses the late rank."""
    assert run_ranks(2, _same_node_late_look, True, timeout_s=60) == [[0, 1], [0, 1]]
    assert run_ranks(2, _same_node_late_look, False, timeout_s=60) == [[0], [0]]
