"""Suite-wide rules: which tests see the caller's transport settings, and a progress line for CI logs.

Ambient settings. Every test must pass whatever the caller's shell sets for ``FASTVIDEO_ULYSSES_A2A``
and ``FASTVIDEO_ULYSSES_A2A_LONG_TRAINING``. Two kinds of test:

* marked ``@pytest.mark.ambient`` (both variables) or ``@pytest.mark.ambient("FASTVIDEO_...")``
  (only those): code under test reads the variable without the test setting it (the public op reads
  the route, the helper reads LONG_TRAINING on every call, a subprocess inherits both). It sees the
  shell's value, or with ``--ulysses-ambient=all`` (what ``scripts/run_tests.sh`` passes) runs once
  under each value of each variable it names (four combinations for both).
* for every variable a test does not name, the variable is pinned to a fixed valid value (``PINNED``:
  the defaults, ``off`` and ``auto``) for the test's duration, in this process, its gloo ranks and any
  subprocess it starts, so the shell's value cannot reach it: such a test is independent of the
  caller's shell by construction and runs once. A test that sets a value itself (``envs.override``,
  the ``env`` argument of ``ranks``) needs no marker either.

The checked mode's switches (``FASTVIDEO_ULYSSES_A2A_CHECKED``, torch's ``TORCH_DISTRIBUTED_DEBUG``) are
pinned off for every test (``ALWAYS_PINNED``), in its ranks and subprocesses too; tests of the checked
mode set them.

Why pinned and not an invalid sentinel (as until 2026-11-29): ``initialize_sequence_parallel`` now
validates and agrees every ``FASTVIDEO_*`` setting across the SP group, so every test that
builds SP groups reads both variables; a sentinel would fail all of them, and "reads it" no longer
tells which tests' behaviour depends on the value. That is now the marker's job: mark a test whose
result is meant to hold under each value.

Code must read these settings through ``fastvideo.envs`` (``tests/test_ambient_guard.py`` checks),
so that validation and agreement see every read.

Compile cache. Each session compiles into a fresh ``TORCHINDUCTOR_CACHE_DIR`` (removed at its end): inductor's
cache key omits a custom op's fake impl, so a cache warmed by another version of this package would replay that
version's output shapes (a start's saved outcome of two words, for one): compiled tests would fail, or pass on
stale code.

Order. Tests marked ``slow`` (a minute or more of a 2-core machine, mostly in subprocesses of their own) run first:
``pytest -n`` (work stealing) hands each worker one contiguous chunk of the collection to begin with, and the slow
tests are placed at the heads of those chunks, round robin, so that every worker starts one at once instead of the
run reaching them near its end and leaving the other workers idle behind them (``slow_at_chunk_heads``).

Progress. ``--progress-every=SECONDS`` prints ``[done/total] elapsed, ETA`` at most that often and at
every tenth of the run. The ETA weighs each remaining test by its duration in the last run (pytest's
cache), else by its file's mean in ``tests/durations.json`` (refresh it with
``--progress-save-table`` after changing the suite much), else by the mean so far. A failing test is named on
a ``progress: FAILED`` line as it fails, so a run cut short by a time limit still says what failed.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]  # tests/test_ambient_guard.py runs this file's rules on small inner suites

AMBIENT_VALUES = {
    "FASTVIDEO_ULYSSES_A2A": ("off", "auto"),
    "FASTVIDEO_ULYSSES_A2A_LONG_TRAINING": ("auto", "chunked"),
}
AMBIENT_VARS = tuple(AMBIENT_VALUES)
_SHORT = {"FASTVIDEO_ULYSSES_A2A": "a2a", "FASTVIDEO_ULYSSES_A2A_LONG_TRAINING": "long"}
# What a test that does not name a variable sees: the registry's defaults, whatever the shell says.
PINNED = {"FASTVIDEO_ULYSSES_A2A": "off", "FASTVIDEO_ULYSSES_A2A_LONG_TRAINING": "auto"}
# Pinned for every test (no marker names them): the checked mode's switches. A shell with
# TORCH_DISTRIBUTED_DEBUG=DETAIL would otherwise turn on a vote per call in every test (and torch's own
# collective checks). Tests of the checked mode set them themselves. None: unset.
ALWAYS_PINNED: dict[str, str | None] = {"FASTVIDEO_ULYSSES_A2A_CHECKED": "auto", "TORCH_DISTRIBUTED_DEBUG": None}
# Mean seconds per test by file, for the ETA of a run with no history (a fresh clone in CI).
DURATIONS_TABLE = Path(__file__).with_name("durations.json")
_COMPILE_CACHE = pytest.StashKey[tuple[pytest.MonkeyPatch, str]]()  # its setting, this session's dir


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--ulysses-ambient",
        choices=("inherit", "all"),
        default="inherit",
        help="tests marked ambient: inherit the shell's values of the variables they name, or run once per value",
    )
    parser.addoption(
        "--progress-every",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="print [done/total] elapsed and ETA at most every SECONDS and at every 10%% (0: off)",
    )
    parser.addoption(
        "--progress-save-table",
        action="store_true",
        help=f"with --progress-every: write this run's mean test duration per file to {DURATIONS_TABLE.name}",
    )


def pytest_configure(config: pytest.Config) -> None:
    # The session's own compile cache (module docstring); the -n workers, ranks and subprocesses inherit it.
    if not hasattr(config, "workerinput"):
        patch, cache = pytest.MonkeyPatch(), tempfile.mkdtemp(prefix="fastvideo-tests-inductor-")
        patch.setenv("TORCHINDUCTOR_CACHE_DIR", cache)
        config.stash[_COMPILE_CACHE] = patch, cache
    # Not on pytest -n workers: their output is not shown, and the controller sees every report.
    if config.getoption("--progress-every") > 0 and not hasattr(config, "workerinput"):
        config.pluginmanager.register(_Progress(config), "fastvideo-progress")


def pytest_unconfigure(config: pytest.Config) -> None:
    if _COMPILE_CACHE in config.stash:  # the caller's value back: an inner suite (pytester) runs in this process
        patch, cache = config.stash[_COMPILE_CACHE]
        patch.undo()
        shutil.rmtree(cache, ignore_errors=True)


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected: the order of what runs
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The same order on every pytest -n worker, as its scheduler requires (each computes it alike).
    workers = int(getattr(config, "workerinput", {}).get("workercount", 1))
    slow = [item for item in items if item.get_closest_marker("slow")]
    items[:] = slow_at_chunk_heads(slow, [item for item in items if not item.get_closest_marker("slow")], workers)


def slow_at_chunk_heads(slow: list, rest: list, workers: int) -> list:
    """``slow`` and ``rest`` in one order: pytest -n's work stealing first hands its k workers one contiguous chunk
    each (the i-th of k takes ``left // (k - i)`` of what is left), so the slow tests go to the heads of those chunks
    (k of them start at once) and the rest fill the chunks behind them, each list in its own order. A file's slow
    tests stay together, at one chunk's head (they may share a module fixture, which a second worker would set up
    again); each file's, largest first, goes to the head with the fewest so far."""
    files: dict[str, list] = {}
    for item in slow:
        files.setdefault(getattr(item, "nodeid", str(item)).split("::")[0], []).append(item)
    heads: list[list] = [[] for _ in range(workers)]
    for group in sorted(files.values(), key=len, reverse=True):  # stable: files of one size keep their order
        min(heads, key=len).extend(group)
    order: list = []
    others = iter(rest)
    for j in range(workers):
        size = (len(slow) + len(rest) - len(order)) // (workers - j)
        order += heads[j] + list(itertools.islice(others, max(0, size - len(heads[j]))))
    return order + list(others)


