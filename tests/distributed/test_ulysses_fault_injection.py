"""Fault injection on gloo ranks: caller bugs raise on every rank, capability gaps decline together,
construction failures decline without hanging, a dead peer times out and disposes the helper.

Each scenario returns what every rank saw; the test asserts all ranks agree. ``ranks(..., timeout_s=)``
bounds every scenario, so a hang fails the test instead of eating CI.
"""

from __future__ import annotations

import pytest
import torch

from fastvideo.distributed.ulysses.contract import DeclineReason
from fastvideo.distributed.ulysses.policy import Plan
from tests.distributed.conftest import (
    READS_LONG_TRAINING,
    a2a,
    bit_equal,
    build_helper,
    capture_switch,
    catch,
    construction_fault,
    last,
    local_config,
    non_contiguous,
    oracle,
    rank_input,
)

SHAPE = (3, 16, 12, 8)
FUSED = ("fused", Plan(144, 1, 16, True).word, None, 3, "FORWARD_NO_GRAD")


def _call_and_check(h, rank, seed=0, shape=SHAPE, dtype=torch.float32):
    """One call; returns (bit-exact vs the NCCL route, the call's record)."""
    x = rank_input(rank, shape, dtype, seed=seed)
    y = a2a(h, x, 0)
    return bit_equal(y, oracle(x, 0)), last(h)


# ------------------------------------------------------------------------------------- caller bugs: raise


