"""Helper lifecycle: 1000 rebuild-and-destroy cycles leave process groups, threads, file descriptors
and shared-memory mappings exactly where they were.

Each cycle builds a helper on the SP group (the full construction: capability exchange, steps,
topology), runs one fused call whose launch the watchdog tracks (so its thread starts and is
joined), and destroys it. Helpers share the SP group's vote group (created once with the group), so
a cycle creates no process group; before, every helper created a gloo group of its own that could
not be destroyed (24 ms a cycle at 2 ranks, +1 group, +3 threads, +5 descriptors each).

The negative control builds standalone ``GlooVote``s, each with a group of its own (the old
behaviour), and asserts the same counts do grow.
"""

from __future__ import annotations

import gc
import os
import time

import pytest

from tests.distributed.conftest import a2a, build_helper, oracle, rank_input
from tests.plan_transport import GlooPlanTransport

SHAPE = (3, 16, 12, 8)
CYCLES = 1000


class _Done:
    def query(self) -> bool:
        return True


class CompletingTransport(GlooPlanTransport):
    """The CPU transport reporting a completed asynchronous launch, so the watchdog tracks every call."""

    def completion_marker(self):
        return _Done()


def counts(settle_to: dict[str, int] | None = None) -> dict[str, int]:
    """This process's resources that a leaking helper would grow, once they are steady.

    Reads until two readings 20 ms apart agree (or, with ``settle_to``, until they equal it), for up
    to 2 s: a joined thread's OS thread can linger in /proc/self/task for a moment after ``join()``
    returns. A leak stays, and still fails.
    """
    deadline = time.monotonic() + 2.0
    gc.collect()  # objects in reference cycles are freed at an arbitrary later collection otherwise
    last = _counts()
    while time.monotonic() < deadline:
        time.sleep(0.02)
        now = _counts()
        if (now == settle_to) if settle_to is not None else (now == last):
            return now
        last = now
    return last


def _counts() -> dict[str, int]:
    import threading

    import torch.distributed as dist

    with open("/proc/self/maps") as f:
        shm = sum("/dev/shm/" in line for line in f)
    return {
        "process_groups": len(dist.distributed_c10d._world.pg_map),
        "threads": len(os.listdir("/proc/self/task")),  # native ones too (gloo's)
        "python_threads": threading.active_count(),
        "fds": len(os.listdir("/proc/self/fd")),
        "shm_mappings": shm,
    }


def _cycles(rank, world_size, n, vote):
    import torch.distributed

    from fastvideo.distributed.parallel_state import get_sp_group

    x = rank_input(rank, SHAPE)

    def cycle() -> tuple[str, str]:
        # The original plan (one chunk); the vote channel pinned: "auto" takes the shared-memory vote wherever the
        # kernel library loads (a host with the wheel installed), and this test counts what each channel holds.
        h = build_helper(transport=CompletingTransport(), tuned=False, vote=vote)
        a2a(h, x, 0)
        result = (h.history[-1].route, h.stats()["vote"])
        h.destroy()
        return result

    cycle()  # warm-up: whatever is created lazily on first use (gloo pairs of the vote group) exists now
    before = counts()
    start = time.perf_counter()
    results = {cycle() for _ in range(n)}
    per_cycle_ms = (time.perf_counter() - start) / n * 1e3
    after = counts(settle_to=before)
    # No rank tears down its groups (which closes its peers' sockets to it) until every rank has counted.
    torch.distributed.barrier(group=get_sp_group().cpu_group)
    return before, after, results, per_cycle_ms


def test_1000_rebuild_cycles_leave_resource_counts_flat(ranks):
    for before, after, results, per_cycle_ms in ranks(2, _cycles, CYCLES, "gloo", timeout_s=240):
        assert after == before
        assert results == {("fused", "gloo")}
        print(f"{CYCLES} cycles: {per_cycle_ms:.2f} ms a cycle; counts {after}")


def _leaky(rank, world_size, n):
    from fastvideo.distributed.parallel_state import get_sp_group
    from fastvideo.distributed.ulysses.vote import GlooVote

    before = counts()
    for _ in range(n):
        vote = GlooVote(get_sp_group().ranks, 10.0)  # a group of its own each time: the old helper's behaviour
        vote.exchange(list(range(12)))
        vote.destroy()
    return before, counts()


def test_negative_control_a_group_per_vote_grows_the_counts(ranks):
    for before, after in ranks(2, _leaky, 5, timeout_s=60):
        assert after["process_groups"] == before["process_groups"] + 5
        assert after["threads"] > before["threads"] and after["fds"] > before["fds"]


