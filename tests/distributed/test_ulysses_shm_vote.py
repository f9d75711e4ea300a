"""The same-host shared-memory vote (``ShmVote``, ``csrc/ulysses_a2a/shm_vote.cpp``) on gloo ranks.

Needs a built kernel library: the product ``build/kernel/libfastvideo_ulysses_a2a.so`` (``scripts/build_kernel.sh``;
``FASTVIDEO_KERNEL_TEST_BUILD`` overrides), the same discovery as ``tests/kernel/test_kernel_host.py``.
Skips, saying why, when it is absent, cannot be loaded here, or predates the vote. The ranks load it
through ``FASTVIDEO_KERNEL_LIBRARY``, as the helper does in production.
"""

from __future__ import annotations

import ctypes
import os

import pytest

from tests.distributed.conftest import (
    BUILT_LIBRARY,
    READS_LONG_TRAINING,
    SHM_VOTE_ENV,
    SHM_VOTE_SKIP,
    a2a,
    bit_equal,
    build_helper,
    catch,
    forced_capture,
    last,
    oracle,
    rank_input,
)

SKIP = SHM_VOTE_SKIP
pytestmark = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")
ENV = SHM_VOTE_ENV
SHAPE = (3, 16, 12, 8)


def _fields(rank: int, call: int) -> list[int]:
    return [rank * 1_000_003 + call * 7 + i - (1 << 40) * (i % 3) for i in range(12)]


# ------------------------------------------------------------------------------------- raw exchange


def _exchange_rounds(rank, world_size, rounds):
    from fastvideo.distributed.parallel_state import get_sp_group
    from fastvideo.distributed.ulysses.vote import GlooVote, ShmVote, load_vote_library

    gloo = GlooVote(get_sp_group().ranks, timeout_s=30.0)
    lib = load_vote_library()
    names: list[str] = []  # this job's segment: other jobs on the host (pytest -n, CI neighbours) have theirs
    real_open = lib.fvk_vote_open

    def recording_open(name, *args):
        names.append(name.decode())
        return real_open(name, *args)

    lib.fvk_vote_open = recording_open
    vote, why = ShmVote.create(gloo, get_sp_group().rank_in_group, lib)
    assert vote is not None, why
    bad = []
    first_ptr = None
    for call in range(rounds):
        rows = vote.exchange(_fields(rank, call))
        first_ptr = first_ptr or rows.data_ptr()
        got = rows.tolist()
        want = [_fields(r, call) for r in range(world_size)]
        if got != want or rows.data_ptr() != first_ptr:
            bad.append((call, got))
    vote.destroy()
    vote.destroy()  # idempotent
    leftover = [n for n in names if os.path.exists(f"/dev/shm{n}")]
    assert names and names[0].startswith("/fastvideo-vote-"), names
    return bad[:3], leftover


def test_native_row_keeps_one_send_row_per_proposal_and_writes_only_its_seq():
    """``ShmVote.native_row``: each distinct proposal's fields get their own row, reused by every later call of that
    proposal with only SEQ rewritten; another proposal's row is untouched by it. Local, no library call."""
    from fastvideo.distributed.ulysses.contract import with_seq
    from fastvideo.distributed.ulysses.vote import ShmVote

    vote = ShmVote(type("Lib", (), {"fvk_vote_exchange": None})(), ctypes.c_void_p(0x10), [0, 1], 5.0)
    a, b = tuple(range(12)), tuple(range(100, 112))

    def row(address: int) -> list[int]:
        return list((ctypes.c_int64 * 12).from_address(address))

    ra, rb = vote.native_row(a, 7), vote.native_row(b, 8)
    assert ra != rb and row(ra) == with_seq(a, 7) and row(rb) == with_seq(b, 8)
    assert vote.native_row(a, 9) == ra and row(ra) == with_seq(a, 9) and row(rb) == with_seq(b, 8)
    assert vote.native_channel() == (vote._args[0], vote._args[2], vote._args[3])
    vote._handle = None  # a destroyed vote refuses both, as exchange does
    with pytest.raises(Exception, match="destroyed"):
        vote.native_row(a, 10)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_every_rank_sees_every_peers_exact_fields_every_round(ranks, world_size):
    """1500 rounds of rank- and round-dependent fields (double buffering wraps 750 times): every rank sees
    every rank's exact fields in the reused buffer, and the segment's name was unlinked at construction."""
    for bad, leftover in ranks(world_size, _exchange_rounds, 1500, env=ENV, timeout_s=120):
        assert bad == []
        assert leftover == []


