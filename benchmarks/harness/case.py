"""A case: one benchmark or measurement, as a plug-in of the harness.

A case declares its flags, its table and its row key, and ``run(ctx)`` adds rows (``ctx.add_row``) on every rank;
the harness owns everything around it (``harness.main``): the command line, process setup, the line-up and
timing method, the header, the table, the JSON and the exit status (1 when any row has ``wrong > 0`` or the case
reported a failure). ``run`` is collective: every rank runs it with the same arguments, and rows carry values
already reduced over ranks (rank 0 prints and writes them).
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from benchmarks.harness import report, turns
from benchmarks.harness.cli import CPU_GEOMETRIES, DTYPES, GPU_GEOMETRIES, PRESETS
from benchmarks.harness.progress import Progress

# Case name -> module holding ``CASE`` (imported on demand, after the tree under test is on sys.path).
CASES: dict[str, str] = {
    "a2a": "benchmarks.cases.a2a",
    "tune": "benchmarks.cases.tune",
    "floor": "benchmarks.cases.floor",
    "host_path": "benchmarks.cases.host_path",
    "launch_host": "benchmarks.cases.launch_host",
    "fused_host_overhead": "benchmarks.cases.fused_host_overhead",
    "vote_cost": "benchmarks.cases.vote_cost",
    "lineup_skew": "benchmarks.cases.lineup_skew",
    "public_op_overhead": "benchmarks.cases.public_op_overhead",
    "route_vote": "benchmarks.cases.route_vote",
    "copy_engine": "benchmarks.cases.copy_engine",
    "overlap": "benchmarks.cases.overlap",
    "dit_step": "benchmarks.dit.case",
}


def get_case(name: str) -> Case:
    if name not in CASES:
        raise SystemExit(f"unknown case {name!r}: choose one of {', '.join(sorted(CASES))}")
    return importlib.import_module(CASES[name]).CASE


class Case:
    """Override ``run``; set the class attributes; add flags in ``add_arguments``."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    # "device": NCCL on CUDA, gloo on CPU. "gloo": host-only measurements, gloo and CPU tensors on any host.
    backend: ClassVar[str] = "device"
    columns: ClassVar[tuple[report.Column, ...]] = ()
    key_columns: ClassVar[int] = 1  # leading columns a skipped row still prints
    key: ClassVar[tuple[str, ...]] = ()  # the fields that name a row (--compare-revs matches rows by them)
    metric: ClassVar[str] = "median_ms"  # what --compare-revs compares
    defaults: ClassVar[dict] = {}  # parser defaults of the common flags (iters, warmup, repeat, ...)
    quick: ClassVar[dict] = {"iters": 5, "warmup": 2}  # what --quick sets
    saves_outputs: ClassVar[bool] = False  # takes --save-outputs (compared bit for bit by --compare-revs)
    # Calls ctx.turn() before each row it times (and before any other timing, and between slices of a row's
    # timing), so that --compare-revs at one rank per run can run both revisions together, their rows in alternation
    # (harness.turns); both revisions' runs take the same number of turns.
    takes_turns: ClassVar[bool] = False

    def lane(self, row: dict) -> str:
        """The group a row belongs to in ``--compare-revs --within``'s counts (one group unless a case says)."""
        return "all"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Add the case's own flags."""

    def offline(self, args: argparse.Namespace) -> int | None:
        """Answer without ranks where the arguments ask for no measurement (an estimate, a plot of saved runs):
        the exit status, or None to run."""
        return None

    def run(self, ctx: Context) -> None:
        """Measure, adding rows with ``ctx.add_row``. Collective."""
        raise NotImplementedError

    def details(self, row: dict) -> list[str]:
        """Extra lines printed under ``row`` in the table."""
        return []

    def report(self, ctx: Context) -> list[str]:
        """The lines printed after the run (rank 0): the table by default."""
        return report.table_lines(self.columns, ctx.rows, self.details, self.key_columns)


@dataclass
class Context:
    """What a case's ``run`` works with: its arguments and ranks, and where its results go."""

    case: Case
    args: argparse.Namespace
    rank: int
    world: int
    device: torch.device
    header: dict = field(default_factory=dict)
    rows: list[dict] = field(default_factory=list)
    extra: dict = field(default_factory=dict)  # top-level JSON sections besides header and rows
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    progress: Progress | None = None
    checkpoint_hook: Callable[[], None] | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.args.dtype]

    def geometries(self, cpu: tuple[str, ...] = CPU_GEOMETRIES,
                   gpu: tuple[str, ...] = GPU_GEOMETRIES) -> list[tuple[str, tuple[int, int, int, int]]]:
        """``--geometry`` values, else the device's defaults."""
        if self.args.geometry:
            return list(self.args.geometry)
        return [(g, PRESETS[g]) for g in (gpu if self.device.type == "cuda" else cpu)]

    def add_row(self, row: dict) -> dict:
        """Record one row (every rank records the same rows). Raises when it lacks ``wrong``/``wrong_oracle``."""
        report.check_row(row)
        self.rows.append(row)
        return row

    def skip(self, reason: str, **key) -> dict:
        """Record a row that did not run, and why."""
        return self.add_row({**key, "skipped": reason, "wrong": None, "wrong_oracle": "not run"})

    def fail(self, why: str) -> None:
        """A failure that makes the run exit 1 (besides rows with wrong > 0)."""
        self.failures.append(why)

    def unavailable(self, request: str, why: str, *, named: bool) -> None:
        """``request`` (a flag and one of its values: ``--vote shm``) cannot run here, because ``why`` (agreed by
        every rank). Named on the command line: the run stops now, exit 1, on every rank, since a record without
        what was asked for must not pass for one with it. Only part of a default set: a note, and the caller records
        its rows as skipped."""
        if named:
            raise SystemExit(f"{self.case.name}: {request} was asked for but cannot run here: {why}")
        self.note(f"{request} skipped (in the default set, not asked for by name): {why}")

    def note(self, text: str) -> None:
        """A note for the header (and printed by rank 0 as it happens)."""
        self.notes.append(text)
        self.log(f"note: {text}")

    def log(self, text: str) -> None:
        if self.is_main:
            print(f"# {text}", flush=True)

    def turn(self) -> None:
        """Wait for this run's turn before timing a row: under ``--compare-revs`` of a case that takes turns, the two
        revisions time their rows in alternation (``harness.turns``); otherwise nothing. Local; blocking."""
        turns.take()

    def advance(self, what: str = "", units: int = 1) -> None:
        if self.progress is not None:
            self.progress.advance(what, units)

    def checkpoint(self) -> None:
        """Rewrite the JSON with what is finished so far (``header.complete`` false): a run stopped by a time
        limit keeps it. Local; rank 0 writes."""
        if self.checkpoint_hook is not None:
            self.checkpoint_hook()