def ambient_vars(node: pytest.Item | pytest.FunctionDefinition) -> tuple[str, ...]:
    """The variables a test's ``ambient`` marker names (both for a bare marker; none without one)."""
    marker = node.get_closest_marker("ambient")
    if marker is None:
        return ()
    names = tuple(marker.args) or AMBIENT_VARS
    unknown = [name for name in names if name not in AMBIENT_VALUES]
    if unknown:
        raise pytest.UsageError(f"{node.nodeid}: ambient marker names {unknown}; choose from {list(AMBIENT_VARS)}")
    return names


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # Only marked tests, only with --ulysses-ambient=all: otherwise test ids stay unchanged.
    names = ambient_vars(metafunc.definition)
    if names and "ulysses_ambient" in metafunc.fixturenames and metafunc.config.getoption("--ulysses-ambient") == "all":
        combos = [dict(zip(names, values)) for values in itertools.product(*(AMBIENT_VALUES[n] for n in names))]
        ids = [",".join(f"{_SHORT[n]}={c[n]}" for n in names) for c in combos]
        metafunc.parametrize("ulysses_ambient", combos, ids=ids, indirect=True)


@pytest.fixture(autouse=True)
def ulysses_ambient(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> dict[str, str | None]:
    """The two variables as this test sees them: a named one keeps the shell's value or gets this run's
    combination; one the test does not name is PINNED."""
    names = ambient_vars(request.node)
    combo = getattr(request, "param", None) or {}
    for name in AMBIENT_VARS:
        if name not in names:
            monkeypatch.setenv(name, PINNED[name])
        elif name in combo:
            monkeypatch.setenv(name, combo[name])
    for name, value in ALWAYS_PINNED.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    return {name: os.environ.get(name) for name in AMBIENT_VARS}


class _Progress:
    """``[n/N]`` with elapsed time and an ETA, for logs where pytest's dots say nothing about time left.

    Works in a plain session and on the controller of ``pytest -n`` (reports arrive there from the
    workers; the ETA divides the remaining work by the number of workers).
    """

    CACHE_KEY = "fastvideo/durations"

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.every = config.getoption("--progress-every")
        self.workers = max(1, int(getattr(config.option, "numprocesses", 0) or 0))
        cache = getattr(config, "cache", None)
        self.known: dict[str, float] = (cache.get(self.CACHE_KEY, {}) if cache is not None else None) or {}
        try:
            self.per_file: dict[str, float] = json.loads(DURATIONS_TABLE.read_text())
        except (OSError, ValueError):
            self.per_file = {}
        self.durations: dict[str, float] = {}
        self.remaining: set[str] = set()
        self.total = self.done = 0
        self.start = self.last_print = time.monotonic()
        self.next_tenth = 1

    def _collected(self, nodeids: list[str]) -> None:
        if self.total:
            return  # pytest -n: every worker reports the same collection
        self.remaining, self.total = set(nodeids), len(nodeids)
        runs = sum(1 for nodeid in nodeids if re.search(r"\[.*\b(a2a|long)=", nodeid))
        self._write(f"{self.total} tests to run ({runs} are runs of ambient-marked tests, one per setting)")
        self.start = self.last_print = time.monotonic()

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        if session.items:  # empty on the pytest -n controller: the workers collect
            self._collected([item.nodeid for item in session.items])

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node, ids: list[str]) -> None:
        self._collected(list(ids))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.durations[report.nodeid] = self.durations.get(report.nodeid, 0.0) + report.duration
        if report.failed:  # named at once: a run cut by a time limit never reaches pytest's own summary
            self._write(f"FAILED {report.nodeid} ({report.when})")
        if report.when != "teardown" or not self.total:
            return
        self.done += 1
        self.remaining.discard(report.nodeid)
        now = time.monotonic()
        tenth = self.done * 10 >= self.next_tenth * self.total
        while self.done * 10 >= self.next_tenth * self.total:
            self.next_tenth += 1
        if tenth or now - self.last_print >= self.every:
            self.last_print = now
            self._write(f"[{self.done}/{self.total}] {_fmt(now - self.start)} elapsed, {self._eta()}")

    def _estimate(self, nodeid: str, mean: float) -> float:
        if nodeid in self.known:
            return self.known[nodeid]
        return self.per_file.get(nodeid.split("::")[0], mean)

    def _eta(self) -> str:
        if not self.remaining:
            return "done"
        mean = sum(self.durations.values()) / max(len(self.durations), 1)
        left = sum(self._estimate(nodeid, mean) for nodeid in self.remaining) / self.workers
        return f"about {_fmt(left)} left"

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        cache = getattr(self.config, "cache", None)
        if cache is not None and self.durations:
            cache.set(self.CACHE_KEY, {**self.known, **{k: round(v, 3) for k, v in self.durations.items()}})
        if self.config.getoption("--progress-save-table") and self.durations:
            files: dict[str, list[float]] = {}
            for nodeid, seconds in self.durations.items():
                files.setdefault(nodeid.split("::")[0], []).append(seconds)
            table = {name: round(sum(v) / len(v), 2) for name, v in sorted(files.items())}
            DURATIONS_TABLE.write_text(json.dumps(table, indent=1) + "\n")

    def _write(self, text: str) -> None:
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"progress: {text}")


def _fmt(seconds: float) -> str:
    seconds = max(0, round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s"
