"""Checked mode (``FASTVIDEO_ULYSSES_A2A_CHECKED=1`` or ``TORCH_DISTRIBUTED_DEBUG=DETAIL``): every call of the
public op votes its 12 fields on every route, so cross-rank caller mistakes raise on every rank.

Cross-rank caller mistakes (another dtype, B or S on one rank, B and S swapped, crossed modes, ``requires_grad``
on one rank only, a meta tensor), on two gloo ranks: without checked mode, the ``off`` route and a helper that
declined at construction never vote, and these mistakes gave silently wrong values, SIGABRT or hangs. Here each
one raises a clear error on every rank within 10 s, under ``off`` and ``auto`` (the test is marked ambient
on the route), and on the CPU fused route; after each mistake a matching call still runs bit-exact (no
rank was left inside a collective). The negative control runs the mistakes that do not hang with
checked mode off: no error anywhere, which is what the check is for. The exact calls of the recorded-call and
table-code tests also assert their route (``nccl_route_ran``: the NCCL route, recorded by the checked-off helper
under ``off`` and by the helper declined at construction under ``auto``); their negative control runs the same
calls through a helper on the CPU plan transport, where that assertion fails.
"""

from __future__ import annotations

import contextlib
import time

import pytest
import torch

from fastvideo import envs
from tests.distributed.conftest import bit_equal, build_helper, oracle, rank_input, recorded_calls

A2A, CHECKED, DEBUG = "FASTVIDEO_ULYSSES_A2A", "FASTVIDEO_ULYSSES_A2A_CHECKED", "TORCH_DISTRIBUTED_DEBUG"
CHECKED_ON = {CHECKED: "1", "FASTVIDEO_ULYSSES_A2A_VOTE_TIMEOUT_S": "20"}
SHAPE = (2, 4, 4, 8)  # [B, S_local, H, D]

# mistake -> (what rank 1 passes differently, the field every rank's ContractMismatchError names)
MISTAKES = {
    "dtype": "DTYPE",  # fp32 on rank 0, fp16 on rank 1
    "S": "S",
    "B": "B",
    "B<->S": "B",  # same element count, another shape
    "H<->D": "H",
    "mode": "MODE",  # (2, 1) on rank 0, (1, 2) on rank 1
    "requires_grad": "PHASE",  # would hang at backward: raises at the forward
    "meta": None,  # rank 1: ValueError (meta tensor); rank 0: PeerCallError
    "sparse": None,  # the same: a sparse tensor passes no check after the call is counted
}
CALLER_ERRORS = {"meta": "meta tensor", "sparse": "torch.sparse_coo tensor"}  # what rank 1's ValueError says
NO_HANG = ("B<->S", "H<->D", "mode")  # what the negative control can run with checked mode off


def _mistake_input(rank: int, mistake: str) -> tuple[torch.Tensor, tuple[int, int]]:
    shape, dtype, dims, grad, device = SHAPE, torch.float32, (2, 1), False, "cpu"
    if rank == 1:
        b, s, h, d = SHAPE
        shape = {"S": (b, s + 2, h, d), "B": (b + 1, s, h, d), "B<->S": (s, b, h, d), "H<->D": (b, s, d, h)}.get(
            mistake, SHAPE)
        dtype = torch.float16 if mistake == "dtype" else dtype
        dims = (1, 2) if mistake == "mode" else dims
        grad = mistake == "requires_grad"
        device = "meta" if mistake == "meta" else device
    x = rank_input(rank, shape, dtype, seed=3).to(device).requires_grad_(grad)
    return (x.to_sparse() if rank == 1 and mistake == "sparse" else x), dims


def _mistakes(rank, world_size, mistakes, fused):
    from fastvideo.distributed.communication_op import sequence_model_parallel_all_to_all_4D as a2a
    from fastvideo.distributed.ulysses import registry

    if fused:
        registry.install_default_helper(build_helper())
    seen = {}
    for mistake in mistakes:
        x, dims = _mistake_input(rank, mistake)
        start = time.monotonic()
        try:
            y = a2a(x, *dims)
            if y.requires_grad:
                y.sum().backward()
            got = ("ok", "", None)
        except Exception as exc:  # noqa: BLE001 - the test asserts on what came back
            field = getattr(exc, "field", None)
            got = (type(exc).__name__, str(exc), field.name if field is not None else None)
        elapsed = time.monotonic() - start
        # A matching call right after: bit-exact, so no rank was left a call ahead or inside a collective.
        ok = rank_input(rank, SHAPE, seed=4)
        seen[mistake] = (*got, elapsed, bit_equal(a2a(ok, 2, 1), oracle(ok, 0)))
    route = "fused" if fused else registry.current_default_helper() and "helper"
    checker = registry.current_checked_off_helper()
    return seen, route, checker.stats()["calls"] if checker is not None else 0