# ------------------------------------------------------------------------------------- shared-memory vote

def _shm_skip_reason() -> str | None:
    from tests.distributed import test_ulysses_shm_vote as shm

    return shm.SKIP


@pytest.mark.skipif(_shm_skip_reason() is not None, reason=str(_shm_skip_reason()))
def test_rebuild_cycles_with_the_shared_memory_vote_leave_mappings_flat(ranks):
    """With the kernel library's shared-memory vote, each helper maps a segment: destroy unmaps it."""
    from tests.distributed import test_ulysses_shm_vote as shm

    for before, after, results, _ in ranks(2, _cycles, 300, "shm", env=shm.ENV, timeout_s=240):
        assert results == {("fused", "shm")}
        assert after == before


# ------------------------------------------------------------------------------------- a failed vote group


def _after_a_vote_timeout(rank, world_size):
    import datetime

    import torch.distributed as dist

    from fastvideo.distributed import parallel_state
    from tests.distributed.conftest import catch

    h = build_helper(vote_timeout_s=2.0)
    first = rebuilt = None
    if rank == 0:  # rank 1 never calls: rank 0's vote times out, and the SP group's vote group is dead
        first = catch(a2a, h, rank_input(rank, SHAPE), 0)[0]
        rebuilt = catch(build_helper)[:2]  # refused at once, locally: no exchange on a dead group
    dist.barrier()
    h.destroy()
    # Rebuilding the groups, as the error says, gives a working vote group again.
    parallel_state.destroy_sequence_parallel()
    parallel_state.initialize_sequence_parallel(world_size, timeout=datetime.timedelta(seconds=30))
    h2 = build_helper()
    a2a(h2, rank_input(rank, SHAPE), 0)
    route = h2.history[-1].route
    h2.destroy()
    return first, rebuilt, route


def test_a_failed_vote_group_refuses_new_helpers_until_the_groups_are_rebuilt(ranks):
    (first, rebuilt, route0), (_, _, route1) = ranks(2, _after_a_vote_timeout, timeout_s=60)
    assert first == "VoteTimeoutError"
    assert rebuilt[0] == "HelperDisposedError" and "initialize_sequence_parallel() on every rank" in rebuilt[1]
    assert route0 == route1 == "fused"


def _helper_across_a_teardown(rank, world_size, new_sp):
    """A helper the caller built (the CPU plan transport) and made the public op's route, exact on its SP group;
    then the groups torn down and rebuilt at SP ``new_sp``: whether it is still alive, what its own call and a call
    naming it raise, and whether the public op is exact on the new group (the oracle: its NCCL route)."""
    import torch

    from fastvideo.distributed.communication_op import sequence_model_parallel_all_to_all_4D
    from fastvideo.distributed.parallel_state import destroy_sequence_parallel, initialize_sequence_parallel
    from fastvideo.distributed.ulysses import registry
    from fastvideo.distributed.ulysses.runtime import HelperDisposedError

    h = build_helper()
    registry.use_route(h)
    x = rank_input(rank, (2, 4, 8, 3))
    before = torch.equal(sequence_model_parallel_all_to_all_4D(x, 2, 1), oracle(x, 0))
    destroy_sequence_parallel()
    initialize_sequence_parallel(new_sp)
    raised = []
    for call in (lambda: h.all_to_all(x, 0), lambda: a2a(h, x, 0)):
        try:
            call()
            raised.append(None)
        except HelperDisposedError as exc:
            raised.append(str(exc))
    after = torch.equal(sequence_model_parallel_all_to_all_4D(x, 2, 1), oracle(x, 0))
    return before, h.alive, raised, after


def test_the_groups_teardown_destroys_every_helper_built_on_them(ranks):
    """A helper the caller built on the SP group does not outlive the group: ``destroy_sequence_parallel``
    destroys it (collectively), so that after a rebuild at another SP size its calls raise HelperDisposedError on
    every rank and the public op, whose route it was, resolves anew and is exact. Before, the helper lived on,
    served the public op and exchanged over the old group's four ranks: outputs of the old group's shape, with
    the other SP group's data, on every rank, and no error."""
    for before, alive, raised, after in ranks(4, _helper_across_a_teardown, 2, sp_size=4, timeout_s=90):
        assert before and not alive and after, (before, alive, after)
        assert len(raised) == 2 and all(r is not None and "destroyed" in r for r in raised), raised