# ------------------------------------------------------------------------------------- through the helper


def voted_transport():
    """The CPU plan transport with the voted launch the native transport has (the voted form of ``fvk_launch``): the
    exchange over the vote's native arguments and the library's own verdict (``fvk_vote_would_run``), then
    the CPU plan's data movement where it says run. Counts voted calls and launches, so a test can assert
    which path ran. It fuses the vote only over the shared-memory vote, as the native one does."""
    import time

    from fastvideo.distributed.ulysses.contract import with_seq
    from fastvideo.distributed.ulysses.transport import VoteNotStarted
    from tests.plan_transport import GlooPlanTransport

    class VotedGlooTransport(GlooPlanTransport):
        name = "gloo-voted"

        def __init__(self) -> None:
            super().__init__()
            self.voted = self.launched = 0
            self.fail_before = self.fail_after = False  # fault injection: before the exchange, after it

        def fuses_vote(self, vote) -> bool:
            return hasattr(vote, "native_row")

        def execute(self, x, geom, plan, *, capture=False, vote=None, fields=(), seq=0):
            if vote is None:
                return super().execute(x, geom, plan, capture=capture)
            self.voted += 1
            if self.fail_before:
                raise VoteNotStarted("before the vote: injected")
            lib = vote._lib
            handle, recv, timeout = vote.native_channel()
            send = ctypes.c_void_p(vote.native_row(fields, seq))
            start = time.perf_counter()
            status = lib.fvk_vote_exchange(handle, send, recv, timeout)
            vote.last_s = time.perf_counter() - start
            if status != 0:
                raise vote.failure(status)
            rows = vote.rows
            votes = ctypes.cast(rows.data_ptr(), ctypes.POINTER(ctypes.c_int64))
            if not lib.fvk_vote_would_run(votes, rows.shape[0], (ctypes.c_int64 * 12)(*with_seq(fields, seq))):
                return None
            self.launched += 1
            if self.fail_after:
                raise RuntimeError("injected launch failure after the vote")
            return GlooPlanTransport.execute(self, x, geom, plan)

    return VotedGlooTransport()


TRANSPORTS = ["plain", "voted"]


def _transport(kind: str):
    return voted_transport() if kind == "voted" else None


def _helper_fused(rank, world_size, vote, kind="plain"):
    t = _transport(kind)
    h = build_helper(vote=vote, transport=t)
    results = []
    for seed in range(5):
        x = rank_input(rank, SHAPE, seed=seed)
        results.append((bit_equal(a2a(h, x, 0), oracle(x, 0)), last(h)[0]))
    stats = h.stats()
    h.destroy()
    return results, stats["vote"], stats["fused"], (t.voted, t.launched) if t is not None else None


@pytest.mark.parametrize("kind", TRANSPORTS)
@pytest.mark.parametrize("vote", ["shm", "auto"])
@READS_LONG_TRAINING
def test_helper_runs_fused_calls_bit_exact_over_the_shm_vote(ranks, vote, kind):
    """Both paths, the helper's verdict and the voted launch, run the same fused calls exactly; the voted
    transport shows its path ran (5 voted calls, 5 launches)."""
    for results, channel, fused, voted in ranks(2, _helper_fused, vote, kind, env=ENV, timeout_s=60):
        assert results == [(True, "fused")] * 5
        assert (channel, fused) == ("shm", 5)
        assert voted == ((5, 5) if kind == "voted" else None)