def _assert_every_rank_raised(results, mistakes):
    by_rank = [r[0] for r in results]
    for mistake in mistakes:
        rank0, rank1 = by_rank[0][mistake], by_rank[1][mistake]
        for *_, elapsed, after_ok in (rank0, rank1):
            assert elapsed < 10, (mistake, elapsed)
            assert after_ok, mistake
        if MISTAKES[mistake] is None:  # a caller error on rank 1, voted to rank 0
            text = CALLER_ERRORS[mistake]
            assert rank1[0] == "ValueError" and text in rank1[1], rank1
            assert rank0[0] == "PeerCallError" and "rank(s) [1]" in rank0[1]
            # The vote carries the peer's own exception: rank 0's error names it, type and message.
            assert "rank 1: ValueError: " in rank0[1] and text in rank0[1], rank0[1]
        else:
            for kind, message, field, _, _ in (rank0, rank1):
                assert (kind, field) == ("ContractMismatchError", MISTAKES[mistake]), (mistake, kind, message)
                assert "rank 0:" in message and "rank 1:" in message
            assert rank0[1] == rank1[1]  # the same message everywhere
    dtype = by_rank[0].get("dtype")
    if dtype is not None:
        assert "torch.float32" in dtype[1] and "torch.float16" in dtype[1]


@pytest.mark.ambient(A2A)
def test_checked_mode_raises_every_mistake_on_every_rank(ranks, ulysses_ambient):
    """Under the ambient route (off: the checked-off helper votes; auto on CPU: the helper declined at
    construction and votes anyway), each of those mistakes raises on both ranks within 10 s."""
    results = ranks(2, _mistakes, list(MISTAKES), False, env=CHECKED_ON, timeout_s=120)
    _assert_every_rank_raised(results, MISTAKES)
    if envs.registry()[A2A].parse(ulysses_ambient[A2A]) == "off":
        # One vote per call on the checked-off helper: each mistake and its matching call (no backward ran).
        assert [r[2] for r in results] == [2 * len(MISTAKES)] * 2
    else:
        assert [r[1] for r in results] == ["helper", "helper"]


def test_checked_mode_on_the_fused_route(ranks):
    """auto with a fused (CPU plan) transport: the same mistakes raise the same way."""
    results = ranks(2, _mistakes, list(MISTAKES), True, env={**CHECKED_ON, A2A: "auto"}, timeout_s=120)
    _assert_every_rank_raised(results, MISTAKES)


def test_torch_distributed_debug_detail_turns_checked_mode_on(ranks):
    """torch's own switch (CHECKED left at auto) turns it on; CHECKED=0 turns it off again (the control: the
    same-size mistakes then pass silently)."""
    detail = {DEBUG: "DETAIL", CHECKED: None, A2A: "off", "FASTVIDEO_ULYSSES_A2A_VOTE_TIMEOUT_S": "20"}
    _assert_every_rank_raised(ranks(2, _mistakes, ["B<->S", "mode"], False, env=detail, timeout_s=120),
                              ["B<->S", "mode"])
    silent = ranks(2, _mistakes, ["B<->S", "mode"], False, env={**detail, CHECKED: "0"}, timeout_s=120)
    for seen, _, votes in silent:
        assert all(seen[m][0] == "ok" for m in ("B<->S", "mode")) and votes == 0


def _mistakes_where_group_timeouts_are_fixed(rank, world_size, mistakes, fused):
    """``_mistakes`` with ``ProcessGroup.set_timeout`` raising, as it does on torch 2.11 under
    TORCH_DISTRIBUTED_DEBUG=DETAIL ("Backend gloo does not support setting timeout"); returns how often the
    vote tried it, so the test knows the refusing path ran."""
    import torch.distributed as dist

    tried = []

    def refuse(self, timeout):
        tried.append(timeout)
        raise RuntimeError("Backend gloo does not support setting timeout")

    dist.ProcessGroup.set_timeout = refuse
    return (*_mistakes(rank, world_size, mistakes, fused), len(tried))


