"""Uneven sequence and head splits (``seq_splits`` / ``head_splits``), no padding, on gloo ranks at P = 2, 3, 4.

Every result is compared bit for bit with an independent reference built from ``all_gather``: each rank gathers
every rank's input (and upstream gradient) and computes what it must hold by concatenating and slicing the
whole tensor, never through the layouts under test. Covered here:

* both modes, forward and backward, every dtype the contract codes, uneven sequence and head tables with a
  zero share (an idle rank), B 1 and 2, on the NCCL route (``off``) and on the CPU fused route
  (``GlooPlanTransport``), where each call's route and plan are asserted (the kernel's dtypes run fused, the
  others decline ``dtype``; a transport without ``ENTRY_UNEVEN`` declines ``uneven_splits``: the control);
* chunks sized by the largest share (a shorter share contributes fewer or no rows; the window bound is met
  exactly and would be overrun by an even-style sizing), the backward running its forward's plan;
* tables that differ across ranks: ``ContractMismatchError`` naming SPLITS and every rank's tables on every
  rank, in checked mode on the ``off`` and ``auto`` routes and on the fused route without it (explicit even
  tables on one rank and None on another are the same call: the control);
* validation before any collective, through every entry point; ``torch.compile(fullgraph=True)`` with a
  dynamic length and tables derived from it (one frame); the fake impl's uneven shapes; ``opcheck``; a forced
  CUDA-graph capture freezing the tables; the NCCL route's ``all_to_all_single`` split sizes (None when even).

The even case is the rest of the suite: it runs through these same code paths with equal shares.
"""

from __future__ import annotations

import math
import time

import pytest
import torch

from fastvideo.distributed.all_to_all import (
    EVEN,
    Splits,
    output_shape,
    pack,
    reference_all_to_all,
    unpack,
    validate_input,
)
from fastvideo.distributed.ulysses import contract
from fastvideo.distributed.ulysses.contract import ContractMismatchError, DeclineReason, Field, Phase
from fastvideo.distributed.ulysses.policy import ORIGINAL_CTAS, Geometry, Plan, TunedRow
from fastvideo.distributed.ulysses.transport import ENTRY_UNEVEN, Capability
from tests.distributed.conftest import FIXTURE_GPU, a2a, bit_equal, build_helper, catch, forced_capture
from tests.plan_transport import GlooPlanTransport

A2A, CHECKED = "FASTVIDEO_ULYSSES_A2A", "FASTVIDEO_ULYSSES_A2A_CHECKED"
D = 3
# Every dtype the contract codes, and two it does not (code 0): the NCCL route moves bytes, so it takes them all.
DTYPES = (*contract.DTYPE_CODES, torch.bool, torch.complex64)
GRAD_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
# P -> (seq_splits, head_splits); None is the even table. Each P has a zero share somewhere.
CASES = {
    2: [((5, 3), (7, 5)), ((0, 6), (4, 4)), (None, (12, 0)), (None, None), ((4, 4), (3, 3))],  # the last two: even
    3: [((5, 0, 3), (2, 3, 1)), ((4, 4, 5), (14, 13, 13))],  # 40 heads at SP3: Wan 14B's count
    4: [((3, 1, 4, 0), None), ((2, 2, 2, 2), (4, 0, 5, 3))],
}


# ------------------------------------------------------------------------------------- the independent reference


def _full_tables(seq, heads, world, s_local: int = 4, h_local: int = 3):
    """(seq table, head table) with None replaced by the even table of ``s_local`` rows / ``h_local`` heads."""
    return tuple(seq) if seq is not None else (s_local,) * world, tuple(heads) if heads is not None else (
        h_local,) * world


def _at(table, rank) -> slice:
    start = sum(table[:rank])
    return slice(start, start + table[rank])


def gather(x: torch.Tensor, shapes) -> list[torch.Tensor]:
    """Every rank's tensor (rank r's of ``shapes[r]``), through one ``all_gather`` of bytes padded to the largest
    (the reference's own exchange: no layout, no split sizes of the code under test)."""
    import torch.distributed as dist

    from fastvideo.distributed.parallel_state import get_sp_group

    size = x.element_size()
    flat = x.detach().contiguous().view(-1).view(torch.uint8)
    buf = torch.zeros(max(math.prod(s) for s in shapes) * size, dtype=torch.uint8)
    buf[:flat.numel()] = flat
    out = [torch.empty_like(buf) for _ in shapes]
    dist.all_gather(out, buf, group=get_sp_group().device_group)
    return [o[:math.prod(s) * size].view(x.dtype).view(s) for o, s in zip(out, shapes, strict=True)]


def expected(inputs: list[torch.Tensor], mode: int, seq, heads, rank: int) -> torch.Tensor:
    """What ``rank`` must hold: mode 0 its head share of the whole sequence, mode 1 its rows of every head."""
    if mode == 0:
        return torch.cat(inputs, 1)[:, :, _at(heads, rank)]
    return torch.cat(inputs, 2)[:, _at(seq, rank)]


def draw(shape, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64).to(dtype)


def in_shapes(mode, b, seq, heads):
    """Every rank's input shape."""
    if mode == 0:
        return [(b, s, sum(heads), D) for s in seq]
    return [(b, sum(seq), h, D) for h in heads]


def _check(rank, world, call, mode, b, seq, heads, dtype, seed, grad) -> tuple[bool, bool | None]:
    """One call of ``call(x, mode)`` checked against the reference: (output exact, input gradient exact or None)."""
    shapes = in_shapes(mode, b, seq, heads)
    x = draw(shapes[rank], dtype, seed * 31 + rank).requires_grad_(grad)
    y = call(x, mode)
    ok = bit_equal(y, expected(gather(x, shapes), mode, seq, heads, rank))
    if not grad:
        return ok, None
    w = draw(y.shape, dtype, seed * 37 + rank)
    (y * w).sum().backward()
    # The loss is sum_r <y_r, w_r>: the gradient of x_r is the inverse exchange of the w's.
    out_shapes = in_shapes(1 - mode, b, seq, heads)
    return ok, bit_equal(x.grad, expected(gather(w, out_shapes), 1 - mode, seq, heads, rank))