@READS_LONG_TRAINING
def test_the_voted_launch_is_not_taken_over_the_gloo_vote(ranks):
    for results, channel, _, voted in ranks(2, _helper_fused, "gloo", "voted", env=ENV, timeout_s=60):
        assert results == [(True, "fused")] * 5 and channel == "gloo" and voted == (0, 0)


@pytest.mark.parametrize(("switch", "expected"), [
    pytest.param({0: "0", 1: "0"}, [(0, 0), (0, 0)], id="off-everywhere"),
    pytest.param({0: "0", 1: "1"}, [(0, 0), (5, 5)], id="off-on-one-rank"),
])
@READS_LONG_TRAINING
def test_the_voted_launch_switch_is_rank_local(ranks, switch, expected):
    """FASTVIDEO_ULYSSES_A2A_VOTED_LAUNCH=0 takes the plain path; ranks may differ, because both paths are the
    same exchange and verdict: every call still runs fused and exact on every rank."""
    rank_env = {r: {"FASTVIDEO_ULYSSES_A2A_VOTED_LAUNCH": v} for r, v in switch.items()}
    results = ranks(2, _helper_fused, "shm", "voted", env=ENV, rank_env=rank_env, timeout_s=60)
    for results_, channel, fused, _ in results:
        assert results_ == [(True, "fused")] * 5 and (channel, fused) == ("shm", 5)
    assert [r[3] for r in results] == expected


def _voted_faults(rank, world_size, scenario):
    import torch

    t = voted_transport()
    h = build_helper(vote="shm", transport=t)
    x = rank_input(rank, SHAPE, seed=4)
    if scenario == "capture":  # a capture never takes the voted launch (this transport cannot capture: decline)
        with forced_capture(h), torch.no_grad():
            y = a2a(h, x, 0)
        result = (bit_equal(y, oracle(x, 0)), last(h)[0], last(h)[2], t.voted)
    else:
        if rank == 0:
            t.fail_before, t.fail_after = scenario == "before", scenario == "after"
        cause = None
        try:
            a2a(h, x, 0)
            got = ("ok", "")
        except Exception as exc:  # noqa: BLE001 - the test asserts on what came back
            got, cause = (type(exc).__name__, str(exc)), type(exc.__cause__).__name__ if exc.__cause__ else None
        later = catch(a2a, h, x, 0) if scenario == "after" and rank == 0 else None
        result = (got[0], got[1], h.stats()["disposed"], later[0] if later else None, cause)
    if not h.stats()["disposed"]:
        h.destroy()
    return result


@READS_LONG_TRAINING
def test_a_capture_never_takes_the_voted_launch(ranks):
    for exact, route, reason, voted in ranks(2, _voted_faults, "capture", env=ENV, timeout_s=60):
        assert (exact, route, reason, voted) == (True, "nccl", "cuda_graph_capture", 0)


def test_a_failure_before_the_voted_exchange_is_voted_so_every_rank_raises(ranks):
    """Rank 0 fails before it exchanged (VoteNotStarted): it votes the failure on the plain path, so rank 1,
    inside the voted exchange, raises PeerCallError at once instead of timing out; neither disposes."""
    results = ranks(2, _voted_faults, "before", env=ENV, timeout_s=60)
    assert [(r[0], r[2]) for r in results] == [("PeerCallError", False)] * 2, results
    assert "rank 0" in results[1][1] or "[0]" in results[1][1], results[1][1]  # names the rank that failed
    assert results[0][4] == "VoteNotStarted"  # the failing rank's error chains its own cause


def test_a_launch_that_fails_after_the_voted_exchange_disposes_the_helper(ranks):
    """Rank 0's launch fails after every rank agreed to run the call: it disposes and refuses later calls. (Its
    peer, whose CPU-transport movement needs rank 0, fails in its own way; with the native transport it waits
    at the barrier until the watchdog ends it.)"""
    results = ranks(2, _voted_faults, "after", env=ENV, timeout_s=60)
    kind, message, disposed, later, _ = results[0]
    assert kind == "RuntimeError" and "injected" in message and disposed and later == "HelperDisposedError"


