"""``fastvideo.attention.layer.DistributedAttention`` against a single-device reference, on gloo ranks.

Each rank builds the same global q, k, v (a sequence that does not divide by P, so it is padded), replicated
text tokens and rotary tables; the reference attends the whole sequence plus the text tokens on one device
(no collective). Each rank then runs the layer on its shard and checks its output rows, the replicated
output, its input gradients, and the replicated inputs' gradients summed over ranks (each rank's covers its
own heads) against the reference: float64, so only rounding separates them. Under ``auto`` with the CPU
plan transport the all-to-alls are asserted to have taken the fused route. ``torch.compile(fullgraph=True)``
of the layer (opted in: ``_set_compile_forward_enabled(True)``) matches eager bit for bit.

Negative control: the same check with ``original_seq_len`` left out (the padding rows then take part in
attention) fails, so the check sees padding mistakes.

Uneven shards (``seq_splits``, a zero share included) and a head count the SP size does not divide: no padding
anywhere (each rank's tensors have its own share of rows), against the same reference, off and on the CPU fused
route (every call's route asserted); their negative control reads each rank's rows at the even shards' offsets,
which must not match.

An argument mistake on one rank in checked mode is voted: every rank raises, and the correct forward right after
matches the reference with both its all-to-alls on the NCCL route, as the route's helper recorded them
(``nccl_route_ran``); its negative control runs the same forwards through a helper on the CPU plan transport, where
they run fused and that assertion fails.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.conftest import build_helper, recorded_calls

B, H, D = 2, 6, 8  # H divides by 2 and 3


def _globals(seq: int, text: int, dtype: torch.dtype, heads: int = H) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seq * 31 + text)

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    angles = torch.rand(seq, D // 2, generator=g, dtype=torch.float64) * 6.0
    t = {name: rand(B, seq, heads, D) for name in ("q", "k", "v", "g")}
    if text:
        t.update({name: rand(B, text, heads, D) for name in ("rq", "rk", "rv", "rg")})
    t["cos"], t["sin"] = angles.cos().to(dtype), angles.sin().to(dtype)
    return t


def _reference(t: dict, text: int, causal: bool, rotary: bool) -> dict[str, torch.Tensor]:
    from fastvideo.attention.dense import attention
    from fastvideo.attention.rotary import apply_rotary

    leaves = {n: t[n].clone().requires_grad_() for n in ("q", "k", "v", *(("rq", "rk", "rv") if text else ()))}
    q, k, v = leaves["q"], leaves["k"], leaves["v"]
    if rotary:
        q, k = apply_rotary(q, t["cos"], t["sin"]), apply_rotary(k, t["cos"], t["sin"])
    if text:
        q, k, v = (torch.cat([a, leaves[r]], dim=1) for a, r in ((q, "rq"), (k, "rk"), (v, "rv")))
    out = attention(q, k, v, causal=causal)
    seq = t["q"].shape[1]
    loss = (out[:, :seq] * t["g"]).sum()
    if text:
        loss = loss + (out[:, seq:] * t["rg"]).sum()
    loss.backward()
    return {"out": out[:, :seq].detach(), "rep": out[:, seq:].detach() if text else None,
            **{f"d{n}": leaf.grad for n, leaf in leaves.items()}}


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute difference relative to ``b``'s largest magnitude (0 for two empty tensors: a zero share)."""
    if a.numel() == 0 and b.numel() == 0:
        return 0.0
    return (a.double() - b.double()).abs().max().item() / max(b.double().abs().max().item(), 1e-30)


def _replicated_errs(rep_out: torch.Tensor, rep: dict, ref: dict) -> dict[str, float]:
    """The replicated tokens' output and their input gradients summed over the SP ranks (collective), against
    the reference."""
    import torch.distributed as dist

    from fastvideo.distributed.parallel_state import get_sp_group

    errs = {"replicated out": _err(rep_out, ref["rep"])}
    for n in ("rq", "rk", "rv"):
        total = rep[n].grad.clone()
        dist.all_reduce(total, group=get_sp_group().device_group)
        errs[f"d{n} (sum over ranks)"] = _err(total, ref[f"d{n}"])
    return errs