# ------------------------------------------------------------------------------------- exact, every route


def _exact(rank, world, route):
    from fastvideo.distributed.communication_op import sequence_model_parallel_all_to_all_4D as op
    from fastvideo.distributed.ulysses import registry

    helper = None
    if route == "fused":
        helper = build_helper(table=())
        registry.install_default_helper(helper)
    checks, records = [], []
    for case, (seq_arg, heads_arg) in enumerate(CASES[world]):
        seq, heads = _full_tables(seq_arg, heads_arg, world)

        def call(x, mode, seq_arg=seq_arg, heads_arg=heads_arg):
            dims = (2, 1) if mode == 0 else (1, 2)
            return op(x, *dims, seq_splits=seq_arg, head_splits=heads_arg)

        for b in (1, 2):
            for dtype in DTYPES:
                grad = dtype in GRAD_DTYPES
                for mode in (0, 1):
                    mark = len(helper.history) if helper is not None else 0
                    ok, grad_ok = _check(rank, world, call, mode, b, seq, heads, dtype, case * 100 + b, grad)
                    checks.append((case, b, str(dtype), mode, ok, grad_ok))
                    if helper is not None:
                        records += [(case, b, str(dtype), r.mode, r.phase.name, r.route,
                                     r.plan.word if r.plan else 0, r.reason.label if r.reason is not None else None)
                                    for r in list(helper.history)[mark:]]
    return checks, records, registry.route() is None


def _expected_records(world):
    """The route and plan of every call on the fused route: the original plan (no tuned rows) for the kernel's
    dtypes, whole operand in one chunk sized by the largest share, its backward with the same plan; a decline
    ``dtype`` for the others."""
    kernel = (torch.float32, torch.float16, torch.bfloat16)
    out = []
    for case, (seq_arg, heads_arg) in enumerate(CASES[world]):
        seq, _ = _full_tables(seq_arg, heads_arg, world)
        for b in (1, 2):
            word = Plan(ORIGINAL_CTAS, b, max(seq), tuned=False).word
            for dtype in DTYPES:
                for mode in (0, 1):
                    fused = dtype in kernel
                    route, plan, reason = ("fused", word, None) if fused else ("nccl", 0, "dtype")
                    phase = "FORWARD_GRAD" if dtype in GRAD_DTYPES else "FORWARD_NO_GRAD"
                    out.append((case, b, str(dtype), mode, phase, route, plan, reason))
                    if dtype in GRAD_DTYPES:
                        out.append((case, b, str(dtype), 1 - mode, "BACKWARD", route, plan, reason))
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("route", ["off", "fused"])
def test_uneven_splits_bit_exact_against_an_all_gather_reference(ranks, world, route):
    """P = 2, 3, 4; uneven sequence and head tables with a zero share; both modes; B 1 and 2; every dtype
    forward, the floating ones backward too: bit-exact on every rank. Under ``off`` no helper exists (the NCCL
    route); on the CPU fused route every call's route and plan are the expected ones."""
    env = {A2A: "auto" if route == "fused" else "off"}
    results = ranks(world, _exact, route, env=env, timeout_s=300)
    n = len(CASES[world]) * 2 * len(DTYPES) * 2
    for checks, records, no_helper in results:
        assert len(checks) == n and all(ok for *_, ok, _ in checks), [c for c in checks if not c[4]]
        assert all(g is not False for *_, g in checks)
        assert sum(g is True for *_, g in checks) == n * len(GRAD_DTYPES) // len(DTYPES)
        assert no_helper == (route == "off")
        if route == "fused":
            assert records == _expected_records(world)


# ------------------------------------------------------------------------------------- plans, windows and chunks


def _chunked(rank, world, window, with_uneven):
    """SP3, seq (5, 1, 2), heads (1, 2, 3): one row of the largest share is 3 x 3 heads x D x 4 B."""
    import tests.plan_transport as transport_mod

    seq, heads = (5, 1, 2), (1, 2, 3)
    received = []
    blocks = transport_mod.chunk_blocks

    def recording(x, out, geom, rank_, *chunk):  # each chunk's bytes into this rank's window
        sends, dests = blocks(x, out, geom, rank_, *chunk)
        received.append(sum(d.numel() for d in dests) * x.element_size())
        return sends, dests

    transport_mod.chunk_blocks = recording
    cap = GlooPlanTransport().capability()
    if not with_uneven:  # the control: a transport that does not offer uneven plans
        cap = Capability(cap.name, True, abi_version=cap.abi_version, entry_points=cap.entry_points - {ENTRY_UNEVEN},
                         dtypes=cap.dtypes, supports_unaligned=True)
    row = TunedRow(FIXTURE_GPU, world, torch.float32, sum(heads), D, ctas=144, planes_per_chunk=1, source="test")
    h = build_helper(transport=GlooPlanTransport(capability_override=cap), window_bytes=window, table=(row,))
    found = []
    for mode in (0, 1):
        ok, grad_ok = _check(rank, world, lambda x, m: a2a(h, x, m, seq_splits=seq, head_splits=heads), mode, 2, seq,
                             heads, torch.float32, 7 + mode, True)
        found.append((ok, grad_ok, [tuple(r)[3:7] for r in list(h.history)[-2:]]))
    # The even call of the same size runs fused on either transport (the control's control).
    ok, _ = _check(rank, world, lambda x, m: a2a(h, x, m), 0, 2, (2, 2, 2), (2, 2, 2), torch.float32, 9, False)
    found.append((ok, None, [tuple(h.history[-1])[3:7]]))
    h.destroy()
    return found, received


