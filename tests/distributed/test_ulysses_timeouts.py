"""A peer that stops or exits ends every surviving rank with a clear error, within the job's timeout.

The job sets one timeout, ``init_process_group(timeout=...)``; the SP groups and the Ulysses vote follow it
(``initialize_sequence_parallel`` is called without one here, and ``FASTVIDEO_ULYSSES_A2A_VOTE_TIMEOUT_S`` is
left at 0). Then, on 2 and 3 gloo ranks:

* a SIGSTOPped peer: every survivor raises within the timeout (plus start-up slack), an error that says it
  timed out, after how long, on which SP ranks, and the timeout that governs it, on every route: ``off`` (the
  NCCL route's collective), ``auto`` voting over shared memory, ``auto`` voting over gloo;
* a peer that exits: the survivors raise at once, an error that says the peer is gone (its connection closed,
  or its process no longer exists), not a timeout;
* a peer that raised and closed its groups, alive: over gloo the survivor is told that the peer closed the
  connection (it raised or exited), never that its process is gone.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.distributed.conftest import SHM_VOTE_ENV, SHM_VOTE_SKIP, a2a, rank_input

JOB_TIMEOUT_S = 6.0
SLACK_S = 6.0  # process scheduling on a loaded 2-core machine
SHAPE = (2, 4, 6, 8)
ROUTES = ("off", "auto-shm", "auto-gloo")
CLOSED = "the peer closed the connection (it raised or exited"
# The shared-memory vote needs the built library (its ranks load it as production does); without it, say so.
NEEDS_LIBRARY = pytest.mark.skipif(SHM_VOTE_SKIP is not None, reason=SHM_VOTE_SKIP or "")


def _env(route: str) -> dict[str, str]:
    return {"FASTVIDEO_ULYSSES_A2A_VOTE_TIMEOUT_S": "0", **(SHM_VOTE_ENV if route == "auto-shm" else {})}


def _route_param(route: str):
    return pytest.param(route, marks=NEEDS_LIBRARY) if route == "auto-shm" else route


def _survivor(rank, world_size, route, fault):
    from fastvideo.distributed.communication_op import sequence_model_parallel_all_to_all_4D
    from fastvideo.distributed.parallel_state import get_sp_group
    from tests.distributed.conftest import build_helper

    x = rank_input(rank, SHAPE)
    helper = None
    if route != "off":
        # The vote's timeout follows the SP group's, which follows the job's: none is passed here.
        helper = build_helper(vote=route.removeprefix("auto-"), vote_timeout_s=None)
        assert helper.stats()["vote"] == route.removeprefix("auto-")  # the vote the case is about
    call = (lambda: a2a(helper, x, 0)) if helper is not None else (lambda: sequence_model_parallel_all_to_all_4D(x))
    call()  # every rank in step once
    timeouts = (get_sp_group().timeout_s, helper.watchdog_timeout_s if helper is not None else None)
    if rank == world_size - 1:
        if fault == "raise":  # what a job's teardown does after an exception: its groups close, the process lives
            import gc

            import torch.distributed as dist

            from fastvideo.distributed.parallel_state import destroy_sequence_parallel

            destroy_sequence_parallel()
            dist.destroy_process_group()
            gc.collect()  # the groups' last references: their sockets close with them
            time.sleep(120)  # killed by the harness once the survivor reported
        if fault == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        os._exit(0)
    time.sleep(0.5)  # the faulty rank is stopped or gone before the survivors call
    start = time.monotonic()
    try:
        call()
        got = ("ok", "", "")
    except Exception as exc:  # noqa: BLE001 - the test asserts on what came back
        got = (type(exc).__name__, str(exc), getattr(exc, "kind", ""))
    return (*got, time.monotonic() - start, timeouts)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("route", [_route_param(r) for r in ROUTES])
def test_a_stopped_peer_ends_every_survivor_within_the_jobs_timeout(ranks, route, world_size):
    survivors = set(range(world_size - 1))
    results = ranks(world_size, _survivor, route, "stop", env=_env(route),
                    job_timeout_s=JOB_TIMEOUT_S, results_from=survivors, timeout_s=120)
    for rank in survivors:
        kind, message, what, seconds, (group_timeout, watchdog) = results[rank]
        assert group_timeout == JOB_TIMEOUT_S  # the SP groups followed init_process_group's timeout
        assert seconds < JOB_TIMEOUT_S + SLACK_S, (seconds, message)
        assert "timed out" in message and f"SP ranks {list(range(world_size))}" in message, message
        assert f"{JOB_TIMEOUT_S:g} s" in message  # the timeout that governs it
        if route == "off":
            assert (kind, what) == ("CollectiveError", "timeout")
        else:
            assert (kind, what) == ("VoteTimeoutError", "timeout") and watchdog == JOB_TIMEOUT_S
            if route == "auto-shm" or world_size == 2:
                assert f"rank {world_size - 1}" in message  # which rank it waited for


@pytest.mark.parametrize("route", [_route_param(r) for r in ROUTES])
def test_a_peer_that_exits_is_reported_gone_not_timed_out(ranks, route):
    results = ranks(2, _survivor, route, "exit", env=_env(route),
                    job_timeout_s=60.0, results_from={0}, timeout_s=120)
    kind, message, what, seconds, _ = results[0]
    assert "timed out" not in message and seconds < 20, (seconds, message)
    if route == "off":
        assert (kind, what) == ("CollectiveError", "closed") and CLOSED in message, message
    else:
        assert (kind, what) == ("PeerGoneError", "peer_gone") and "rank 1" in message, message


def test_a_peer_that_raised_and_lives_is_not_reported_gone(ranks):
    """Under ``off`` the peer raised and closed its groups, alive: the survivor's error says the peer closed the
    connection (it raised or exited), not that its process is gone."""
    results = ranks(2, _survivor, "off", "raise", env=_env("off"), job_timeout_s=60.0, results_from={0},
                    timeout_s=120)
    kind, message, what, seconds, _ = results[0]
    assert "timed out" not in message and seconds < 20, (seconds, message)
    assert (kind, what) == ("CollectiveError", "closed") and CLOSED in message, message
    assert "process is gone" not in message, message


def test_the_gloo_votes_closed_connection_says_raised_or_exited():
    """The gloo vote's error for a closed connection, as gloo words it: the same wording as the NCCL route's."""
    from fastvideo.distributed.ulysses.vote import PeerGoneError, gloo_failure

    error = gloo_failure("Ulysses vote", [0, 1], 0, RuntimeError("Connection closed by peer [127.0.0.1]:1"), 0.01, 5)
    assert isinstance(error, PeerGoneError) and CLOSED in str(error) and "rank 1" in str(error), error
    assert "process is gone" not in str(error)


def _vote_timeout(rank, world_size):
    from tests.distributed.conftest import build_helper

    helper = build_helper(vote_timeout_s=None)
    result = (helper.stats()["vote_timeout_s"], helper.watchdog_timeout_s)
    helper.destroy()
    return result


@pytest.mark.parametrize("setting, expected", [("4", 4.0), ("0", 60.0)])
def test_the_vote_timeout_follows_the_job_unless_set(ranks, setting, expected):
    """``FASTVIDEO_ULYSSES_A2A_VOTE_TIMEOUT_S`` above 0 bounds the vote (and so the watchdog) whatever the job's
    timeout; 0 follows it."""
    results = ranks(2, _vote_timeout, env={"FASTVIDEO_ULYSSES_A2A_VOTE_TIMEOUT_S": setting}, job_timeout_s=60.0)
    assert results == [(expected, expected)] * 2