def _library_voted_launch(rank, world_size, case):
    """The voted form of fvk_launch itself on a real two-rank vote, without a GPU (a null context fails only at
    launch)."""
    from fastvideo.distributed.parallel_state import get_sp_group
    from fastvideo.distributed.ulysses.vote import GlooVote, ShmVote, load_vote_library

    lib = load_vote_library()
    vote, why = ShmVote.create(GlooVote(get_sp_group().ranks, timeout_s=30.0), rank, lib)
    assert vote is not None, why
    fields = _fields(0, 1)
    fields[2] = 0  # eligible
    if case == "decline" and rank == 1:
        fields[6] += 1  # another S on one rank: no rank may launch
    handle, recv, timeout = vote.native_channel()
    send = vote.native_row(tuple(fields), fields[1])  # fields[1] is SEQ: the row holds these fields as they are
    import fastvideo_kernel  # on sys.path: installed, or put there by tests/distributed/conftest.py

    k = fastvideo_kernel
    voted = k.Vote(size=ctypes.sizeof(k.Vote), stage=9, handle=handle.value, fields=send, votes=recv.value,
                   timeout_ns=timeout.value, vote_ns=-1)
    call = k.Call(size=ctypes.sizeof(k.Call), kind=7 if case == "bad_kind" else k.KIND_SM, mode=0, dtype=3, ctas=144,
                  B=1, S=8, H=8, D=8, planes_per_chunk=1, rows_per_chunk=8)
    status = lib.fvk_launch(None, ctypes.byref(call), None, None, None, ctypes.byref(voted))
    error = fastvideo_kernel.last_error(lib) if status else ""
    rows = vote.rows.tolist() if voted.stage >= k.STAGE_NOT_LAUNCHED else None
    vote.destroy()
    return status, voted.stage, voted.vote_ns, error, rows, fields


@pytest.mark.parametrize("case", ["run", "decline", "bad_kind"])
def test_the_library_voted_launch_decides_on_a_real_exchange(ranks, case):
    results = ranks(2, _library_voted_launch, case, env=ENV, timeout_s=60)
    fields = [r[5] for r in results]
    for status, stage, ns, error, rows, _ in results:
        if case == "run":  # the vote says run: the launch is reached (and fails on the null context)
            assert (stage, status) == (2, 1) and "null context" in error and ns > 0 and rows == fields
        elif case == "decline":  # exchanged, no launch on any rank, the gathered rows returned
            assert (stage, status, error) == (1, 0, "") and ns > 0 and rows == fields
        else:  # refused before the exchange: no rank voted, none waits
            assert (stage, ns) == (-1, 0) and status == 1 and "kind 7" in error and rows is None


def _decline_through_the_voted_launch(rank, world_size):
    t = voted_transport()
    h = build_helper(vote="shm", transport=t)
    x = rank_input(rank, SHAPE, seed=3)
    if rank == 0:  # this rank alone cannot take the fused route: non-contiguous input
        x = x.transpose(1, 2).contiguous().transpose(1, 2)
    y = a2a(h, x, 0)
    result = (bit_equal(y, oracle(x.contiguous(), 0)), last(h)[0], last(h)[2], t.voted, t.launched)
    h.destroy()
    return result


@READS_LONG_TRAINING
def test_a_rank_that_declines_makes_every_rank_decline_through_the_voted_launch(ranks):
    """Rank 0 proposes no plan (an eligibility bit), rank 1 proposes one through the voted launch: the library
    launches nowhere (rank 1's fields differ from rank 0's) and both ranks decline together in the verdict."""
    results = ranks(2, _decline_through_the_voted_launch, env=ENV, timeout_s=60)
    assert [r[:3] for r in results] == [(True, "nccl", "peer_disagreement")] * 2, results
    assert [r[3:] for r in results] == [(0, 0), (1, 0)]  # rank 1 voted through the library, launched nothing


