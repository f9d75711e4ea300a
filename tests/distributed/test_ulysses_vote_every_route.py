"""Under ``auto`` every call votes on every route: a helper that declined at construction (no transport on CPU,
ranks on several hosts) votes each call before it takes the NCCL route, so ranks that disagree raise on every rank.

The rank-disagreement battery, on gloo ranks at P = 2 and 3, the last rank the odd one out: another dtype, another
S, B and S swapped, crossed modes, a backward on one rank while its peers make a forward call, an invalid call on one
rank (heads not divisible), a skipped tagged call, and a skipped untagged call whose next call has the other mode.

* ``auto`` (checked mode at its default, on): every case raises a clear error on every rank within the vote timeout
  (``ContractMismatchError`` naming the field, the same message everywhere; the invalid call: its own ValueError on
  its rank and ``PeerCallError`` naming that rank and its error on the others), and a matching call right after is
  bit-exact (no rank was left inside a collective or a call ahead). The helper is asserted declined
  (``transport_missing``) and voting over the expected channel: gloo on one host without the kernel library, the
  shared-memory vote with it, gloo for ranks on several hosts (faked host identities).
* The negative controls, each case on its own ranks (they may leave ranks out of step): ``auto`` with
  ``FASTVIDEO_ULYSSES_A2A_CHECKED=0`` and ``off`` (upstream's behaviour) never vote, and no case raises a clear error
  on every rank: a rank returns wrong data silently, raises alone, hangs or is aborted by gloo.

Timings are not asserted beyond the vote timeout bound (the cost is measured by ``benchmarks``, ``route_vote``).
"""

from __future__ import annotations

import time

import pytest

from tests.distributed import mp
from tests.distributed.conftest import SHM_VOTE_ENV, SHM_VOTE_SKIP, bit_equal, oracle, rank_input

A2A, CHECKED = "FASTVIDEO_ULYSSES_A2A", "FASTVIDEO_ULYSSES_A2A_CHECKED"
VOTE_TIMEOUT_S = 10.0
ENV = {A2A: "auto", CHECKED: None, "FASTVIDEO_ULYSSES_A2A_VOTE_TIMEOUT_S": str(VOTE_TIMEOUT_S),
       "FASTVIDEO_KERNEL_LIBRARY": "/nonexistent/no-kernel-library.so"}  # the default helper: no library
SHAPE = (2, 6, 6, 4)  # [B, S_local, H, D]: S_local and H divisible by 2 and 3, so both modes are valid inputs
# case -> (what the odd rank's error names, what its peers' errors name): a field, or the invalid call's errors.
CASES = {
    "dtype": "DTYPE",
    "S": "S",
    "B<->S": "B",
    "mode": "MODE",
    "backward": "PHASE",  # a backward on one rank meets its peers' forward of the same mode and shape
    "invalid": None,  # the odd rank: ValueError; its peers: PeerCallError naming it
    "skip": "SEQ",  # tagged calls: the odd rank skips blocks.0 (and makes one call more at the end)
    "skip-untagged": "MODE",  # the odd rank skips the qkv call (mode 0): its out call (mode 1) meets the peers' qkv
}
CLEAN = ("ContractMismatchError", "PeerCallError")