@pytest.mark.parametrize("fused", [False, True], ids=["off", "fused"])
def test_detail_checked_mode_where_the_vote_group_timeout_cannot_be_set(ranks, fused):
    """torch 2.11's DETAIL wrapper refuses set_timeout on the shared vote group: the vote falls back to a
    per-call timeout instead of crashing the helper's construction, so checked mode through torch's own switch
    still raises every mistake on every rank (the meta tensor on rank 1 included)."""
    detail = {DEBUG: "DETAIL", CHECKED: None, A2A: "auto" if fused else "off",
              "FASTVIDEO_ULYSSES_A2A_VOTE_TIMEOUT_S": "20"}
    mistakes = ["B<->S", "mode", "meta"]
    results = ranks(2, _mistakes_where_group_timeouts_are_fixed, mistakes, fused, env=detail, timeout_s=120)
    _assert_every_rank_raised(results, mistakes)
    assert all(r[3] >= 1 for r in results)  # the refusing set_timeout was reached on every rank


@pytest.mark.ambient(A2A)
def test_negative_control_without_checked_mode_the_same_size_mistakes_pass_silently(ranks):
    """Checked mode off: B and S swapped, H and D swapped, or the modes crossed move the same byte count, and
    nothing notices on either route (wrong results, no error): what checked mode exists to catch."""
    results = ranks(2, _mistakes, list(NO_HANG), False, env={CHECKED: "0"}, timeout_s=120)
    for seen, _, votes in results:
        assert all(seen[m][0] == "ok" and seen[m][4] for m in NO_HANG), seen
        assert votes == 0


# ------------------------------------------------------------------------ caller errors of a recorded call

# mistake -> what rank 1 passes instead (rank 0 passes a valid call); each must be caught before the dispatcher,
# whose schema parse would raise it on rank 1 alone and leave rank 0 in the vote until its timeout
RECORDED_MISTAKES = {
    "float table": {"seq_splits": [4.0, 4.0]},
    "tensor table": {"seq_splits": torch.tensor([4, 4])},
    "int tag": {"tag": 5},
    "not a tensor": {"x": "numpy"},
}


def _recorded_mistakes(rank, world_size, async_op, fused=False, kind="autograd"):
    """Each of ``RECORDED_MISTAKES`` on rank 1, in a call through the op path: one autograd records (``kind``
    "autograd"; "parameter": on an ``nn.Parameter``, a tensor subclass), or ("dispatch-mode") one autograd does not
    record under a dispatch mode (``FlopCounterMode``, as a user counts a step's flops): what each rank raised, how
    long it took, whether a matching call right after is exact, and the route of that call (``recorded_calls``).
    ``fused`` (the route assertion's negative control): through a helper on the CPU plan transport."""
    from torch.utils.flop_counter import FlopCounterMode

    from fastvideo.distributed.communication_op import sequence_model_parallel_all_to_all_4D as a2a
    from fastvideo.distributed.ulysses import registry

    if fused:
        registry.install_default_helper(build_helper())
    under_mode = kind == "dispatch-mode"
    seen = {}
    for mistake, wrong in RECORDED_MISTAKES.items():
        x = rank_input(rank, SHAPE, seed=3, requires_grad=not under_mode)
        x = torch.nn.Parameter(x) if kind == "parameter" else x
        kw = {"seq_splits": [4, 4]} | (wrong if rank == 1 else {})
        if kw.pop("x", None) == "numpy":
            x = x.detach().numpy()
        start = time.monotonic()
        try:
            with FlopCounterMode(display=False) if under_mode else contextlib.nullcontext():
                y = a2a(x, 2, 1, async_op=async_op, **kw)
                y = y.wait() if async_op else y
            got = ("ok", "")
        except Exception as exc:  # noqa: BLE001 - the test asserts on what came back
            got = (type(exc).__name__, str(exc))
        ok = rank_input(rank, SHAPE, seed=4, requires_grad=not under_mode)
        counted = FlopCounterMode(display=False) if under_mode else contextlib.nullcontext()
        with recorded_calls() as ran, counted:
            exact = bit_equal(a2a(ok, 2, 1), oracle(ok, 0))
        seen[mistake] = (*got, time.monotonic() - start, exact, ran)
    return seen


def nccl_route_ran(route: str, calls: int) -> list:
    """What ``recorded_calls`` gives for ``calls`` calls that ran on the NCCL route in checked mode on CPU: under
    ``off`` the checked-off helper records each (``disabled``), under ``auto`` the default helper, declined at
    construction (no transport on CPU: ``transport_missing``)."""
    return [("nccl", "disabled" if route == "off" else "transport_missing")] * calls


