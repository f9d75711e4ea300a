"""The harness's line-up (``benchmarks/harness/lineup.py``): the barrier before each timed iteration.

The line-up is a synchronisation argument ("no rank starts iteration i before every rank reached it"), so it gets
a property check on real ranks: one rank arrives late on purpose, and every rank's exit must come after that
rank's entry on the host's one monotonic clock (``lineup.violations``, the same check the ``lineup_skew`` case
counts as ``#wrong``). The negative control runs the same check on a line-up that does not wait, and must see the
violation. The shared-memory line-up needs the built kernel library (as
``tests/distributed/test_ulysses_shm_vote.py``); the gloo one runs everywhere.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.distributed import mp
from tests.distributed.conftest import BUILT_LIBRARY as BUILT
from tests.distributed.conftest import SHM_VOTE_SKIP as SKIP

REPO = Path(__file__).resolve().parents[1]
LATE_S = 0.05  # the late rank's delay: far above any scheduling noise of the 2-core CI VM


def _lineup():
    if str(REPO / "fastvideo-kernel") not in sys.path:
        sys.path.insert(0, str(REPO / "fastvideo-kernel"))
    from benchmarks.harness import lineup

    return lineup


def _lined_up(rank: int, world_size: int, request: str, rounds: int) -> dict:
    """Rank function: ``rounds`` line-ups, each with rank ``r == round % P`` late; entry and exit times."""
    import time

    lineup = _lineup()
    if request == "none":  # the negative control: a "line-up" that does not wait
        barrier = lambda: None  # noqa: E731
    else:
        lineup.choose(request)
        barrier = lineup.barrier
    entries, exits = [], []
    for i in range(rounds):
        if i % world_size == rank:
            time.sleep(LATE_S)
        entries.append(time.perf_counter())
        barrier()
        exits.append(time.perf_counter())
    kind = lineup.describe()["kind"] if request != "none" else "none"
    lineup.close()
    return {"entries": entries, "exits": exits, "kind": kind}


def _violations(results: list[dict]) -> list[tuple[int, int]]:
    return _lineup().violations([r["entries"] for r in results], [r["exits"] for r in results])


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


def test_violations_names_the_iteration_and_the_rank() -> None:
    lineup = _lineup()
    entries = [[0.0, 10.0], [1.0, 10.5]]  # rank 1 enters late in iteration 0, rank 1 in iteration 1
    assert lineup.violations(entries, [[1.5, 10.6], [1.5, 10.7]]) == []
    assert lineup.violations(entries, [[0.5, 10.6], [1.5, 10.2]]) == [(0, 0), (1, 1)]


def _auto_without_library(rank: int, world_size: int) -> dict:
    lineup = _lineup()
    lineup.barrier()
    out = lineup.describe()
    lineup.close()
    return out


@pytest.mark.timeout(120)
def test_lineup_auto_falls_back_to_gloo_on_every_rank_without_the_library(tmp_path: Path) -> None:
    # A library path that does not exist: the vote library does not load, so `auto` lines up over gloo, and says
    # why (every rank the same).
    env = {"FASTVIDEO_KERNEL_LIBRARY": str(tmp_path / "missing.so")}
    results = mp.run_ranks(2, _auto_without_library, env=env, timeout_s=100)
    assert [r["kind"] for r in results] == ["gloo", "gloo"], results
    assert all(r["why_not_shm"] for r in results), results


def test_choose_rejects_unknown_and_late_choices() -> None:
    lineup = _lineup()
    with pytest.raises(ValueError, match="choose one of auto, shm, gloo"):
        lineup.choose("tcp")
    saved = dict(lineup._state)
    try:
        lineup._state["kind"] = "gloo"
        with pytest.raises(RuntimeError, match="after the first barrier"):
            lineup.choose("shm")
    finally:
        lineup._state.clear()
        lineup._state.update(saved)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