def test_chunks_take_the_same_rows_from_every_share_and_the_window_is_sized_by_the_largest(ranks):
    """A window of exactly one row of the largest head share (P x 3 heads x D x 4 B = 108 B): the policy cuts
    the 5-row planes into 1-row chunks, 10 per call, where shorter shares send nothing after their last row;
    exact, both modes, forward and backward (the backward with its forward's plan). Some rank's chunk fills the
    window exactly, more than an even-style row of H x D x 4 B (72 B) would have allowed."""
    row = 3 * 3 * D * 4
    plan = Plan(144, 1, 1, tuned=True)
    results = ranks(3, _chunked, row, True, timeout_s=120)
    for found, _ in results:
        for ok, grad_ok, records in found[:2]:
            assert ok and grad_ok
            assert [rec[:2] for rec in records] == [("fused", plan)] * 2 and [rec[3] for rec in records] == [10] * 2
        assert found[2][0] and found[2][2][0][:2] == ("fused", Plan(144, 1, 1, tuned=True))
    assert max(max(received) for _, received in results) == row > 6 * D * 4


def test_a_window_below_one_row_of_the_largest_share_declines_and_uneven_needs_the_offering(ranks):
    """One byte less than a row of the largest share: the uneven calls decline ``window`` (exact on the NCCL
    route). Control: a transport without ``ENTRY_UNEVEN`` declines ``uneven_splits`` on every rank, never an
    error, while an even call of the same size still runs fused."""
    row = 3 * 3 * D * 4
    for found, _ in ranks(3, _chunked, row - 1, True, timeout_s=120):
        assert all(ok and grad_ok for ok, grad_ok, _ in found[:2])
        assert [rec[0] for _, _, records in found[:2] for rec in records] == ["nccl"] * 4
        assert {rec[2] for _, _, records in found[:2] for rec in records} == {DeclineReason.WINDOW}
    for found, _ in ranks(3, _chunked, 1 << 20, False, timeout_s=120):
        assert all(ok and grad_ok for ok, grad_ok, _ in found[:2])
        assert [(rec[0], rec[2]) for _, _, records in found[:2] for rec in records] == [
            ("nccl", DeclineReason.UNEVEN_SPLITS)] * 4
        assert found[2][0] and found[2][2][0][0] == "fused"


def _backward_runs_the_forwards_plan(rank, world):
    seq, heads = (6, 1), (5, 3)
    rows = TunedRow(FIXTURE_GPU, world, torch.float32, sum(heads), D, ctas=144, planes_per_chunk=1, row_chunks=2,
                    source="test")
    h = build_helper(table=(rows,))
    x = draw((2, seq[rank], sum(heads), D), torch.float32, rank).requires_grad_()
    y = a2a(h, x, 0, seq_splits=seq, head_splits=heads)
    h.tuned_table = ()  # the policy changes between forward and backward: the backward must not re-decide
    geom = Geometry.from_input(x.shape, 0, world, torch.float32, seq_splits=seq, head_splits=heads)
    now = h.plan_for(geom, grad=True).plan
    (gx,) = torch.autograd.grad(y, x, torch.ones_like(y))
    return [(r.phase.name, r.mode, r.route, r.plan) for r in h.history], now, bool(torch.all(gx == 1))


def test_backward_runs_the_inverse_with_the_same_tables_and_the_forwards_plan(ranks):
    """The forward's tuned plan (3 rows per chunk: 6 rows in two) is the backward's, though the policy would
    now choose the original plan (the control); the gradient is exact."""
    tuned = Plan(144, 1, 3, tuned=True)
    for records, now, grad_ok in ranks(2, _backward_runs_the_forwards_plan, timeout_s=60):
        assert records == [("FORWARD_GRAD", 0, "fused", tuned), ("BACKWARD", 1, "fused", tuned)]
        assert now != tuned and not now.tuned and grad_ok


def _attention_block(rank, world, route):
    from fastvideo.distributed.communication_op import balanced_splits
    from fastvideo.distributed.parallel_state import get_sp_group
    from fastvideo.distributed.ulysses import registry
    from sp_recipes.attention_block import SPSelfAttention

    if route == "fused":
        registry.install_default_helper(build_helper(table=()))
    torch.manual_seed(0)
    heads, seq_len = 4, 10  # neither divisible by 3: heads (2, 1, 1), tokens (4, 3, 3), nothing padded
    # The CPU fused route moves float32 (float64 declines dtype there), the NCCL route anything.
    dtype, rtol, atol = (torch.float32, 1e-5, 1e-6) if route == "fused" else (torch.float64, 1e-10, 1e-12)
    block = SPSelfAttention(4 * heads, heads, dtype=dtype)
    x = torch.randn(2, seq_len, 4 * heads, dtype=dtype)
    seq = balanced_splits(seq_len, world)
    x_local = x[:, _at(seq, rank)].clone().requires_grad_()
    y = block(x_local, seq_splits=seq)
    y.square().sum().backward()
    grads = [p.grad.clone() for p in block.parameters()]
    for g in grads:
        torch.distributed.all_reduce(g, group=get_sp_group().device_group)
    block.zero_grad()
    x_ref = x.clone().requires_grad_()
    y_ref = block.forward_reference(x_ref)
    y_ref.square().sum().backward()
    helper = registry.current_default_helper()
    routes = sorted({r.route for r in helper.history}) if helper is not None else []
    close = [torch.allclose(a, b, rtol=rtol, atol=atol) for a, b in
             [(y, y_ref[:, _at(seq, rank)]), (x_local.grad, x_ref.grad[:, _at(seq, rank)]),
              *zip(grads, [p.grad for p in block.parameters()])]]
    return close, tuple(y.shape), routes


@pytest.mark.parametrize("route", ["off", "fused"])
def test_the_sp_attention_block_at_a_length_and_head_count_p_does_not_divide(ranks, route):
    """SP3, 10 tokens and 4 heads: the block's output, input gradient and parameter gradients equal the
    single-device reference's (float64 on the NCCL route, float32 on the CPU fused route, where every call ran
    fused), with no padding: each rank's output has its own share's rows."""
    results = ranks(3, _attention_block, route, env={A2A: "auto" if route == "fused" else "off"}, timeout_s=120)
    for rank, (close, shape, routes) in enumerate(results):
        assert all(close) and shape == (2, (4, 3, 3)[rank], 16)
        assert routes == (["fused"] if route == "fused" else [])


