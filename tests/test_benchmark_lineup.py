"""The benchmarks' line-up (``benchmarks/common.py``): the barrier before each timed iteration, and the
host-to-completion measured from the last rank's entry.

The line-up is a synchronisation argument ("no rank starts iteration i before every rank reached it"), so it
gets a property check on real ranks: one rank arrives late on purpose, and every rank's exit must come after
that rank's entry on the host's one monotonic clock. The negative control runs the same check on a line-up
that does not wait, and must see the violation. The shared-memory line-up needs the built kernel library (as
``tests/distributed/test_ulysses_shm_vote.py``); the gloo one runs everywhere.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tests.distributed import mp
from tests.distributed.test_ulysses_shm_vote import BUILT, SKIP

REPO = Path(__file__).resolve().parents[1]
LATE_S = 0.05  # the late rank's delay: far above any scheduling noise of the 2-core CI VM


def _common():
    bench = str(REPO / "benchmarks")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    if str(REPO / "fastvideo-kernel") not in sys.path:
        sys.path.insert(0, str(REPO / "fastvideo-kernel"))
    import common

    return common


def _lined_up(rank: int, world_size: int, request: str, rounds: int) -> dict:
    """Rank function: ``rounds`` line-ups, each with rank ``r == round % P`` late; entry and exit times."""
    import time

    common = _common()
    if request == "none":  # the negative control: a "line-up" that does not wait
        barrier = lambda: None  # noqa: E731
    else:
        common.set_lineup(request)
        barrier = common.barrier
    entries, exits = [], []
    for i in range(rounds):
        if i % world_size == rank:
            time.sleep(LATE_S)
        entries.append(time.perf_counter())
        barrier()
        exits.append(time.perf_counter())
    kind = common.lineup()["kind"] if request != "none" else "none"
    common.close_lineup()
    return {"entries": entries, "exits": exits, "kind": kind}


def _violations(results: list[dict]) -> list[tuple[int, int]]:
    """(round, rank) pairs where that rank left the line-up before some rank had entered it."""
    rounds = len(results[0]["entries"])
    bad = []
    for i in range(rounds):
        last_entry = max(r["entries"][i] for r in results)
        bad += [(i, rank) for rank, r in enumerate(results) if r["exits"][i] < last_entry]
    return bad


LINEUPS = [pytest.param("gloo", id="gloo"),
           pytest.param("shm", id="shm", marks=pytest.mark.skipif(SKIP is not None, reason=SKIP or ""))]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("request_kind", LINEUPS)
@pytest.mark.parametrize("world", [2, 3])
def test_lineup_waits_for_the_last_rank(request_kind: str, world: int) -> None:
    results = mp.run_ranks(world, _lined_up, request_kind, 2 * world, env={"FASTVIDEO_KERNEL_LIBRARY": str(BUILT)},
                           timeout_s=100)
    assert {r["kind"] for r in results} == {request_kind}, results
    assert _violations(results) == []


@pytest.mark.timeout(120)
def test_lineup_negative_control_sees_a_rank_leave_early() -> None:
    results = mp.run_ranks(2, _lined_up, "none", 4, timeout_s=100)
    assert _violations(results), "a line-up that does not wait must show ranks leaving before the late one entered"


def _auto_without_library(rank: int, world_size: int) -> dict:
    common = _common()
    common.barrier()
    out = common.lineup()
    common.close_lineup()
    return out


@pytest.mark.timeout(120)
def test_lineup_auto_falls_back_to_gloo_on_every_rank_without_the_library(tmp_path: Path) -> None:
    # A library path that does not exist: the vote library does not load, so `auto` lines up over gloo, and
    # says why (every rank the same).
    env = {"FASTVIDEO_KERNEL_LIBRARY": str(tmp_path / "missing.so")}
    results = mp.run_ranks(2, _auto_without_library, env=env, timeout_s=100)
    assert [r["kind"] for r in results] == ["gloo", "gloo"], results
    assert all(r["why_not_shm"] for r in results), results


def test_set_lineup_rejects_unknown_and_late_choices() -> None:
    common = _common()
    with pytest.raises(ValueError, match="choose one of auto, shm, gloo"):
        common.set_lineup("tcp")
    saved = dict(common._lineup)
    try:
        common._lineup["kind"] = "gloo"
        with pytest.raises(RuntimeError, match="after the first barrier"):
            common.set_lineup("shm")
    finally:
        common._lineup.clear()
        common._lineup.update(saved)


def test_aligned_times_from_the_last_entry() -> None:
    common = _common()
    # Two ranks, three iterations, seconds on one clock.
    starts = torch.tensor([[0.0, 10.0, 20.0], [0.5, 10.0, 20.2]], dtype=torch.float64)
    ends = torch.tensor([[1.5, 11.0, 21.0], [1.4, 11.2, 21.1]], dtype=torch.float64)
    aligned, skew = common.aligned_times(starts, ends)
    assert aligned == pytest.approx([1.0, 1.2, 0.9])  # last end - last start
    assert skew == pytest.approx([0.5, 0.0, 0.2])
    # The rank-max of each rank's own time bills the early rank's wait: 1.5, 1.2, 1.0.
    assert [max(e - s for s, e in zip(sc, ec)) for sc, ec in zip(starts.T.tolist(), ends.T.tolist())] == \
        pytest.approx([1.5, 1.2, 1.0])


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))