def _case(rank: int, world: int, case: str, a2a) -> tuple:
    """One case of the battery through the public op; (error type, message, field) of its first call, or ok."""
    odd = rank == world - 1
    b, s, h, d = SHAPE
    x = rank_input(rank, SHAPE, seed=3)
    try:
        if case == "dtype":
            a2a(x.half() if odd else x, 2, 1)
        elif case == "S":
            a2a(rank_input(rank, (b, s + world, h, d), seed=3) if odd else x, 2, 1)
        elif case == "B<->S":
            a2a(rank_input(rank, (s, b, h, d), seed=3) if odd else x, 2, 1)
        elif case == "mode":
            a2a(x, *((1, 2) if odd else (2, 1)))
        elif case == "backward":
            y = a2a(x.requires_grad_(), 2, 1)
            if odd:
                y.sum().backward()  # the backward's call: mode 1, phase BACKWARD
            else:
                a2a(y.detach(), 1, 2)  # a forward of the same mode and shape
        elif case == "invalid":
            a2a(rank_input(rank, (b, s, h - 1, d), seed=3) if odd else x, 2, 1)  # heads not divisible by P
        elif case == "skip":
            tags = ["blocks.1.attn.qkv", "blocks.2.attn.qkv"] if odd else ["blocks.0.attn.qkv", "blocks.1.attn.qkv"]
            first = _catch(a2a, x, 2, 1, tag=tags[0])
            _catch(a2a, x, 2, 1, tag=tags[1])  # the calls stay paired: as many on every rank
            return first
        elif case == "skip-untagged":
            y = rank_input(rank, (b, s * world, h // world, d), seed=4)  # an out call's input (mode 1)
            calls = [(y, 1, 2), (x, 2, 1)] if odd else [(x, 2, 1), (y, 1, 2)]
            first = _catch(a2a, *calls[0])
            _catch(a2a, *calls[1])
            return first
        else:
            raise AssertionError(case)
    except Exception as exc:  # noqa: BLE001 - the test asserts on what came back
        return _described(exc)
    return ("ok", "", None)


def _catch(fn, *args, **kw) -> tuple:
    try:
        fn(*args, **kw)
    except Exception as exc:  # noqa: BLE001 - the test asserts on what came back
        return _described(exc)
    return ("ok", "", None)


def _described(exc: BaseException) -> tuple:
    field = getattr(exc, "field", None)
    return (type(exc).__name__, str(exc), field.name if field is not None else None)


def _battery(rank: int, world: int, cases: list[str], hosts: str, check_after: bool):
    """Each case, timed, then (``check_after``) a matching call checked against the NCCL route; and the route's
    helper as it stands: (declined reason, vote channel, votes, calls)."""
    from fastvideo.distributed.communication_op import sequence_model_parallel_all_to_all_4D as a2a
    from fastvideo.distributed.parallel_state import get_sp_group
    from fastvideo.distributed.ulysses import registry

    if hosts == "several":  # the stand-in for ranks on several hosts: each rank names a host of its own
        from fastvideo.distributed.ulysses.helper import UlyssesHelper

        registry.install_default_helper(UlyssesHelper(get_sp_group(), identity=lambda: (f"host{rank}", "boot")))
    # One grad-tracked call and its backward on every rank first: the op's first use through the dispatcher and
    # autograd costs seconds on a loaded machine, which the cases' time bound is not about.
    warm = rank_input(rank, SHAPE, seed=1, requires_grad=True)
    a2a(warm, 2, 1).sum().backward()
    seen = {}
    for case in cases:
        start = time.monotonic()
        got = _case(rank, world, case, a2a)
        elapsed = time.monotonic() - start
        after = None
        if check_after:
            ok = rank_input(rank, SHAPE, seed=9)
            after = bit_equal(a2a(ok, 2, 1), oracle(ok, 0))
        seen[case] = (*got, elapsed, after)
    helper = registry.current_default_helper() or registry.current_checked_off_helper()
    if helper is None:
        return seen, None
    reason = helper.construction_reason.label if helper.construction_reason is not None else None
    return seen, (reason, helper.stats()["vote"], len(helper.vote_seconds()), helper.stats()["calls"],
                  helper.history[-1].route if helper.history else None)


def _assert_every_rank_raised(results: list, cases: list[str], world: int) -> None:
    odd = world - 1
    for case in cases:
        got = [seen[case] for seen, _ in results]
        for *_, elapsed, after in got:
            assert elapsed < VOTE_TIMEOUT_S, (case, elapsed)
            assert after, (case, "a matching call after the case was not exact")
        if CASES[case] is None:  # the invalid call: its own error on its rank, named on every other
            assert got[odd][0] == "ValueError" and "divisible" in got[odd][1], got[odd]
            for r in range(odd):
                assert got[r][0] == "PeerCallError", (case, got[r])
                assert f"rank(s) [{odd}]" in got[r][1] and f"rank {odd}: ValueError" in got[r][1], got[r][1]
                assert "divisible" in got[r][1]
        else:
            for kind, message, field, *_ in got:
                assert (kind, field) == ("ContractMismatchError", CASES[case]), (case, kind, message)
                assert f"rank {odd}:" in message
            assert len({g[1] for g in got}) == 1, case  # the same message on every rank


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("channel", [
    "gloo",
    pytest.param("shm", marks=pytest.mark.skipif(SHM_VOTE_SKIP is not None, reason=SHM_VOTE_SKIP or "")),
    "several-hosts",
])
def test_auto_declined_helper_raises_every_disagreement_on_every_rank(ranks, world, channel):
    """auto, checked mode at its default: the default helper declined at construction votes every call, over the
    vote group (gloo) or shared memory, and every case raises on every rank within the vote timeout."""
    env = {**ENV, **(SHM_VOTE_ENV if channel == "shm" else {})}
    results = ranks(world, _battery, list(CASES), "several" if channel == "several-hosts" else "one", True,
                    env=env, timeout_s=120)
    _assert_every_rank_raised(results, list(CASES), world)
    # The warm-up's 2 calls, 8 cases (10 calls: two for each skip) + the forward of the backward case + 8 matching
    # calls, every one voted (the backward's call and the peers' second call of that case are the one raised call)
    for _, (reason, vote, votes, calls, route) in results:
        assert reason == "transport_missing" and route == "nccl"
        assert vote == ("shm" if channel == "shm" else "gloo")
        assert votes == calls == 21, (votes, calls)


# Cases that leave every rank in step without the vote (as many calls of the same byte count on every rank): run
# together. The others (gloo aborts a rank on sizes that differ, a rank raises alone, a backward on one rank of
# three hangs) each run alone.
IN_STEP = ("B<->S", "mode", "skip", "skip-untagged")


def _negative(world: int, cases: list[str], env: dict) -> dict[str, str]:
    """Run ``cases`` on fresh ranks with the vote off; per case how it ended: "clean" only when every rank raised a
    clear error (what the vote gives), else what happened instead."""
    try:
        results = mp.run_ranks(world, _battery, cases, "one", False, env=env, timeout_s=10)
    except mp.RankError as exc:  # some rank raised outside the cases (a collective after them)
        return dict.fromkeys(cases, f"ranks {sorted(exc.errors)} failed outside the case")
    except TimeoutError as exc:  # a rank hung (waiting for a peer that raised alone, or out of step)
        assert "did not finish" in str(exc), exc
        return dict.fromkeys(cases, f"hung: {str(exc)[:160]}")
    except RuntimeError as exc:  # a rank died (gloo's SIGABRT on mismatched sizes)
        assert "died" in str(exc), exc
        return dict.fromkeys(cases, f"died: {exc}")
    for _, helper in results:
        assert helper is None or helper[2] == 0, helper  # no vote ran
    outcomes = {}
    for case in cases:
        kinds = [seen[case][0] for seen, _ in results]
        clean = all(k in CLEAN for k in kinds[:-1]) and kinds[-1] in (*CLEAN, "ValueError")
        outcomes[case] = "clean" if clean else f"not clean: {kinds}"
    return outcomes


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("setting", ["auto-checked-0", "off"])
def test_negative_control_without_the_vote_no_case_raises_on_every_rank(world, setting, ulysses_ambient):
    """The same cases with the vote off (auto with FASTVIDEO_ULYSSES_A2A_CHECKED=0, and off as upstream): no vote
    runs and none of them raises a clear error on every rank: the same-size cases return (wrong data) on every
    rank, the others abort a rank, hang or raise on one rank alone."""
    env = {**ENV, CHECKED: "0"} if setting == "auto-checked-0" else {**ENV, A2A: "off"}
    outcomes = _negative(world, list(IN_STEP), env)
    assert all(o.startswith("not clean") and "ok" in o for o in outcomes.values()), outcomes  # silent, in step
    for case in CASES:
        if case not in IN_STEP:
            outcomes.update(_negative(world, [case], env))
    assert set(outcomes) == set(CASES)
    assert all(o != "clean" for o in outcomes.values()), outcomes


def _invalid_on_the_helper(rank: int, world: int):
    """The helper's own entry points vote a caller error too (the helper votes every call)."""
    from tests.distributed.conftest import build_helper

    h = build_helper(vote="gloo")
    x = rank_input(rank, (2, 6, 5 if rank == world - 1 else 6, 4))
    got = _catch(h.all_to_all, x, 0)
    ok = rank_input(rank, SHAPE, seed=2)
    exact = bit_equal(h.all_to_all(ok, 0), oracle(ok, 0))
    h.destroy()
    return got, exact


def test_an_invalid_call_on_the_helper_raises_on_every_rank(ranks):
    """``UlyssesHelper.all_to_all`` with heads that P does not divide on one rank: ValueError there, PeerCallError
    naming it on the others; the next call runs exact."""
    results = ranks(3, _invalid_on_the_helper, env=ENV, timeout_s=60)
    assert results[2][0][0] == "ValueError"
    for got, _ in results[:2]:
        assert got[0] == "PeerCallError" and "rank 2: ValueError" in got[1], got
    assert all(exact for _, exact in results)


def test_effective_checked_mode_follows_the_route(monkeypatch):
    """Pure: unset/auto is on under the auto route and off under off (unless torch's DETAIL level); 0 and 1 are
    what they say under both; a rank with 0 and one at the default under auto differ, and agree on on."""
    from fastvideo.distributed import settings

    for route, value, expected in [("auto", "auto", True), ("off", "auto", False), ("auto", "0", False),
                                   ("off", "1", True), ("auto", "1", True), ("off", "0", False)]:
        assert settings.checked_mode(value, route) is expected, (route, value)
    monkeypatch.setenv(A2A, "auto")
    monkeypatch.delenv(CHECKED, raising=False)
    default = settings.local_report()
    assert default.values[CHECKED] is True
    monkeypatch.setenv(CHECKED, "0")
    agreed = settings.decide([default, settings.local_report()], [0, 1], 0, "test")
    assert (agreed[CHECKED], agreed.differing) == (True, (CHECKED,))