def test_balanced_splits():
    from fastvideo.distributed.communication_op import balanced_splits

    assert balanced_splits(10, 3) == (4, 3, 3) and balanced_splits(32760, 16)[-1] == 2047
    assert balanced_splits(12, 8) == (2, 2, 2, 2, 1, 1, 1, 1) and balanced_splits(2, 3) == (1, 1, 0)
    assert sum(balanced_splits(32760, 16)) == 32760 and balanced_splits(12, 4) == (3,) * 4
    with pytest.raises(ValueError, match="world_size=0"):
        balanced_splits(4, 0)


# ------------------------------------------------------------------------------------- tables that differ


def _mismatch(rank, world, route, kind):
    from fastvideo.distributed.communication_op import sequence_model_parallel_all_to_all_4D as op
    from fastvideo.distributed.ulysses import registry

    if route == "fused":
        registry.install_default_helper(build_helper())
    heads = (4,) * world
    seq = {"tables": (5, 3, 4)[:world] if rank < world - 1 else (3, 5, 4)[:world],
           "none": None if rank == 0 else (3, 5, 4)[:world],
           "explicit even": None if rank == 0 else (4,) * world}[kind]
    rows = 4 if seq is None else seq[rank]
    x = draw((2, rows, sum(heads), D), torch.float32, rank)
    start = time.monotonic()
    got = catch(op, x, 2, 1, seq_splits=seq, head_splits=heads)
    got = ("ok", "", None) if got[0] == "ok" else got  # no tensor back to the parent (it may outlive this rank)
    elapsed = time.monotonic() - start
    # A matching call right after: exact, so no rank was left inside a collective or a call ahead.
    ok, _ = _check(rank, world, lambda t, m: op(t, 2, 1, seq_splits=(5, 3, 4)[:world]), 0, 1, (5, 3, 4)[:world],
                   (4,) * world, torch.float32, 3, False)
    route_helper = registry.route()
    return got, elapsed, ok, route_helper is not None and route_helper.history[-1].route


@pytest.mark.parametrize("route, world, env", [
    ("off", 2, {A2A: "off", CHECKED: "1"}),
    ("auto", 3, {A2A: "auto", CHECKED: "1"}),  # CPU: the helper declined at construction, votes in checked mode
    ("fused", 3, {A2A: "auto"}),  # the fused route votes without checked mode
])
@pytest.mark.parametrize("kind", ["tables", "none"])
def test_tables_that_differ_raise_on_every_rank_naming_splits_and_each_ranks_tables(ranks, route, world, env, kind):
    """The last rank passes other tables with the same sums (or rank 0 passes None, the even table, against
    uneven ones): ContractMismatchError on every rank naming SPLITS, each rank's tables and the fix, the same
    message everywhere, within seconds; the next matching call is exact."""
    results = ranks(world, _mismatch, route, kind, env={**env, "FASTVIDEO_ULYSSES_A2A_VOTE_TIMEOUT_S": "20"},
                    timeout_s=120)
    messages = set()
    for (kind_, message, field), elapsed, ok, after in results:
        assert (kind_, field) == ("ContractMismatchError", "SPLITS"), message
        assert "ranks passed different seq_splits/head_splits" in message and "same tables on every rank" in message
        first = "seq_splits=[4, 4" if kind == "none" else "seq_splits=[5, 3"
        assert f"rank 0: {first}" in message and f"rank {world - 1}: seq_splits=[3, 5" in message
        assert "head_splits=[4, 4" in message
        assert elapsed < 15 and ok and after in ("fused", "nccl")
        messages.add(message)
    assert len(messages) == 1


def test_explicit_even_tables_and_none_are_the_same_call(ranks):
    """The control: rank 0 passes None, the others the even table explicitly: no error on any route that votes
    (checked mode on ``off``, the fused route), the result exact."""
    for env in ({A2A: "off", CHECKED: "1"}, {A2A: "auto"}):
        route = "fused" if env[A2A] == "auto" else "off"
        for got, _, ok, after in ranks(2, _mismatch, route, "explicit even", env=env, timeout_s=120):
            assert got[0] == "ok" and ok and after == ("fused" if route == "fused" else "nccl")


def test_the_digest_alone_names_splits_in_checked_mode():
    """Pure: the verdict on the digests (what every rank sees of the others) already names SPLITS, says the ranks
    passed different tables and shows each rank's digest or ``even``."""
    rows = torch.zeros(2, contract.NUM_FIELDS, dtype=torch.int64)
    rows[:, Field.HEADER] = contract.header(1)
    rows[1, Field.SPLITS] = contract.splits_digest((3, 5), (4, 4))
    err = contract.decide(rows).error
    assert isinstance(err, ContractMismatchError) and err.field is Field.SPLITS
    assert "ranks passed different seq_splits/head_splits" in str(err) and "rank 0: even" in str(err)
    assert f"rank 1: digest {rows[1, Field.SPLITS].item():#018x}" in str(err)


# ------------------------------------------------------------------------------------- validation