def _geometry_mismatch(rank, world_size, what):
    h = build_helper()
    shape, dtype, mode = SHAPE, torch.float32, 0
    if rank == world_size - 1:  # the last rank passes something different
        if what == "S":
            shape = (3, 8, 12, 8)
        elif what == "DTYPE":
            dtype = torch.bfloat16
        elif what == "B":
            shape = (4, 16, 12, 8)
        elif what == "MODE":
            mode, shape = 1, (3, 16 * world_size, 12 // world_size, 8)
    got = catch(a2a, h, rank_input(rank, shape, dtype), mode)
    after = _call_and_check(h, rank, seed=1)  # the helper stays usable: no rank entered a collective
    h.destroy()
    return got, after


@pytest.mark.parametrize("world_size, what", [(2, "S"), (2, "DTYPE"), (3, "B"), (4, "MODE")])
@READS_LONG_TRAINING
def test_geometry_mismatch_raises_on_every_rank_naming_the_field(ranks, world_size, what):
    """One rank passes a different S, dtype, B or mode: every rank raises ContractMismatchError naming the
    field and every rank's value; the next agreeing call runs fused (nobody was left inside a collective)."""
    results = ranks(world_size, _geometry_mismatch, what, timeout_s=60)
    for kind, message, field in (r[0] for r in results):
        assert (kind, field) == ("ContractMismatchError", what)
        assert f"field {what}" in message and f"rank {world_size - 1}:" in message
    if what == "DTYPE":
        assert "torch.float32" in results[0][0][1] and "torch.bfloat16" in results[0][0][1]
    assert len({r[0][1] for r in results}) == 1  # the same message on every rank
    for exact, record in (r[1] for r in results):
        assert exact and record == FUSED


def _one_call_ahead(rank, world_size):
    """Rank 0's calls carry SEQ words one ahead of its peers' (what a rank that made a call its peers did not
    looks like): backwards of the same forward, through the helper's public ``call``, whose outcome carries the word
    the forward voted. Identical DiT layers would otherwise pair the wrong calls."""
    h = build_helper()
    y, (code, word) = h.call(rank_input(rank, SHAPE), 0, True)
    ahead = int(rank == 0)
    got = catch(h.call, y.contiguous(), 1, False, (code, word + ahead))
    again = catch(h.call, y.contiguous(), 1, False, (code, word + 1 + ahead))  # raises again, no hang
    h.destroy()
    return got, again


@READS_LONG_TRAINING
def test_rank_one_call_ahead_raises_seq_mismatch_on_every_rank(ranks):
    """Same geometry on every rank but rank 0 is one call ahead: every rank raises naming SEQ with the
    per-rank sequence numbers, on this call and the next (no rank enters a collective)."""
    results = ranks(2, _one_call_ahead, timeout_s=60)
    for got, again in results:
        assert got[0] == "ContractMismatchError" and got[2] == "SEQ"
        assert "rank 0: 1, rank 1: 0" in got[1]
        assert again[0] == "ContractMismatchError" and again[2] == "SEQ"


def _local_failure(rank, world_size):
    h = build_helper()
    # A rank-local step of the call raises on rank 0 only: proposing its plan, with a long-training value
    # the policy refuses.
    with local_config(h, long_training="bogus" if rank == 0 else h.planner.config.long_training):
        got = catch(a2a, h, rank_input(rank, SHAPE), 0)
    after = _call_and_check(h, rank, seed=1)  # nobody was left a call ahead
    h.destroy()
    return got, after


@READS_LONG_TRAINING
def test_local_failure_on_one_rank_raises_on_every_rank_and_keeps_ranks_in_step(ranks):
    """A local exception on one rank is voted, not raised alone: every rank raises PeerCallError for that
    call (naming rank 0), and the next call runs fused with the sequence numbers still in step."""
    results = ranks(2, _local_failure, timeout_s=60)
    for got, (exact, record) in results:
        assert got[0] == "PeerCallError" and "rank(s) [0]" in got[1]
        assert exact and record == FUSED


def _grad_flag_mismatch(rank, world_size):
    h = build_helper()
    x = rank_input(rank, SHAPE, requires_grad=(rank == 0))
    got = catch(a2a, h, x, 0)
    h.destroy()
    return got


@READS_LONG_TRAINING
def test_grad_flag_mismatch_raises_phase_on_every_rank(ranks):
    """requires_grad differs between ranks (they would run different numbers of backward collectives):
    every rank raises naming PHASE."""
    for kind, message, field in ranks(2, _grad_flag_mismatch, timeout_s=60):
        assert (kind, field) == ("ContractMismatchError", "PHASE")
        assert "forward_grad" in message and "forward_no_grad" in message


# ------------------------------------------------------------------------------------- capability: decline


def _construction_decline(rank, world_size, scenario):
    transport, kw = construction_fault(rank, scenario)
    h = build_helper(transport=transport, **kw)
    stats = h.stats()
    window_after = transport._window is not None
    calls = [_call_and_check(h, rank, seed=s) for s in range(2)]
    result = (stats["construction"], stats["construction_detail"], h.fused_available, window_after, calls,
              h.stats()["declines"], transport.executed)
    h.destroy()
    return result


@pytest.mark.parametrize(
    "scenario, reason, detail",
    [
        ("missing", DeclineReason.TRANSPORT_MISSING, "rank 1: transport_missing (no kernel library on this rank)"),
        ("abi", DeclineReason.PEER_DISAGREEMENT, "transport capability"),
        ("hosts", DeclineReason.MULTI_HOST, "host0"),
        ("boot_id", DeclineReason.MULTI_HOST, "more than one host"),
        ("alloc", DeclineReason.CONSTRUCTION_FAILED, "rank 1: alloc_window"),
        ("nvlink", DeclineReason.NOT_NVLINK, "rank 1: PCIe only"),
    ],
)
def test_construction_declines_collectively_and_calls_take_the_nccl_route(ranks, scenario, reason, detail):
    """One rank lacks the kernel, has another ABI, sits on another host (hostname or boot id), fails to
    allocate its window, or reaches peers over PCIe only: every rank declines at construction with the
    same reason (no hang), and every call takes the NCCL route, still exact, counted under that reason."""
    results = ranks(2, _construction_decline, scenario, timeout_s=60)
    # The detail names the failing rank everywhere (its "after steps" prefix is rank-local).
    for construction, why, available, window_after, calls, declines, executed in results:
        assert construction == reason.label and detail in why and not available
        if scenario in ("alloc", "nvlink"):
            assert not window_after  # construction released what it had built (abort / collective destroy)
        for exact, record in calls:
            assert exact and record == ("nccl", 0, reason.label, 0, "FORWARD_NO_GRAD")
        assert declines == {reason.label: 2} and executed == []


def _per_call_loss(rank, world_size, everywhere):
    h = build_helper()
    x = rank_input(rank, SHAPE, seed=0)
    y = a2a(h, non_contiguous(x) if everywhere or rank == 1 else x, 0)  # a non-contiguous input there
    first = (bit_equal(y, oracle(x, 0)), last(h))
    second = _call_and_check(h, rank, seed=1)
    declines = h.stats()["declines"]
    h.destroy()
    return first, second, declines


@READS_LONG_TRAINING
def test_one_rank_losing_eligibility_declines_everywhere_then_recovers(ranks):
    """Rank 1 alone passes a non-contiguous input for one call: every rank declines PEER_DISAGREEMENT (exact via
    the NCCL route); the next compatible call takes the fused route again."""
    for first, second, declines in ranks(3, _per_call_loss, False, timeout_s=60):
        assert first == (True, ("nccl", 0, "peer_disagreement", 0, "FORWARD_NO_GRAD"))
        assert second == (True, FUSED)
        assert declines == {"peer_disagreement": 1}


@READS_LONG_TRAINING
def test_common_eligibility_bit_declines_with_that_reason(ranks):
    """Every rank passes a non-contiguous input: the collective reason is NON_CONTIGUOUS itself, then recovery."""
    for first, second, declines in ranks(2, _per_call_loss, True, timeout_s=60):
        assert first == (True, ("nccl", 0, "non_contiguous", 0, "FORWARD_NO_GRAD"))
        assert second == (True, FUSED)
        assert declines == {"non_contiguous": 1}


def _capture(rank, world_size, everywhere):
    # CUDA graph capture cannot happen on CPU: the helper asks its ``capturing(x)`` (for CUDA tensors, whether
    # the current stream is capturing), forced here (``capture_switch``). The CPU transport cannot freeze a plan
    # into a graph (it runs gloo collectives per call), so a capture declines; the vote, verdict, counting and
    # fallback are the real code paths. The capturable route: tests/distributed/test_ulysses_graphs.py.
    h = build_helper()
    capture_switch(h).on = everywhere or rank == 0
    first = _call_and_check(h, rank, seed=0)
    capture_switch(h).on = False
    second = _call_and_check(h, rank, seed=1)
    declines = h.stats()["declines"]
    h.destroy()
    return first, second, declines


@pytest.mark.parametrize("everywhere, reason", [(True, "cuda_graph_capture"), (False, "peer_disagreement")])
@READS_LONG_TRAINING
def test_capture_declines_collectively(ranks, everywhere, reason):
    """Capture of a plan the transport cannot freeze, on every rank, declines CUDA_GRAPH_CAPTURE; on one rank
    only, PEER_DISAGREEMENT; after capture the fused route is back (capture forced, see the rank function)."""
    for first, second, declines in ranks(2, _capture, everywhere, timeout_s=60):
        assert first == (True, ("nccl", 0, reason, 0, "FORWARD_NO_GRAD"))
        assert second == (True, FUSED) and declines == {reason: 1}


# ------------------------------------------------------------------------------------- dead peer: timeout


def _vote_timeout(rank, world_size):
    import torch.distributed as dist

    h = build_helper(vote_timeout_s=3.0)
    result = None
    if rank == 0:  # rank 1 never calls the helper (a dead peer, or a peer with FASTVIDEO_ULYSSES_A2A=off)
        first = catch(a2a, h, rank_input(rank, SHAPE), 0)
        later = catch(a2a, h, rank_input(rank, SHAPE), 0)
        stats = h.stats()
        result = (first[0], first[1], later[0], later[1], stats["disposed"], h.fused_available)
    dist.barrier()  # rank 1 waits here (on the world group) until rank 0 has timed out
    h.destroy()
    return result


def test_vote_timeout_raises_and_disposes_the_helper(ranks):
    """A peer that never votes: rank 0 raises VoteTimeoutError (bounded by the vote timeout, not a hang), the
    helper disposes itself, and every later call raises HelperDisposedError."""
    first_kind, first_msg, later_kind, later_msg, disposed, available = ranks(2, _vote_timeout, timeout_s=60)[0]
    assert first_kind == "VoteTimeoutError" and "timed out after" in first_msg and "(the vote timeout, 3 s" in first_msg
    assert later_kind == "HelperDisposedError" and "disposed after a failed vote" in later_msg
    assert disposed and not available


# ------------------------------------------------------------------------------- launch failure after vote


def _launch_fails_after_vote(rank, world_size):
    import torch.distributed as dist

    from fastvideo.distributed.ulysses.transport import output_shape
    from tests.plan_transport import GlooPlanTransport

    class FailsOnLastRank(GlooPlanTransport):
        """A launch that fails on one rank only, after every rank voted to run it (local, no collective)."""

        def execute(self, x, geom, plan, **kw):  # type: ignore[override]
            if rank == world_size - 1:
                raise RuntimeError("injected launch failure")
            return torch.empty(output_shape(geom), dtype=x.dtype)

    h = build_helper(transport=FailsOnLastRank())
    first = catch(a2a, h, rank_input(rank, SHAPE), 0)
    later = catch(a2a, h, rank_input(rank, SHAPE), 0) if rank == world_size - 1 else None
    stats = h.stats()
    dist.barrier()
    h.destroy()
    def kind(result):  # (exception type or "ok", message)
        return None if result is None else (result[0], result[1] if result[0] != "ok" else "")

    return kind(first), kind(later), stats["disposed"], h.fused_available


@READS_LONG_TRAINING
def test_a_launch_that_fails_after_the_vote_disposes_the_helper_on_that_rank(ranks):
    """The peers launched the call and may wait at its barriers: the failing rank raises the launch's error,
    takes no further call (HelperDisposedError naming the failed call), and never votes again; its peers'
    calls completed (their watchdog is what ends them when a real kernel is stuck)."""
    results = ranks(2, _launch_fails_after_vote, timeout_s=60)
    (first0, later0, disposed0, _), (first1, later1, disposed1, available1) = results
    assert first0 == ("ok", "") and later0 is None and not disposed0
    assert first1[0] == "RuntimeError" and "injected launch failure" in first1[1]
    assert later1[0] == "HelperDisposedError" and "failed on this rank after the vote" in later1[1]
    assert disposed1 and not available1