@pytest.mark.parametrize("kind", ["autograd", "parameter", "dispatch-mode"])
@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("route", ["off", "auto"])
def test_caller_errors_of_a_recorded_call_are_voted_before_the_dispatcher(ranks, route, async_op, kind):
    """A call autograd records goes through the op (on a plain tensor or an ``nn.Parameter``), and so does one
    under a dispatch mode: a table of floats or a tensor, a tag that is no str, an input that is no tensor, on rank
    1 only, raise the validation's error there (naming the argument) and PeerCallError naming it on rank 0 within
    10 s, never the dispatcher's schema error and a vote timeout (or, at rank 1's next call, a silent pairing); a
    matching call right after is exact on both, and ran on the NCCL route (``nccl_route_ran``)."""
    rank0, rank1 = ranks(2, _recorded_mistakes, async_op, False, kind, env={**CHECKED_ON, A2A: route},
                         timeout_s=120)
    names = {"float table": "seq_splits[0]", "tensor table": "seq_splits", "int tag": "tag=5", "not a tensor": "x "}
    for mistake, name in names.items():
        assert rank1[mistake][0] in ("ValueError", "TypeError") and name in rank1[mistake][1], rank1[mistake]
        assert rank0[mistake][0] == "PeerCallError" and "rank(s) [1]" in rank0[mistake][1], rank0[mistake]
        assert all(r[mistake][2] < 10 and r[mistake][3] for r in (rank0, rank1)), (rank0[mistake], rank1[mistake])
        assert [r[mistake][4] for r in (rank0, rank1)] == [nccl_route_ran(route, 1)] * 2, (rank0, rank1)


def _dtypes_without_a_table_code(rank, world_size, dtypes, fused=False):
    """A call whose input is ``dtypes[rank]``: dtypes the DTYPE table lacks, of one element size (the exchange moves
    the same bytes): what each rank got and, where it ran, whether its output is the oracle's and its route
    (``recorded_calls``). ``fused`` (the route assertion's negative control): through a helper on the CPU plan
    transport."""
    from fastvideo.distributed.communication_op import sequence_model_parallel_all_to_all_4D as a2a
    from fastvideo.distributed.ulysses import registry

    if fused:
        registry.install_default_helper(build_helper())
    x = (rank_input(rank, SHAPE, seed=8) * 10).to(getattr(torch, dtypes[rank]))
    try:
        with recorded_calls() as ran:
            y = a2a(x, 2, 1)
    except Exception as exc:  # noqa: BLE001 - the test asserts on what came back
        field = getattr(exc, "field", None)
        return type(exc).__name__, field.name if field is not None else None
    return "ok", bit_equal(y.view(torch.uint8), oracle(x, 0).view(torch.uint8)), ran


@pytest.mark.parametrize("route", ["off", "auto"])
def test_dtypes_without_a_table_code_differ_in_the_vote(ranks, route):
    """complex64 on one rank and uint64 on the other (8 bytes each, no code in the DTYPE table) raise
    ContractMismatchError on DTYPE on both ranks; the control, complex64 on both, runs exact, on the NCCL route
    (``nccl_route_ran``)."""
    env = {**CHECKED_ON, A2A: route}
    got = ranks(2, _dtypes_without_a_table_code, ("complex64", "uint64"), env=env, timeout_s=60)
    assert got == [("ContractMismatchError", "DTYPE")] * 2, got
    got = ranks(2, _dtypes_without_a_table_code, ("complex64", "complex64"), env=env, timeout_s=60)
    assert got == [("ok", True, nccl_route_ran(route, 1))] * 2, got


def test_negative_control_the_route_assertions_fail_where_another_route_ran(ranks):
    """The same calls through a helper on the CPU plan transport (``auto``): the same errors, and exact results; but
    the matching calls after the mistakes ran fused and complex64 was declined per call (``dtype``: the transport
    moves no complex), so the route assertions above (``nccl_route_ran``) fail on them."""
    env = {**CHECKED_ON, A2A: "auto"}
    rank0, rank1 = ranks(2, _recorded_mistakes, False, True, env=env, timeout_s=120)
    for mistake in RECORDED_MISTAKES:
        assert rank0[mistake][0] == "PeerCallError" and rank1[mistake][0] in ("ValueError", "TypeError"), mistake
        for seen in (rank0[mistake], rank1[mistake]):
            assert seen[3] and seen[4] == [("fused", None)], seen
            assert seen[4] != nccl_route_ran("auto", 1)
    got = ranks(2, _dtypes_without_a_table_code, ("complex64", "complex64"), True, env=env, timeout_s=60)
    assert got == [("ok", True, [("nccl", "dtype")])] * 2, got
    assert got[0][2] != nccl_route_ran("auto", 1)