BAD = [
    ("length", dict(seq_splits=[4]), "seq_splits has 1 entries for SP size 2; pass one non-negative int per SP rank"),
    ("negative", dict(seq_splits=[9, -1], head_splits=[2, 2]), "seq_splits[1] = -1 is negative"),
    # Shares no dim can hold (here byte counts), that would overflow the vote's fields: named, not an OverflowError.
    ("huge", dict(seq_splits=[4, 1 << 70]), f"seq_splits sums to {4 + (1 << 70)}, more than a dim holds; pass one"),
    ("just too large", dict(seq_splits=[4, (1 << 63) - 4]), f"seq_splits sums to {1 << 63}, more than a dim holds"),
    ("not an int", dict(head_splits=[2.0, 2]), "head_splits[0] = 2.0 is not an int"),
    ("a bool", dict(seq_splits=[4, True]), "seq_splits[1] = True is not an int"),
    ("a string", dict(head_splits="22"), "head_splits must be a list or tuple"),
    ("own share", dict(seq_splits=[3, 5]), "seq_splits[0] = 3 but this rank's x has 4 sequence rows (dim 1"),
    ("sum", dict(head_splits=[3, 3]), "head_splits sums to 6 but x has 4 heads (dim 2"),
]


@pytest.mark.parametrize("case, splits, needle", BAD, ids=[b[0] for b in BAD])
def test_bad_tables_are_value_errors_naming_the_argument_and_the_fix(case, splits, needle):
    """Pure: ``validate_input`` (the one place) on rank 0 of SP2 with x [1, 4, 4, 2] in mode 0."""
    with pytest.raises(ValueError) as info:
        validate_input(torch.zeros(1, 4, 4, 2), 0, 2, rank=0, **splits)
    assert needle in str(info.value) and str(info.value).startswith("sequence_model_parallel_all_to_all_4D: ")


def test_shares_each_in_range_that_overflow_together_are_refused_at_any_sp_size():
    """Pure: at SP 10, nine shares of 2**60 - 1 sum past what a dim (and the vote's int64 S field) holds: a
    ValueError naming the table, where the shares alone pass (the control: eight of them at SP 9)."""
    x = torch.zeros(1, 4, 10, 2)
    with pytest.raises(ValueError, match=r"seq_splits sums to \d+, more than a dim holds"):
        validate_input(x, 0, 10, rank=0, seq_splits=[4] + [(1 << 60) - 1] * 9)
    assert validate_input(x[:, :, :9], 0, 9, rank=0, seq_splits=[4] + [(1 << 60) - 1] * 8).seq[1] == (1 << 60) - 1


def test_a_tensor_that_escaped_a_vmap_is_refused_as_inside_one():
    """Pure: a batched tensor kept past its vmap (no transform active any more) is still refused, by the same
    vmap error (it has no data pointer: let through, it would fail after the call was counted)."""
    leaked = []
    torch.func.vmap(lambda t: leaked.append(t.unsqueeze(0).expand(2, 4, 4, 8)) or t)(torch.randn(3, 4, 4, 8))
    with pytest.raises(RuntimeError, match=r"does not support torch\.func\.vmap"):
        validate_input(leaked[0], 0, 2)


def test_tables_of_any_integer_type_become_int_tuples():
    """A numpy integer (anything with ``__index__``) is a share; a bool is not (BAD above)."""
    import numpy as np

    splits = validate_input(torch.zeros(1, 5, 4, 2), 0, 2, rank=0, seq_splits=list(np.array([5, 3])),
                            head_splits=[np.int64(1), 3])
    assert splits == Splits((5, 3), (1, 3)) and all(type(v) is int for v in (*splits.seq, *splits.heads))


def test_mode_one_checks_the_other_way_round():
    """Mode (1, 2): x holds every sequence row (the table's sum) and this rank's head share."""
    x = torch.zeros(1, 8, 3, 2)
    assert validate_input(x, 1, 2, rank=1, seq_splits=[5, 3], head_splits=[1, 3]) == Splits((5, 3), (1, 3))
    with pytest.raises(ValueError, match=r"seq_splits sums to 7 but x has 8 sequence rows"):
        validate_input(x, 1, 2, rank=1, seq_splits=[4, 3])
    with pytest.raises(ValueError, match=r"head_splits\[0\] = 1 but this rank's x has 3 heads"):
        validate_input(x, 1, 2, rank=0, head_splits=[1, 3])
    with pytest.raises(ValueError, match="sequence \\(dim 1\\) = 7 is not divisible by the SP size 2; pass seq_splits"):
        validate_input(torch.zeros(1, 7, 3, 2), 1, 2, rank=0)
    assert validate_input(torch.zeros(1, 8, 3, 2), 1, 2) is EVEN


def _bad_everywhere(rank, world, entry):
    from fastvideo.distributed.communication_op import sequence_model_parallel_all_to_all_4D as op

    h = build_helper()
    x = torch.zeros(1, 4, 4, 2)
    bad = {"seq_splits": [3, 5]}  # rank 0 holds 4 rows, not 3; rank 1 holds 4, not 5
    calls = {
        "public op": lambda: op(x, 2, 1, **bad),
        "helper.all_to_all": lambda: h.all_to_all(x, 0, **bad),
        "try_all_to_all_4D": lambda: h.try_all_to_all_4D(x, 2, 1, **bad),
        "the op": lambda: torch.ops.fastvideo.ulysses_all_to_all_4d(x, 0, False, None, h.id, **bad),
    }
    got = catch(calls[entry])
    return (got if got[0] != "ok" else ("ok", "", None)), h.stats()["calls"], len(h.vote_seconds())


@pytest.mark.parametrize("entry", ["public op", "helper.all_to_all", "try_all_to_all_4D", "the op"])
def test_every_entry_point_raises_before_any_collective(ranks, entry):
    """Both ranks pass a table their input does not match: the same ValueError from every entry point, and the
    helper counted no call and ran no vote (nothing collective was entered)."""
    results = ranks(2, _bad_everywhere, entry, env={A2A: "off"}, timeout_s=60)
    for rank, ((kind, message, _), calls, votes) in enumerate(results):
        assert kind == "ValueError" and f"seq_splits[{rank}] = {(3, 5)[rank]} but this rank's x has 4" in message
        assert (calls, votes) == (0, 0)


# ------------------------------------------------------------------------------------- compile, fake, opcheck


