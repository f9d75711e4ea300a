"""Turns: two runs on one host and one GPU time their rows in alternation, so that what the shared host does over
time (another tenant's burst, a clock step) falls on both runs' rows alike instead of on one run's.

``--compare-revs`` of a case that takes turns (``Case.takes_turns``), at one rank per run, starts both runs of a
round together (``revs.compare``). The parent's ``Conductor`` gives the turn to one run at a time, and the run
hands it back before each row it times, and before each slice of a row where the case times one in slices
(``Context.turn()``, which calls ``take``): so the two revisions' rows alternate, A's row k next to B's row k, the
leader alternating from step to step (A B, B A, A B, ...). Only the
run holding the turn does anything: a run's untimed work between rows happens inside its turn, the conductor
waits for both runs' set-up before the first turn, and for a finished run to exit before the other goes on.

Both runs of a round are pinned to the same CPUs (``shared_cpus``; ``--turn-cpus``): the host's noise is also
where the scheduler puts a run, and a run left on a CPU another process loads is slow for a whole row while the
other runs on an idle one; on shared CPUs a load slows both alike.

The channel is two FIFOs per run, made by the conductor before the runs start: ``<path>.go`` (the conductor
writes one byte per turn it gives) and ``<path>.done`` (the run writes ``d`` as it hands the turn back, ``x``
once it is finished). A run whose conductor is gone reads the end of ``.go`` and exits instead of waiting; a run
that dies is dropped, and the other goes on alone.
"""

from __future__ import annotations

import contextlib
import os
import select
import subprocess
from pathlib import Path

from benchmarks.harness import timing

TURNS_ENV = "FASTVIDEO_BENCH_TURNS"  # the run's channel path (without .go/.done); set by the conductor only

DEFAULT_CPUS = 2  # CPUs the two runs share: a run's main thread and its helper threads (watchdog, NCCL's)

_channel: dict = {}  # the run's side: its open FIFOs and the number of turns taken


def shared_cpus(allowed: set[int], count: int) -> list[int]:
    """The CPUs both runs of a round are pinned to: the ``count`` highest of ``allowed`` (the parent's own; the
    lowest take most of the system's interrupts and housekeeping), all of them where there are fewer; [] for
    ``count`` 0 (no pinning). Pure; ValueError for a negative ``count``."""
    if count < 0:
        raise ValueError(f"--turn-cpus {count}: pass the number of CPUs both runs share (0: no pinning)")
    return sorted(allowed)[-count:] if count else []


def take() -> None:
    """Hand the turn back and block until it is given again: call before each timed row. Local; blocking; a
    no-op unless a conductor started this run. Exits (SystemExit) where the conductor is gone."""
    if not _channel:
        path = os.environ.get(TURNS_ENV)
        if not path:
            return
        _channel.update(done=open(f"{path}.done", "wb", buffering=0), go=open(f"{path}.go", "rb", buffering=0),
                        taken=0)
    _channel["done"].write(b"d")
    if _channel["go"].read(1) != b"g":
        raise SystemExit(f"{TURNS_ENV}: the conductor of this run's turns is gone")
    _channel["taken"] += 1


def taken() -> int:
    """How many turns this run has taken (0 where no conductor started it). Local."""
    return _channel.get("taken", 0)


def finish() -> None:
    """Tell the conductor that this run is finished, then close the channel. Local; idempotent; a no-op unless
    a conductor started this run."""
    if _channel:
        _channel["done"].write(b"x")
        _channel["done"].close()
        _channel["go"].close()
        _channel.clear()


class Conductor:
    """The parent's side for one round: a channel per run (``labels``, the first leading the first step), made
    on entering and removed on leaving. Local; use as a context manager around starting the runs and ``run``."""

    POLL_S = 0.5  # how often a wait for a hand-back also checks whether the run is still alive

    def __init__(self, directory: Path, labels: list[str]) -> None:
        self.directory = Path(directory)
        self.labels = list(labels)
        self.fds: dict[str, tuple[int, int]] = {}
        self.order: list[str] = []  # the labels in the order the turns were given

    def __enter__(self) -> Conductor:
        self.directory.mkdir(parents=True, exist_ok=True)
        for label in self.labels:
            path = self.path(label)
            for end in (".go", ".done"):
                Path(f"{path}{end}").unlink(missing_ok=True)
                os.mkfifo(f"{path}{end}")
            # Opened read-write, so that neither open waits for the run, and the conductor never reads an end
            # of file from a run that has not opened its side yet.
            self.fds[label] = (os.open(f"{path}.go", os.O_RDWR), os.open(f"{path}.done", os.O_RDWR))
        return self

    def __exit__(self, *exc) -> None:
        for label, (go, done) in self.fds.items():
            os.close(go)
            os.close(done)
            for end in (".go", ".done"):  # a run that still has its side open keeps it until it exits
                Path(f"{self.path(label)}{end}").unlink(missing_ok=True)
        self.fds.clear()
        with contextlib.suppress(OSError):  # left where something else was put there
            self.directory.rmdir()

    def path(self, label: str) -> str:
        return str(self.directory / label)

    def env(self, label: str) -> dict[str, str]:
        """What a run's environment adds for it to take turns."""
        return {TURNS_ENV: self.path(label)}

    def run(self, procs: dict[str, subprocess.Popen]) -> None:
        """Give the turn to one run at a time until every run is finished or gone, the leader alternating from
        step to step. Blocking; returns once every run has said it is finished and exited, or died."""
        live = [label for label in self.labels if self._handed_back(label, procs[label])]  # both set up
        step = 0
        while live:
            for label in timing.rotated(live, step):
                os.write(self.fds[label][0], b"g")
                self.order.append(label)
                if not self._handed_back(label, procs[label]):
                    live.remove(label)
            step += 1

    def _handed_back(self, label: str, proc: subprocess.Popen) -> bool:
        """Wait for ``label``'s run to hand the turn back: True; False where it is finished (then it has
        exited, so its teardown is over before the other run goes on) or died."""
        done = self.fds[label][1]
        while True:
            ready, _, _ = select.select([done], [], [], self.POLL_S)
            if ready:
                if os.read(done, 1) == b"d":
                    return True
                proc.wait()
                return False
            if proc.poll() is not None:
                return False