def _attention_parity(rank, world_size, seq, text, causal, rotary, fused, compiled, give_seq_len=True):

    from fastvideo.attention.layer import DistributedAttention
    from fastvideo.distributed.device_communicators import ulysses_a2a

    dtype = torch.float32 if fused else torch.float64  # the CPU plan transport takes fp32/bf16/fp16
    helper = None
    if fused:
        helper = build_helper()
        ulysses_a2a.install_default_helper(helper)
    t = _globals(seq, text, dtype)
    ref = _reference(t, text, causal, rotary)
    p = world_size
    rows = -(-seq // p)
    padded = rows * p

    def shard(x):
        x = torch.cat([x, x.new_zeros(B, padded - seq, H, D)], dim=1)
        return x[:, rank * rows:(rank + 1) * rows].clone()

    local = {n: shard(t[n]).requires_grad_() for n in ("q", "k", "v")}
    rep = {n: t[n].clone().requires_grad_() for n in ("rq", "rk", "rv")} if text else {}
    layer = DistributedAttention(H, D, causal=causal)
    if compiled:  # opted in as upstream's regional compile does: by default forward stays behind compiler.disable
        layer._set_compile_forward_enabled(True)
    call = torch.compile(layer, fullgraph=True, backend="aot_eager", dynamic=False) if compiled else layer
    mark = len(helper.history) if helper is not None else 0
    out, rep_out = call(local["q"], local["k"], local["v"], original_seq_len=seq if give_seq_len else None,
                        replicated_q=rep.get("rq"), replicated_k=rep.get("rk"), replicated_v=rep.get("rv"),
                        freqs_cis=(t["cos"], t["sin"]) if rotary else None)
    loss = (out * shard(t["g"])).sum()
    if text:
        loss = loss + (rep_out * t["rg"]).sum() / p  # every rank holds it: count it once over the group
    loss.backward()
    routes = [r.route for r in list(helper.history)[mark:]] if helper is not None else []

    mine = slice(rank * rows, min((rank + 1) * rows, seq))
    n_mine = mine.stop - mine.start
    errs = {"out": _err(out[:, :n_mine], ref["out"][:, mine]),
            "pad rows out": out[:, n_mine:].abs().max().item() if n_mine < rows else 0.0}
    for n in ("q", "k", "v"):
        errs[f"d{n}"] = _err(local[n].grad[:, :n_mine], ref[f"d{n}"][:, mine])
        errs[f"pad rows d{n}"] = local[n].grad[:, n_mine:].abs().max().item() if n_mine < rows else 0.0
    if text:
        errs.update(_replicated_errs(rep_out, rep, ref))
    eager = None
    if compiled:  # the same call eagerly: the compiled graph must match it bit for bit
        again = {n: shard(t[n]) for n in ("q", "k", "v")}
        e_out, e_rep = layer(again["q"], again["k"], again["v"], original_seq_len=seq,
                             replicated_q=t.get("rq"), replicated_k=t.get("rk"), replicated_v=t.get("rv"),
                             freqs_cis=(t["cos"], t["sin"]) if rotary else None)
        eager = torch.equal(e_out, out.detach()) and (not text or torch.equal(e_rep, rep_out.detach()))
    return errs, routes, tuple(out.shape), tuple(rep_out.shape) if rep_out is not None else None, eager


CASES = {  # (seq, text tokens, causal, rotary)
    "padded+text+rotary": (13, 5, False, True),
    "padded+causal": (11, 0, True, True),
    "even, no text": (12, 0, False, False),
}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_distributed_attention_matches_the_single_device_reference(ranks, world_size, case):
    seq, text, causal, rotary = CASES[case]
    for errs, routes, shape, rep_shape, _ in ranks(world_size, _attention_parity, seq, text, causal, rotary, False,
                                                   False):
        assert all(e < 1e-10 for e in errs.values()), errs
        assert shape == (B, -(-seq // world_size), H, D)
        assert rep_shape == ((B, text, H, D) if text else None)
        assert routes == []  # off: no helper


def test_fused_route_underneath_under_auto(ranks):
    """auto with the CPU plan transport: the packed QKV all-to-all and the output's, forward and backward (4
    calls), all fused; results as the reference (float32)."""
    for errs, routes, *_ in ranks(2, _attention_parity, 13, 5, False, True, True, False,
                                  env={"FASTVIDEO_ULYSSES_A2A": "auto"}):
        assert all(e < 1e-5 for e in errs.values()), errs
        assert routes == ["fused"] * 4, routes


def test_compiles_with_fullgraph_and_matches_eager(ranks):
    """torch.compile(fullgraph=True) (aot_eager): no graph break (fullgraph raises on one), forward and backward
    as the reference, and the compiled output bit-exact against eager."""
    for errs, _, _, _, eager in ranks(2, _attention_parity, 13, 5, False, True, False, True, timeout_s=240):
        assert all(e < 1e-10 for e in errs.values()), errs
        assert eager is True


def test_negative_control_without_original_seq_len_the_padding_is_attended(ranks):
    errs = [r[0] for r in ranks(2, _attention_parity, 13, 5, False, False, False, False, False)]
    assert max(e["out"] for e in errs) > 1e-3, errs


def _bad_calls(rank, world_size):
    from fastvideo.attention.layer import DistributedAttention, LocalAttention
    from tests.distributed.conftest import catch

    layer = DistributedAttention(H, D)
    x = torch.zeros(B, 4, H, D)
    wide = torch.zeros(B, 4, H + 2, D)
    return {
        "kv heads": catch(DistributedAttention, H, D, num_kv_heads=2)[:2],
        "extra": catch(DistributedAttention, H, D, dropout_rate=0.1)[:2],
        "backends": catch(DistributedAttention, H, D, supported_attention_backends=("VIDEO_SPARSE_ATTN",))[:2],
        "shapes": catch(layer, x, x[:, :2], x)[:2],
        "heads": catch(layer, wide, wide, wide)[:2],
        "partial replicated": catch(layer, x, x, x, replicated_q=x)[:2],
        "seq len": catch(layer, x, x, x, original_seq_len=4 * world_size + 1)[:2],
        "seq len 0": catch(layer, x, x, x, original_seq_len=0)[:2],  # out of range, not "no padding"
        "local gqa": tuple(LocalAttention(H, D, num_kv_heads=3)(x, x[:, :, :3], x[:, :, :3]).shape),
    }


def test_bad_arguments_raise_clearly(ranks):
    for r in ranks(2, _bad_calls):
        assert r["kv heads"][0] == "ValueError" and "num_kv_heads=2 must equal num_heads=6" in r["kv heads"][1]
        assert r["extra"][0] == "TypeError" and "dropout_rate" in r["extra"][1]
        assert r["backends"][0] == "ValueError" and "VIDEO_SPARSE_ATTN" in r["backends"][1]
        assert r["shapes"][0] == "ValueError" and "one shape" in r["shapes"][1]
        assert r["heads"][0] == "ValueError" and "num_heads, head_size" in r["heads"][1]
        assert r["partial replicated"][0] == "ValueError" and "together" in r["partial replicated"][1]
        assert r["seq len"][0] == "ValueError" and "original_seq_len=9 must be in 1..8" in r["seq len"][1]
        assert r["seq len 0"][0] == "ValueError" and "original_seq_len=0 must be in 1..8" in r["seq len 0"][1]
        assert r["local gqa"] == (B, 4, H, D)


def _uneven_attention(rank, world_size, seq_splits, heads, text, fused):

    from fastvideo.attention.layer import DistributedAttention
    from fastvideo.distributed.device_communicators import ulysses_a2a

    dtype = torch.float32 if fused else torch.float64
    helper = None
    if fused:
        helper = build_helper()
        ulysses_a2a.install_default_helper(helper)
    seq = sum(seq_splits)
    t = _globals(seq, text, dtype, heads)
    ref = _reference(t, text, False, True)
    start = sum(seq_splits[:rank])
    mine = slice(start, start + seq_splits[rank])
    local = {n: t[n][:, mine].clone().requires_grad_() for n in ("q", "k", "v")}
    rep = {n: t[n].clone().requires_grad_() for n in ("rq", "rk", "rv")} if text else {}
    layer = DistributedAttention(heads, D)
    mark = len(helper.history) if helper is not None else 0
    out, rep_out = layer(local["q"], local["k"], local["v"], replicated_q=rep.get("rq"),
                         replicated_k=rep.get("rk"), replicated_v=rep.get("rv"), freqs_cis=(t["cos"], t["sin"]),
                         seq_splits=seq_splits)
    loss = (out * t["g"][:, mine]).sum()
    if text:
        loss = loss + (rep_out * t["rg"]).sum() / world_size
    loss.backward()
    routes = [r.route for r in list(helper.history)[mark:]] if helper is not None else []

    errs = {"out": _err(out, ref["out"][:, mine])}
    for n in ("q", "k", "v"):
        errs[f"d{n}"] = _err(local[n].grad, ref[f"d{n}"][:, mine])
    if text:
        errs.update(_replicated_errs(rep_out, rep, ref))
    # The negative control: this rank's output read against the rows an even shard would have had.
    rows = -(-seq // world_size)
    even = slice(min(rank * rows, seq), min(rank * rows + out.shape[1], seq))
    wrong = _err(out[:, :even.stop - even.start], ref["out"][:, even]) if even.stop > even.start else None
    return errs, routes, tuple(out.shape), tuple(rep_out.shape) if rep_out is not None else None, wrong


UNEVEN = {  # world size: (seq_splits, heads): shares that differ, one of them 0; heads the SP size does not divide
    2: ((9, 4), 5),
    3: ((5, 0, 6), 4),
    4: ((3, 5, 1, 2), 6),
}


@pytest.mark.parametrize("fused", [False, True], ids=["off", "auto"])
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_uneven_shards_and_heads_match_the_single_device_reference_without_padding(ranks, world_size, fused):
    seq_splits, heads = UNEVEN[world_size]
    env = {"FASTVIDEO_ULYSSES_A2A": "auto"} if fused else None
    tol = 1e-5 if fused else 1e-10
    wrongs = []
    for rank, (errs, routes, shape, rep_shape, wrong) in enumerate(
            ranks(world_size, _uneven_attention, seq_splits, heads, 3, fused, env=env)):
        assert all(e < tol for e in errs.values()), (rank, errs)
        assert shape == (B, seq_splits[rank], heads, D)  # this rank's own rows: no padding
        assert rep_shape == (B, 3, heads, D)
        assert routes == (["fused"] * 4 if fused else []), routes
        if wrong is not None:
            wrongs.append(wrong)
    assert max(wrongs) > 1e-3, wrongs  # the negative control: the even shards' offsets do not match


def _uneven_bad(rank, world_size):
    from fastvideo.attention.layer import DistributedAttention
    from tests.distributed.conftest import catch

    layer = DistributedAttention(H, D)
    x = torch.zeros(B, 3, H, D)
    return {"padding too": catch(layer, x, x, x, original_seq_len=5, seq_splits=(3, 3))[:2],
            "wrong share": catch(layer, x, x, x, seq_splits=(2, 4))[:2]}


def test_uneven_bad_arguments_raise_clearly(ranks):
    for r in ranks(2, _uneven_bad):
        assert r["padding too"][0] == "ValueError" and "uneven shards carry no padding" in r["padding too"][1]
        assert r["wrong share"][0] == "ValueError" and "seq_splits" in r["wrong share"][1]


def _one_rank_mistakes(rank, world_size, fused=False):
    """Each of five argument mistakes on rank 1 only, the other ranks calling correctly: what each rank raised, how
    long it took, whether a correct forward right after matches the reference on every rank, and the (route, decline
    reason) of each all-to-all of that forward (``recorded_calls``). ``fused`` (the route assertion's negative
    control): through a helper on the CPU plan transport, in float32 (what it moves)."""
    import time

    from fastvideo.attention.layer import DistributedAttention
    from fastvideo.distributed.device_communicators import ulysses_a2a

    if fused:
        ulysses_a2a.install_default_helper(build_helper())
    dtype, tolerance = (torch.float32, 1e-5) if fused else (torch.float64, 1e-10)
    layer = DistributedAttention(H, D)
    seq = 4 * world_size
    t = _globals(seq, 0, dtype)
    ref = _reference(t, 0, False, False)["out"][:, 4 * rank:4 * rank + 4]
    q, k, v = (t[n][:, 4 * rank:4 * rank + 4] for n in ("q", "k", "v"))
    wide = torch.zeros(B, 4, H + 2, D, dtype=dtype)
    mistakes = {"seq len": ((q, k, v), {"original_seq_len": seq + 1}), "heads": ((wide, wide, wide), {}),
                "partial replicated": ((q, k, v), {"replicated_q": q}), "not a tensor": ((q, None, v), {}),
                "replicated not a tensor": ((q, k, v), {"replicated_q": q, "replicated_k": 1, "replicated_v": v})}
    seen = {}
    for name, (args, kw) in mistakes.items():
        start = time.monotonic()
        try:
            layer(*args, **kw) if rank == 1 else layer(q, k, v)
            got = ("ok", "")
        except Exception as exc:  # noqa: BLE001 - the test asserts on what came back
            got = (type(exc).__name__, str(exc))
        with recorded_calls() as ran:
            out, _ = layer(q, k, v)
        seen[name] = (*got, time.monotonic() - start, bool((out - ref).abs().max() < tolerance), ran)
    return seen


def nccl_route_ran(route: str) -> list:
    """What ``recorded_calls`` gives for one forward whose two all-to-alls (the packed QKV's and the output's) ran on
    the NCCL route in checked mode on CPU: under ``off`` the checked-off helper records them (``disabled``), under
    ``auto`` the default helper, declined at construction (no transport on CPU: ``transport_missing``)."""
    return [("nccl", "disabled" if route == "off" else "transport_missing")] * 2


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("route", ["off", "auto"])
def test_an_argument_mistake_on_one_rank_raises_on_every_rank_in_checked_mode(ranks, route, world_size):
    """A forward's argument check that fails on rank 1 alone is voted (checked mode): rank 1 raises the check's
    ValueError, every other rank PeerCallError naming rank 1, all within 10 s (never a peer left in that forward's
    exchange to pair it with rank 1's next forward), and a correct forward right after matches the reference on
    every rank, its all-to-alls on the NCCL route (``nccl_route_ran``). Without the vote the other ranks' forward
    would wait in its exchange and take rank 1's next."""
    env = {"FASTVIDEO_ULYSSES_A2A_CHECKED": "1", "FASTVIDEO_ULYSSES_A2A_VOTE_TIMEOUT_S": "20",
           "FASTVIDEO_ULYSSES_A2A": route}
    got = ranks(world_size, _one_rank_mistakes, env=env, timeout_s=120)
    texts = {"seq len": "original_seq_len=", "heads": "num_heads, head_size", "partial replicated": "together",
             "not a tensor": "k must be 4-D [B, S/P, H, D], got NoneType",
             "replicated not a tensor": "'int' object has no attribute 'shape'"}  # the check's own AttributeError
    for name, text in texts.items():
        kind = "AttributeError" if name == "replicated not a tensor" else "ValueError"
        assert got[1][name][0] == kind and text in got[1][name][1], got[1][name]
        for r in range(world_size):
            if r != 1:
                assert got[r][name][0] == "PeerCallError" and "rank(s) [1]" in got[r][name][1], got[r][name]
            assert got[r][name][2] < 10 and got[r][name][3], (r, got[r][name])
            assert got[r][name][4] == nccl_route_ran(route), (r, got[r][name])


def test_negative_control_the_route_assertion_fails_where_another_route_ran(ranks):
    """The same mistakes and forwards through a helper on the CPU plan transport (``auto``): every rank raises and
    the correct forwards match the reference, but their all-to-alls ran fused, so the route assertion above fails
    on them."""
    checked = {"FASTVIDEO_ULYSSES_A2A_CHECKED": "1", "FASTVIDEO_ULYSSES_A2A_VOTE_TIMEOUT_S": "20"}
    rank0, rank1 = ranks(2, _one_rank_mistakes, True, env={**checked, "FASTVIDEO_ULYSSES_A2A": "auto"}, timeout_s=120)
    for name in ("seq len", "heads", "partial replicated"):
        assert (rank0[name][0], rank1[name][0]) == ("PeerCallError", "ValueError"), (rank0[name], rank1[name])
        for seen in (rank0[name], rank1[name]):
            assert seen[2] < 10 and seen[3] and seen[4] == [("fused", None)] * 2, seen
            assert seen[4] != nccl_route_ran("auto")