def _compiled(rank, world):
    from torch._dynamo.testing import CompileCounterWithBackend

    from fastvideo.distributed.communication_op import sequence_model_parallel_all_to_all_4D as op

    heads = (5, 3)

    def f(x):
        # Every rank's share derived from this rank's dynamic length: rank q holds base + q rows.
        base = x.shape[1] - rank
        seq = [base + q for q in range(world)]
        y = op(x, 2, 1, seq_splits=seq, head_splits=heads)
        return op(y * 2, 1, 2, seq_splits=seq, head_splits=heads)

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(f, backend=counter, fullgraph=True)
    exact = []
    for base in (3, 5, 8):
        x = draw((2, base + rank, sum(heads), D), torch.float32, base).requires_grad_()
        torch._dynamo.mark_dynamic(x, 1)
        out = compiled(x)
        (gx,) = torch.autograd.grad(out.sum(), x)
        x_eager = x.detach().clone().requires_grad_()
        ref = f(x_eager)
        (gref,) = torch.autograd.grad(ref.sum(), x_eager)
        exact.append(bit_equal(out, ref) and bit_equal(gx, gref) and bit_equal(out, 2 * x.detach()))
    return exact, counter.frame_count


def test_fullgraph_compile_with_a_dynamic_length_and_derived_tables_compiles_once(ranks):
    """Tables derived from a dynamic length stay symbolic (``SymInt[]`` in the schema): one frame for three
    lengths, forward and backward exact against eager."""
    for exact, frames in ranks(2, _compiled, env={A2A: "off"}, timeout_s=180):
        assert exact == [True] * 3 and frames == 1


def _fake_and_opcheck(rank, world):
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fastvideo.distributed.communication_op import sequence_model_parallel_all_to_all_4D as op

    seq, heads = (5, 0, 3), (2, 3, 1)
    fake = None
    if rank == 0:  # no peer calls anything: a collective here would hang
        with FakeTensorMode():
            y = op(torch.empty(2, 5, 6, D), 2, 1, seq_splits=seq, head_splits=heads)
            z = op(torch.empty(2, 8, 2, D), 1, 2, seq_splits=seq, head_splits=heads)
            fake = (tuple(y.shape), tuple(z.shape))
    target = torch.ops.fastvideo.ulysses_all_to_all_4d.default
    x = draw((2, seq[rank], 6, D), torch.float32, rank)
    kw = {"seq_splits": list(seq), "head_splits": list(heads)}
    # A forward's outcome carries its SEQ word, which every call advances: the AOT-dispatch checks (two runs
    # compared) take the backward's call, whose word is its forward's (tests/distributed/test_ulysses_compile.py).
    results = [torch.library.opcheck(target, (x.clone().requires_grad_(), 0, True, None, 0), kw,
                                     test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))]
    out, outcome = target(x, 0, False, None, 0, **kw)
    results.append(torch.library.opcheck(target, (torch.ones_like(out), 1, False, outcome, 0), kw))
    return fake, [sorted(set(r.values())) for r in results], tuple(out.shape)


def test_fake_impl_returns_uneven_shapes_and_opcheck_passes(ranks):
    """FakeTensorMode on rank 0 alone: [B, sum(seq), heads[0], D] and [B, seq[0], H, D], no collective. opcheck
    (schema, fake, autograd registration, AOT dispatch) on a forward's and a backward's call with tables."""
    results = ranks(3, _fake_and_opcheck, env={A2A: "auto"}, timeout_s=180)
    assert results[0][0] == ((2, 8, 2, D), (2, 5, 6, D))
    for rank, (_, checks, shape) in enumerate(results):
        assert checks == [["SUCCESS"]] * 2 and shape == (2, 8, (2, 3, 1)[rank], D)


# ------------------------------------------------------------------------------------- CUDA-graph capture


def _capture(rank, world):
    from tests.distributed.test_ulysses_graphs import Counters, RecordingTransport, host_work

    seq, heads = (6, 2), (5, 3)
    h = build_helper(transport=RecordingTransport(), table=())
    counters = Counters(h)
    shapes = in_shapes(0, 2, seq, heads)
    x_static = draw(shapes[rank], torch.float32, rank)
    with forced_capture(h):
        xg = x_static.requires_grad_()
        y = a2a(h, xg, 0, seq_splits=seq, head_splits=heads)
        z = a2a(h, y, 1, seq_splits=seq, head_splits=heads)
        g_static = torch.zeros_like(z)
        (gx,) = torch.autograd.grad(z, xg, g_static)
    t = h.transport
    frozen = [(launch.geom.seq_splits, launch.geom.head_splits, launch.geom.mode) for launch in t.captured]
    at_capture = counters.votes
    exact, work = [], []
    for i in range(3):
        x_static.data.copy_(draw(shapes[rank], torch.float32, 10 + i + rank))
        g_static.copy_(draw(tuple(z.shape), torch.float32, 20 + i + rank))
        before = counters.snapshot()
        t.replay()
        work.append(host_work(before, counters.snapshot()))
        head_shard = expected(gather(x_static, shapes), 0, seq, heads, rank)
        exact.append(bit_equal(t.captured[0].out, head_shard) and bit_equal(z, x_static) and bit_equal(gx, g_static))
    h.destroy()
    return frozen, at_capture, exact, work, [r.captured for r in h.history]


def test_a_capture_freezes_the_tables(ranks):
    """Forced capture of an uneven forward and backward: 4 votes at capture, 4 launches each holding the tables;
    3 replays with fresh inputs do no host work and are exact against the reference."""
    for frozen, votes, exact, work, captured in ranks(2, _capture, timeout_s=90):
        # Forward mode 0, forward mode 1, then the backward of each in reverse: every launch with the tables.
        assert frozen == [((6, 2), (5, 3), mode) for mode in (0, 1, 0, 1)]
        assert votes == 4 and exact == [True] * 3 and work == [""] * 3 and captured == [True] * 4


# ------------------------------------------------------------------------------------- the NCCL route's sizes


