"""The line-up before each timed iteration: every rank waits until the last one arrives, outside the timed region.

A gloo barrier leaves the ranks tens of microseconds apart when it returns (its exit skew), and a collective
timed from there bills that skew to the op: the first rank out waits in the op's vote (or at its device
barrier) for the last. On one host a shared-memory spin barrier (the kernel library's same-host vote, used as a
barrier) returns within a microsecond. ``auto`` takes it where every rank is on one host and loads the library,
else gloo; every rank makes the same choice (``ShmVote.create`` is collective and fails everywhere or nowhere).
The measured skews are in docs/benchmarks.md; ``benchmarks.cases.lineup_skew`` measures them.
"""

from __future__ import annotations

import platform
from collections.abc import Sequence

import torch.distributed as dist

from benchmarks.harness.process import cpu_group

LINEUPS = ("auto", "shm", "gloo")
_state: dict = {"request": "auto", "kind": None, "vote": None, "why": ""}


def choose(request: str) -> None:
    """Choose the line-up (``auto``, ``shm`` or ``gloo``) before the first ``barrier()``. Local: call it on every
    rank with the same value."""
    if request not in LINEUPS:
        raise ValueError(f"lineup {request!r}: choose one of {', '.join(LINEUPS)}")
    if _state["kind"] is not None:
        raise RuntimeError("lineup.choose after the first barrier(): the line-up is fixed for the run")
    _state["request"] = request


def same_host() -> bool:
    """Every rank on one host (hostname and boot id). Collective over the SP group's gloo group at the first
    call, cached after it (every rank caches the same answer)."""
    if "same_host" not in _state:
        try:
            with open("/proc/sys/kernel/random/boot_id") as f:
                boot = f.read().strip()
        except OSError:
            boot = ""
        ids: list = [None] * dist.get_world_size()
        dist.all_gather_object(ids, (platform.node(), boot), group=cpu_group())
        _state["same_host"] = len(set(ids)) == 1
    return _state["same_host"]


def _open() -> None:
    """Collective, once: the shared-memory barrier where the request and the hosts allow it, else gloo."""
    request, why = _state["request"], ""
    if request != "gloo":
        if not same_host():
            why = "ranks on more than one host"
        else:
            try:  # a tree under test (--compare-revs) older than the shared-memory vote has none
                from fastvideo.distributed.ulysses.vote import GlooVote, ShmVote, load_vote_library
            except ImportError as exc:
                vote, why = None, f"the tree under test has no shared-memory vote ({exc})"
            else:
                ranks = list(range(dist.get_world_size()))
                vote, why = ShmVote.create(GlooVote(ranks, 600.0), dist.get_rank(), load_vote_library())
            if vote is not None:
                _state.update(kind="shm", vote=vote, fields=[0] * 12)
                return
        if request == "shm":
            raise SystemExit(f"--lineup shm: the shared-memory barrier is unavailable ({why})")
    _state.update(kind="gloo", why=why)


def describe() -> dict:
    """Which line-up the timed loops used (``kind``: shm, gloo, or none at one rank or before any) and why not
    shm."""
    return {"kind": _state["kind"] or "none", "request": _state["request"], "why_not_shm": _state["why"]}


def close() -> None:
    """Release the shared-memory barrier (local) and forget the choice of kind (the request stays)."""
    vote = _state.get("vote")
    if vote is not None:
        vote.destroy()
    _state.update(kind=None, vote=None, why="")
    _state.pop("same_host", None)


def barrier() -> None:
    """Line the ranks up, outside any timed region. Collective; opens the line-up at its first call; blocks the
    host until every rank of the SP group arrived."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    if _state["kind"] is None:
        _open()
    if _state["kind"] == "shm":
        _state["vote"].exchange(_state["fields"])
    else:
        dist.barrier(group=cpu_group())


def violations(entries: Sequence[Sequence[float]], exits: Sequence[Sequence[float]]) -> list[tuple[int, int]]:
    """The line-up's one property, checked: ``(iteration, rank)`` pairs where that rank left a line-up before
    some rank had entered it. ``entries[r][i]``, ``exits[r][i]``: rank r's times on one clock. Pure."""
    bad = []
    for i in range(len(entries[0])):
        last_entry = max(e[i] for e in entries)
        bad += [(i, rank) for rank, x in enumerate(exits) if x[i] < last_entry]
    return bad