@READS_LONG_TRAINING
def test_helper_vote_gloo_is_respected(ranks):
    for results, channel, _, _ in ranks(2, _helper_fused, "gloo", env=ENV, timeout_s=60):
        assert results == [(True, "fused")] * 5 and channel == "gloo"


def _mismatch(rank, world_size, kind="plain"):
    h = build_helper(vote="shm", transport=_transport(kind))
    shape = (3, 8, 12, 8) if rank == world_size - 1 else SHAPE
    got = catch(a2a, h, rank_input(rank, shape), 0)
    x = rank_input(rank, SHAPE, seed=1)
    after = (bit_equal(a2a(h, x, 0), oracle(x, 0)), last(h)[0])
    vote = h.stats()["vote"]
    h.destroy()
    return got, after, vote


@pytest.mark.parametrize("kind", TRANSPORTS)
@READS_LONG_TRAINING
def test_contract_mismatch_raises_on_every_rank_through_the_shm_vote(ranks, kind):
    results = ranks(3, _mismatch, kind, env=ENV, timeout_s=60)
    for (kind, message, field), after, vote in results:
        assert (kind, field, vote) == ("ContractMismatchError", "S", "shm") and "field S " in message
        assert after == (True, "fused")
    assert len({r[0][1] for r in results}) == 1


def _timeout(rank, world_size, kind="plain"):
    import time

    import torch.distributed as dist

    h = build_helper(vote="shm", vote_timeout_s=2.0, transport=_transport(kind))
    result = None
    if rank == 0:  # rank 1 never calls
        start = time.monotonic()
        first = catch(a2a, h, rank_input(rank, SHAPE), 0)
        waited = time.monotonic() - start
        later = catch(a2a, h, rank_input(rank, SHAPE), 0)
        result = (first[0], first[1], waited, later[0], h.stats()["disposed"], h.fused_available, h.stats()["vote"])
    dist.barrier()
    h.destroy()
    return result


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_shm_vote_timeout_raises_and_disposes_the_helper(ranks, transport):
    kind, message, waited, later, disposed, available, vote = ranks(2, _timeout, transport, env=ENV,
                                                                    timeout_s=60)[0]
    assert kind == "VoteTimeoutError" and "(shared memory) timed out (the vote timeout, 2 s" in message, message
    assert "waiting for rank 1" in message, message
    assert "timed out after" in message and "for rank 1 at call 1" in message
    assert 1.9 < waited < 4.0
    assert later == "HelperDisposedError" and disposed and not available and vote == "shm"


def _fake_hosts(rank, world_size):
    h = build_helper(vote="auto", identity=lambda: (f"host{rank}", "boot"))
    out = (h.stats()["vote"], h.stats()["construction"])
    h.destroy()
    return out


def test_auto_keeps_gloo_across_hosts(ranks):
    assert ranks(2, _fake_hosts, env=ENV, timeout_s=60) == [("gloo", "multi_host")] * 2


def _one_rank_without_library(rank, world_size):
    if rank == 1:
        os.environ["FASTVIDEO_KERNEL_LIBRARY"] = "/nonexistent/libfastvideo_ulysses_a2a.so"
    h = build_helper(vote="auto")
    x = rank_input(rank, SHAPE)
    out = (h.stats()["vote"], bit_equal(a2a(h, x, 0), oracle(x, 0)), last(h)[0])
    h.destroy()
    return out


@READS_LONG_TRAINING
def test_auto_keeps_gloo_everywhere_when_one_rank_lacks_the_library(ranks):
    assert ranks(2, _one_rank_without_library, env=ENV, timeout_s=60) == [("gloo", True, "fused")] * 2


# ------------------------------------------------------------------------------------- checked mode