def _split_sizes(rank, world):
    import torch.distributed as dist

    from fastvideo.distributed.all_to_all import nccl_route
    from fastvideo.distributed.parallel_state import get_sp_group

    seen = []
    real = dist.all_to_all_single

    def recording(out, inp, output_split_sizes=None, input_split_sizes=None, **kw):
        seen.append((output_split_sizes, input_split_sizes))
        return real(out, inp, output_split_sizes, input_split_sizes, **kw)

    dist.all_to_all_single = recording
    group = get_sp_group().device_group
    nccl_route(torch.zeros(1, 4, 4, 2), 0, group)  # even
    nccl_route(torch.zeros(1, (5, 3)[rank], 4, 2), 0, group, splits=Splits((5, 3), None))  # uneven rows only
    nccl_route(torch.zeros(2, 8, (1, 3)[rank], 2), 1, group, splits=Splits((5, 3), (1, 3)))
    return seen


def test_the_nccl_route_passes_split_sizes_only_where_shares_differ(ranks):
    """Even shares: no split sizes (all_to_all_single's even split); mode 0 with uneven rows and even heads:
    equal sends (None), uneven receives; both uneven: both lists. Sizes are bytes (float32: 4 per element)."""
    results = ranks(2, _split_sizes, env={A2A: "off"}, timeout_s=60)
    f32 = 4
    assert results[0] == [(None, None), ([5 * 2 * 2 * f32, 3 * 2 * 2 * f32], None),
                          ([2 * 5 * 1 * 2 * f32, 2 * 5 * 3 * 2 * f32], [2 * 5 * 1 * 2 * f32, 2 * 3 * 1 * 2 * f32])]
    assert results[1] == [(None, None), ([5 * 2 * 2 * f32, 3 * 2 * 2 * f32], None),
                          ([2 * 3 * 1 * 2 * f32, 2 * 3 * 3 * 2 * f32], [2 * 5 * 3 * 2 * f32, 2 * 3 * 3 * 2 * f32])]


# ------------------------------------------------------------------------------------- pure: layouts, digest, plans


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_layouts_match_concatenate_and_slice_for_every_table_kind(world):
    """``reference_all_to_all`` (the single-device oracle, built on the NCCL route's layouts) against plain
    concatenation and slicing, for even, uneven and zero shares, B 1 (blocks already end to end) and 3."""
    tables = [(4,) * world, tuple(range(world)), tuple(range(world, 0, -1))]
    for seq in tables:
        for heads in tables:
            if sum(seq) == 0 or sum(heads) == 0:
                continue
            splits = Splits(seq, heads)
            for b in (1, 3):
                for mode in (0, 1):
                    inputs = [draw(s, torch.float32, r) for r, s in enumerate(in_shapes(mode, b, seq, heads))]
                    outs = reference_all_to_all(inputs, mode, splits=splits)
                    for r, out in enumerate(outs):
                        assert bit_equal(out, expected(inputs, mode, seq, heads, r)), (seq, heads, b, mode, r)
                        assert tuple(out.shape) == output_shape(inputs[r].shape, mode, world, rank=r, splits=splits)


def test_pack_and_unpack_round_trip_on_every_branch():
    """``pack``'s three layouts (blocks already end to end, equal blocks, unequal blocks) give the same bytes as
    block-by-block flattening, and ``unpack`` inverts them, strided input included."""
    for shape, sizes in [((1, 1, 6, 2), (2, 4)), ((2, 3, 6, 2), (3, 3)), ((2, 3, 6, 2), (1, 0, 5))]:
        x = draw(shape, torch.float64, 1)
        naive = torch.cat([blk.reshape(-1) for blk in x.split(list(sizes), 2)])
        # A step in the last dim: with B = 1 such an x flattens to a 1-D view with a step (no backend sends one)
        stepped = torch.stack([x, x], dim=-1).select(-1, 0)
        if shape[0] == 1:
            assert stepped.reshape(-1).stride() == (2,)
        for layout in (x, x.transpose(0, 1).contiguous().transpose(0, 1), stepped):
            packed = pack(layout, 2, sizes)
            assert bit_equal(packed, naive) and packed.is_contiguous(), (shape, sizes, layout.stride())
        shapes = [tuple(blk.shape) for blk in x.split(list(sizes), 2)]
        assert bit_equal(unpack(naive, shapes, 2), x)


def test_splits_digest():
    """0 for even tables; else a non-zero 63-bit value that depends on both tables and their order."""
    assert contract.splits_digest((4, 4), (3, 3)) == 0
    digests = {contract.splits_digest(s, h) for s, h in [((5, 3), (3, 3)), ((3, 5), (3, 3)), ((4, 4), (2, 4)),
                                                          ((3, 3), (5, 3)), ((5, 3), (4, 2)), ((0, 8), (3, 3))]}
    assert len(digests) == 6 and all(0 < d < 1 << 63 for d in digests)
    assert contract.splits_digest((5, 3), (3, 3)) == contract.splits_digest([5, 3], [3, 3])  # deterministic


def _planner(uneven: bool = True, world: int = 2):
    from fastvideo.distributed.ulysses.planner import PlanConfig, Planner
    from fastvideo.distributed.ulysses.transport import ENTRY_ORIGINAL, ENTRY_TUNED

    entries = {ENTRY_ORIGINAL, ENTRY_TUNED} | ({ENTRY_UNEVEN} if uneven else set())
    cfg = PlanConfig(world, 1, "T100", 1 << 20, "auto", (), (), ("sm",), (torch.float32,), torch.device("cpu"),
                     None, None)
    return Planner(cfg, (), frozenset(entries))


def _sig(shape, splits=EVEN, mode=0):
    from fastvideo.distributed.ulysses.planner import Signature

    return Signature(torch.Size(shape), torch.float32, torch.device("cpu"), mode, Phase.FORWARD_NO_GRAD, None, False,
                     True, True, splits)