# ------------------------------------------------------------------------------------- one vote per call


def _checked_calls(rank, world_size):
    from fastvideo.distributed.communication_op import sequence_model_parallel_all_to_all_4D as a2a
    from fastvideo.distributed.ulysses import registry

    x = rank_input(rank, SHAPE, seed=5, requires_grad=True)
    y = a2a(x, 2, 1)
    z = a2a(y, 1, 2)
    (z * 3).sum().backward()
    checker = registry.current_checked_off_helper()
    return (bit_equal(y, oracle(x, 0)), bit_equal(z, x), bool(torch.all(x.grad == 3)), checker.stats()["calls"],
            len(checker.vote_seconds()), checker.stats()["declines"], [r.phase.name for r in checker.history])


def test_checked_off_route_votes_once_per_call_and_changes_no_result(ranks):
    """off + checked: 2 forwards and 2 backwards, 4 votes, the NCCL route's exact results; every call
    counted as the `disabled` route (not logged as a decline)."""
    for y_ok, z_ok, grad_ok, calls, votes, declines, phases in ranks(2, _checked_calls, env={**CHECKED_ON, A2A: "off"}):
        assert y_ok and z_ok and grad_ok
        assert calls == votes == 4 and declines == {"disabled": 4}
        assert phases == ["FORWARD_GRAD", "FORWARD_GRAD", "BACKWARD", "BACKWARD"]


# ------------------------------------------------------------------------------------- agreement of the mode


def _noop(rank, world_size):
    return "ran"


def _agreed_checked(rank, world_size):
    from fastvideo.distributed.parallel_state import get_sp_group

    return get_sp_group().settings[CHECKED], get_sp_group().settings.differing


def test_checked_mode_is_agreed_across_ranks_and_on_where_they_differ(ranks):
    """It changes which collectives a rank runs, so it is agreed like the route: 1 on one rank and 0 (or auto
    without DETAIL) on the other agree on checked mode on, on every rank, at initialisation (its conservative
    value: ranks that already disagree get every call checked)."""
    for other in ("0", "auto"):
        results = ranks(2, _agreed_checked, env={A2A: "off"}, rank_env={0: {CHECKED: "1"}, 1: {CHECKED: other}},
                        timeout_s=30)
        assert results == [(True, (CHECKED,))] * 2
    assert ranks(2, _agreed_checked, env={A2A: "off", CHECKED: "0"}, timeout_s=30) == [(False, ())] * 2


def test_effective_value_is_what_is_agreed(monkeypatch):
    """Pure: `1`, and `auto` at torch's DETAIL level, agree (both on); `0` beats DETAIL; `auto` follows torch's
    level (what torch read from TORCH_DISTRIBUTED_DEBUG), not a later change of the variable."""
    import torch.distributed as dist

    from fastvideo.distributed import settings

    level = dist.get_debug_level()
    cases = [("1", "OFF", True), ("auto", "DETAIL", True), ("0", "DETAIL", False), ("auto", "INFO", False),
             ("auto", "OFF", False)]
    reports = []
    try:
        for value, torch_level, expected in cases:
            monkeypatch.setenv(CHECKED, value)
            dist.set_debug_level(getattr(dist.DebugLevel, torch_level))
            assert settings.checked_mode() is expected, (value, torch_level)
            reports.append(settings.local_report())
        dist.set_debug_level(dist.DebugLevel.OFF)
        monkeypatch.setenv(DEBUG, "DETAIL")  # torch does not re-read it, and neither does the checked mode
        assert settings.checked_mode() is False
    finally:
        dist.set_debug_level(level)
    on = [r for r, (_, _, expected) in zip(reports, cases) if expected]
    assert settings.decide(on, [0, 1], 0, "test")[CHECKED] is True
    differing = settings.decide([reports[0], reports[2]], [0, 1], 0, "test")
    assert (differing[CHECKED], differing.differing) == (True, (CHECKED,))
    monkeypatch.setenv(CHECKED, "2")
    with pytest.raises(ValueError, match=f"{CHECKED}='2' is not valid"):
        settings.checked_mode()