def _checked_over_shm(rank, world_size, route):
    import torch

    from fastvideo.distributed.communication_op import sequence_model_parallel_all_to_all_4D as a2a
    from fastvideo.distributed.ulysses import registry

    x = rank_input(rank, SHAPE)
    exact = bit_equal(a2a(x, 2, 1), oracle(x, 0))  # builds the route's helper: it declines at construction
    helper = registry.current_checked_off_helper() if route == "off" else registry.current_default_helper()
    # Rank 1 passes the same element count in another shape: every rank raises naming B.
    bad = rank_input(rank, SHAPE if rank == 0 else (SHAPE[1], SHAPE[0], *SHAPE[2:]), torch.float32)
    got = catch(a2a, bad, 2, 1)
    after = bit_equal(a2a(x, 2, 1), oracle(x, 0))
    stats = helper.stats()
    return exact, got[0], got[2], after, stats["vote"], stats["construction"], len(helper.vote_seconds())


@pytest.mark.parametrize("route", ["off", "auto"])
def test_checked_mode_votes_over_shared_memory_on_one_host(ranks, route):
    """Checked mode on a helper that declined at construction (auto on CPU: no transport) or the off route's
    checker: the per-call votes use the same-host shared-memory vote, and still catch a mismatch."""
    env = {**ENV, "FASTVIDEO_ULYSSES_A2A": route, "FASTVIDEO_ULYSSES_A2A_CHECKED": "1"}
    construction = "disabled" if route == "off" else "transport_missing"
    for result in ranks(2, _checked_over_shm, route, env=env, timeout_s=60):
        assert result == (True, "ContractMismatchError", "B", True, "shm", construction, 3)


# ------------------------------------------------------------------------------------- C-level negative controls


def test_c_level_errors_are_statuses_not_crashes():
    import uuid

    lib = ctypes.CDLL(str(BUILT_LIBRARY))
    lib.fvk_vote_open.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                  ctypes.POINTER(ctypes.c_void_p)]
    lib.fvk_vote_exchange.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    lib.fvk_vote_close.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.fvk_last_error.restype = ctypes.c_char_p
    name = f"/fastvideo-vote-test-{uuid.uuid4().hex}".encode()
    h, h2 = ctypes.c_void_p(), ctypes.c_void_p()
    fields = (ctypes.c_int64 * 12)(*range(12))
    out = (ctypes.c_int64 * 24)()
    assert lib.fvk_vote_open(name, 2, 2, 1, ctypes.byref(h)) == 1  # rank outside the world
    assert lib.fvk_vote_open(b"no-slash", 2, 0, 1, ctypes.byref(h)) == 1
    assert lib.fvk_vote_open(name, 2, 0, 0, ctypes.byref(h)) == 6  # does not exist
    assert lib.fvk_vote_open(name, 2, 0, 1, ctypes.byref(h)) == 0
    try:
        assert lib.fvk_vote_open(name, 3, 1, 0, ctypes.byref(h2)) == 5  # wrong world size: stale/foreign
        assert b"needs" in lib.fvk_last_error()
        assert lib.fvk_vote_open(name, 2, 0, 0, ctypes.byref(h2)) == 5  # rank 0 already attached
        assert b"already attached" in lib.fvk_last_error()
        # rank 1 never publishes: a 50 ms timeout, then the handle refuses further exchanges
        assert lib.fvk_vote_exchange(h, fields, out, 50_000_000) == 7
        assert b"for rank 1 at call 1" in lib.fvk_last_error()
        assert lib.fvk_vote_exchange(h, fields, out, 50_000_000) == 5
    finally:
        assert lib.fvk_vote_close(h, 1) == 0
    assert lib.fvk_vote_exchange(h, fields, out, 0) == 5  # closed handle
    assert b"not open" in lib.fvk_last_error()
    assert lib.fvk_vote_close(h, 1) == 5  # double close
    assert not os.path.exists(f"/dev/shm/{name.decode()[1:]}")