def test_the_digest_is_computed_once_per_signature_and_the_tables_are_in_its_key(monkeypatch):
    planner = _planner()
    calls = []
    real = contract.splits_digest
    monkeypatch.setattr(contract, "splits_digest", lambda s, h: calls.append((s, h)) or real(s, h))
    a, b = Splits((5, 3), None), Splits((3, 5), None)
    first = planner.propose(_sig((1, 5, 4, 2), a))
    assert planner.propose(_sig((1, 5, 4, 2), a)) is first and len(calls) == 1  # the cache: no digest per call
    other = planner.propose(_sig((1, 5, 4, 2), b))  # same shape on this rank, other tables: another key
    assert len(calls) == 2 and other.fields[Field.SPLITS] != first.fields[Field.SPLITS] != 0
    assert first.fields[Field.S] == 8 and first.geom.S == 5 and first.plan == Plan(ORIGINAL_CTAS, 1, 5, False)


def test_explicit_even_tables_propose_exactly_what_none_proposes():
    planner = _planner()
    none = planner.propose(_sig((2, 4, 6, 2)))
    explicit = planner.propose(_sig((2, 4, 6, 2), Splits((4, 4), (3, 3))))
    assert explicit.fields == none.fields and explicit.plan == none.plan and explicit.geom == none.geom
    assert none.fields[Field.SPLITS] == 0 and none.fields[Field.S] == 8


def test_a_transport_without_the_offering_declines_uneven_splits_never_errors():
    proposal = _planner(uneven=False).propose(_sig((1, 5, 4, 2), Splits((5, 3), None)))
    assert proposal.plan is None and proposal.error is None
    assert contract.reasons_from_bits(proposal.fields[Field.ELIGIBILITY]) == [DeclineReason.UNEVEN_SPLITS]
    assert proposal.fields[Field.SPLITS] != 0  # the tables are still voted: a mismatch still raises
    assert _planner(uneven=False).propose(_sig((1, 4, 4, 2))).plan is not None  # the even call runs


def test_geometry_sizes_by_the_largest_share_and_tuned_rows_keep_applying():
    """Mode-independent and the same on every rank: S the largest sequence share, H global, a row P x the largest
    head share; the tuned row keyed by (GPU, SP, dtype, global H, D) applies to uneven tables of those heads."""
    from fastvideo.distributed.ulysses.policy import choose_plan, lookup

    g0 = Geometry.from_input((1, 5, 40, 128), 0, 3, torch.bfloat16, seq_splits=(5, 4, 4), head_splits=(14, 13, 13))
    g1 = Geometry.from_input((1, 13, 13, 128), 1, 3, torch.bfloat16, seq_splits=(5, 4, 4), head_splits=(14, 13, 13))
    assert (g0.S, g0.H, g0.S_global, g0.uneven) == (5, 40, 13, True)
    assert g1 == Geometry(1, torch.bfloat16, 1, 5, 40, 128, 3, (5, 4, 4), (14, 13, 13))
    assert g0.row_bytes == 3 * 14 * 128 * 2 and g0.plane_bytes == 5 * g0.row_bytes
    even = Geometry.from_input((1, 4, 39, 128), 0, 3, torch.bfloat16, seq_splits=(4, 4, 4), head_splits=(13,) * 3)
    assert not even.uneven and even.row_bytes == 39 * 128 * 2 and even == Geometry.from_input(
        (1, 4, 39, 128), 0, 3, torch.bfloat16)
    row = TunedRow("H200", 3, torch.bfloat16, 40, 128, ctas=132, planes_per_chunk=1, row_chunks=2, source="test")
    assert lookup((row,), "NVIDIA H200", g0) is row
    plan = choose_plan(g0, gpu="H200", table=(row,)).plan
    assert plan == Plan(132, 1, 3, tuned=True) and plan.window_bytes(g0) == 3 * g0.row_bytes


def test_the_native_transport_offers_uneven_plans_where_its_build_does(monkeypatch):
    """``NativeTransport.capability()`` offers ``ENTRY_UNEVEN`` exactly where the build's probe does (ABI 5 and
    later: the launches pass the split tables), so the planner plans native uneven calls there; a build without it
    (ABI 4) never gets one (the control). A stand-in library and probe; the capability declines later for this
    machine's NCCL, after the offerings were read."""
    from pathlib import Path

    from fastvideo.distributed.ulysses.native import NativeTransport
    from fastvideo.distributed.ulysses.planner import PlanConfig, Planner

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "fastvideo-kernel"))
    import fastvideo_kernel

    class Lib:
        def fvk_nccl_build_version(self):
            return 22809

        def fvk_nccl_runtime_version(self, out):
            return 1  # fails: the capability declines here, after the offerings were read

    monkeypatch.setattr(fastvideo_kernel, "load", lambda: Lib())
    monkeypatch.setattr(fastvideo_kernel, "last_error", lambda lib: "stand-in")
    for abi in (5, 4):
        offered = fastvideo_kernel.OFFERINGS[abi]
        monkeypatch.setattr(fastvideo_kernel, "probe", lambda lib, o=offered, a=abi: fastvideo_kernel.Probe(a, o, ""))
        cap = NativeTransport().capability()
        assert (ENTRY_UNEVEN in cap.entry_points) == (abi >= 5) and {"original", "tuned"} <= cap.entry_points
        assert cap.decline is DeclineReason.NCCL_RUNTIME_MISMATCH
        planner = Planner(PlanConfig(2, 1, "T100", 1 << 20, "auto", (), (), ("sm",), (torch.float32,),
                                     torch.device("cpu"), None, None), (), cap.entry_points)
        proposal = planner.propose(_sig((1, 5, 4, 2), Splits((5, 3), (1, 3))))
        if abi >= 5:
            assert proposal.plan == Plan(ORIGINAL_CTAS, 1, 5, False) and proposal.fields[Field.ELIGIBILITY] == 0
        else:
            assert proposal.plan is None
            assert contract.reasons_from_bits(proposal.fields[Field.ELIGIBILITY]) == [DeclineReason.UNEVEN_SPLITS]
