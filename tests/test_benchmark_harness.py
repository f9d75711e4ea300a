"""The benchmark harness's own logic (``benchmarks/harness``): statistics, rotation, the table, the JSON schema and
its validation, the ``#wrong`` oracle, the command line, and the exit status of a run with a wrong row.

Each rule that guards a result has a negative control: a row without ``#wrong`` is refused, a corrupted output is
counted, an invalid document is reported, a run with a wrong row exits 1.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import types
from pathlib import Path

import pytest
import torch

from benchmarks.harness import cli, oracle, report, stats, timing, turns
from benchmarks.harness.case import Case, Context
from benchmarks.harness.progress import Progress
from tests.distributed import mp

# ---------------------------------------------------------------------------------------------- statistics


def test_summarize_median_spread_and_empty() -> None:
    s = stats.summarize([0.004, 0.001, 0.003, 0.002, 0.010])  # seconds
    assert s == {"median_ms": pytest.approx(3.0), "p10_ms": pytest.approx(1.0), "p90_ms": pytest.approx(10.0),
                 "min_ms": pytest.approx(1.0), "max_ms": pytest.approx(10.0), "n": 5}
    assert stats.summarize([2e-6], scale=1e6, unit="us")["median_us"] == pytest.approx(2.0)
    empty = stats.summarize([])
    assert empty["n"] == 0 and all(v is None for k, v in empty.items() if k != "n")
    assert stats.quantile(list(range(11)), 0.9) == 9 and stats.quantile([5], 0.5) == 5


def test_one_bandwidth_definition() -> None:
    # Bytes moved per rank = operand x (P - 1) / P: 1 GB over 1 s at P = 4 moves 0.75 GB.
    assert stats.bytes_moved_per_rank(1_000_000_000, 4) == 750_000_000
    assert stats.bandwidth_gbps(1_000_000_000, 4, 1.0) == pytest.approx(0.75)
    assert stats.bandwidth_gbps(1_000_000_000, 1, 1.0) == 0.0  # nothing crosses the fabric at P = 1
    assert stats.bandwidth_gbps(1_000_000_000, 2, None) is None
    assert stats.rate_gbps(2_000_000_000, 0.5) == pytest.approx(4.0)


def test_rotation_gives_every_contender_each_position() -> None:
    items = ["a", "b", "c"]
    rounds = [timing.rotated(items, r) for r in range(3)]
    assert rounds == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert all(sorted(col) == items for col in zip(*rounds))  # each item once in every position
    assert timing.rotated(items, 4) == rounds[1] and timing.rotated([], 2) == []


def test_aligned_times_from_the_last_entry() -> None:
    # Two ranks, three iterations, seconds on one clock.
    starts = torch.tensor([[0.0, 10.0, 20.0], [0.5, 10.0, 20.2]], dtype=torch.float64)
    ends = torch.tensor([[1.5, 11.0, 21.0], [1.4, 11.2, 21.1]], dtype=torch.float64)
    aligned, skew = timing.aligned_times(starts, ends)
    assert aligned == pytest.approx([1.0, 1.2, 0.9])  # last end - last start
    assert skew == pytest.approx([0.5, 0.0, 0.2])


def test_spin_rate_is_the_slope_of_two_spins() -> None:
    # Both spins carry the same fixed cost (launch, events): the slope leaves it out, one spin's ratio would not.
    fixed = 7e-6
    short_s, long_s = fixed + 200_000 / 1.5e9, fixed + 1_000_000 / 1.5e9
    assert timing.spin_rate(200_000, short_s, 1_000_000, long_s) == pytest.approx(1.5e9)
    assert 1_000_000 / long_s < 0.99 * 1.5e9
    with pytest.raises(ValueError, match="not longer"):
        timing.spin_rate(200_000, 1e-4, 1_000_000, 1e-4)  # the longer spin took no longer
    with pytest.raises(ValueError):
        timing.spin_rate(1_000_000, 1e-4, 200_000, 5e-4)  # the lengths swapped


def test_spin_cycles_cover_the_host_time_with_a_floor() -> None:
    rate = 2e9
    assert timing.spin_cycles(rate, 30e-6) == round(rate * 4 * 30e-6)  # SPIN_COVER times the host time
    assert timing.spin_cycles(rate, 1e-6) == round(rate * 50e-6)  # below the floor: the floor
    assert timing.spin_cycles(rate, 0.0) == round(rate * timing.SPIN_FLOOR_S)
    assert timing.spin_cycles(rate, 30e-6, cover=2.0, floor_s=10e-6) == round(rate * 60e-6)
    for host_s in (0.0, 3e-6, 40e-6, 2e-3):
        cycles = timing.spin_cycles(1.7e9, host_s)
        assert cycles / 1.7e9 >= max(timing.SPIN_COVER * host_s, timing.SPIN_FLOOR_S) * (1 - 1e-12)
    with pytest.raises(ValueError):
        timing.spin_cycles(0.0, 30e-6)  # no rate measured
    with pytest.raises(ValueError):
        timing.spin_cycles(2e9, -1e-6)


def test_held_samples_retake_an_iteration_with_the_spin_doubled() -> None:
    seen = []

    def sample(cycles: int) -> tuple[int, bool]:
        seen.append(cycles)
        return cycles, cycles >= 1000  # the spin holds from 1000 cycles on

    values, cycles, doubled = timing.held_samples(sample, 100, iters=3, max_cycles=10_000)
    assert values == [1600, 1600, 1600]  # only iterations that held are kept
    assert (cycles, doubled) == (1600, 4) and seen == [100, 200, 400, 800, 1600, 1600, 1600]
    assert timing.held_samples(sample, 1000, iters=2, max_cycles=1000) == ([1000, 1000], 1000, 0)
    with pytest.raises(RuntimeError, match="waits for the device"):
        timing.held_samples(lambda c: (c, False), 100, iters=1, max_cycles=10_000)  # never holds: refused


def test_busy_device_seconds_spins_before_the_start_event_and_checks_it_is_pending(monkeypatch) -> None:
    calls = []

    class Event:
        def __init__(self, name: str, fired: bool) -> None:
            self.name, self.fired = name, fired

        def record(self) -> None:
            calls.append(f"{self.name}.record")

        def query(self) -> bool:
            calls.append(f"{self.name}.query")
            return self.fired

        def synchronize(self) -> None:
            calls.append(f"{self.name}.synchronize")

        def elapsed_time(self, other: Event) -> float:
            return 2.5  # ms

    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: calls.append(f"sleep {cycles}"))
    events = (Event("start", False), Event("end", False))
    seconds, held = timing._busy_device_seconds(lambda: calls.append("fn"), events, 1234)
    assert (seconds, held) == (pytest.approx(2.5e-3), True)
    assert calls == ["sleep 1234", "start.record", "fn", "end.record", "start.query", "end.synchronize"]
    calls.clear()
    _, held = timing._busy_device_seconds(lambda: None, (Event("start", True), Event("end", True)), 1234)
    assert held is False  # the start event had fired: the spin ended before the work was queued


def test_busy_overhead_on_cpu_keeps_the_host_time_of_the_call() -> None:
    import time

    def host_fn() -> None:
        time.sleep(2e-3)

    out = timing.busy_overhead(host_fn, lambda: None, torch.device("cpu"), iters=4, warmup=1)
    assert len(out["overhead"]) == len(out["device"]) == 4
    assert all(o >= 2e-3 for o in out["overhead"]) and all(d >= 0 for d in out["device"])
    assert (out["spin_s"], out["spin_doubled"]) == (0.0, 0)


def test_progress_lines(capsys: pytest.CaptureFixture[str]) -> None:
    p = Progress(4, every_s=3600.0)
    p.advance("first")
    assert p.lines == []  # not yet due
    p.advance("second", units=3)
    assert p.lines == [p.lines[0]] and p.lines[0].startswith("# progress: [4/4] second, elapsed")
    assert "left" not in p.lines[0]  # the last unit says no time left
    silent = Progress(1, every_s=0.0, enabled=False)
    silent.advance("x")
    assert silent.lines == [] and capsys.readouterr().out.count("# progress") == 1


# ---------------------------------------------------------------------------------------------- #wrong


def test_bitwise_diff_counts_a_corrupted_element() -> None:
    a = torch.randn(4, 8).to(torch.bfloat16)
    assert oracle.count_bitwise_diff(a, a.clone()) == 0
    bad = a.clone()
    bad.view(-1)[5] += 1  # the negative control
    assert oracle.count_bitwise_diff(a, bad) == 1
    nan = torch.full((3,), float("nan"))
    other = nan.view(torch.int32).clone()
    other[1] ^= 1  # a different NaN payload: equal as floats never, different bits here
    assert oracle.count_bitwise_diff(nan, other.view(torch.float32)) == 1
    assert oracle.count_bitwise_diff(a, a.float()) == a.numel()  # a dtype mismatch counts every element
    assert oracle.count_bitwise_diff(a, a.reshape(8, 4)) == a.numel()


def test_count_beyond_a_threshold() -> None:
    a = torch.zeros(10)
    b = a.clone()
    b[2], b[3], b[4] = 1e-9, 1e-3, float("nan")
    assert oracle.count_beyond(a, b, 1e-6) == 2  # 1e-3 and the NaN
    assert oracle.count_beyond(a, b, 1.0) == 1  # the NaN always counts


def test_make_input_is_deterministic() -> None:
    x = oracle.make_input((2, 3), torch.bfloat16, torch.device("cpu"), 7)
    assert torch.equal(x, oracle.make_input((2, 3), torch.bfloat16, torch.device("cpu"), 7))
    assert not torch.equal(x, oracle.make_input((2, 3), torch.bfloat16, torch.device("cpu"), 8))
    assert oracle.make_input((5,), torch.uint8, torch.device("cpu"), 1).dtype == torch.uint8


# ---------------------------------------------------------------------------------------------- rows, table, JSON


def test_a_row_must_say_what_was_wrong() -> None:
    report.check_row({"wrong": 0, "wrong_oracle": "the input"})
    report.check_row({"skipped": "no GPU", "wrong": None, "wrong_oracle": "not run"})
    report.check_row({"wrong": None, "wrong_oracle": "none", "wrong_note": "pushes land in peers' windows"})
    for bad, match in (({"wrong_oracle": "x"}, "without 'wrong'"), ({"wrong": 0}, "without 'wrong'"),
                       ({"wrong": -1, "wrong_oracle": "x"}, "count >= 0"),
                       ({"wrong": True, "wrong_oracle": "x"}, "count >= 0"),
                       ({"wrong": 0, "wrong_oracle": ""}, "compared with"),
                       ({"wrong": None, "wrong_oracle": "x"}, "wrong_note")):
        with pytest.raises(ValueError, match=match):
            report.check_row(bad)


def test_table_lines_cells_skips_and_the_wrong_column() -> None:
    columns = (report.Column("name", "name"), report.Column("ms", "median"),
               report.Column("frac", "pct", fmt=".1f", scale=100.0), report.Column("n", "n"),
               report.Column("ok", "ok"), report.Column("both", "both", get=lambda r: f"{r['name']}/{r['n']}"))
    rows = [{"name": "a", "ms": 1.23456, "frac": 0.5, "n": 3, "ok": True, "wrong": 0, "wrong_oracle": "oracle A"},
            {"name": "b", "ms": None, "frac": None, "n": 4, "ok": False, "wrong": 2, "wrong_oracle": "oracle A"},
            {"name": "c", "skipped": "needs 2 GPUs", "wrong": None, "wrong_oracle": "not run"}]
    lines = report.table_lines(columns, rows, details=lambda r: [f"plan of {r['name']}"])
    assert lines[0].split() == ["name", "median", "pct", "n", "ok", "both", "#wrong"]
    assert lines[1].split() == ["a", "1.235", "50.0", "3", "yes", "a/3", "0"]
    assert lines[2].strip() == "plan of a"
    assert lines[3].split() == ["b", "-", "-", "4", "NO", "b/4", "2"]
    assert lines[5].split(None, 1) == ["c", "skipped: needs 2 GPUs"]
    assert lines[-1] == "# #wrong: oracle A"  # the oracle of the rows that ran, once


def test_document_validation_and_its_negative_controls(tmp_path: Path) -> None:
    from benchmarks.harness.header import REQUIRED, SCHEMA

    header = {k: None for k in REQUIRED} | {"schema": SCHEMA, "native_library": {"path": "/x.so", "sha256": "ab"}}
    doc = report.document(header, [{"wrong": 0, "wrong_oracle": "o"}], {"extra": 1})
    path = tmp_path / "sub" / "run.json"
    report.write_json(str(path), doc)
    loaded = json.loads(path.read_text())
    assert report.validate(loaded) == [] and loaded["extra"] == 1 and loaded["schema"] == SCHEMA
    assert not path.with_name("run.json.tmp").exists()
    broken = json.loads(path.read_text())
    del broken["header"]["commit"]
    broken["header"]["native_library"] = "/x.so"
    broken["rows"].append({"wrong": 3})
    problems = report.validate(broken)
    assert any("commit" in p for p in problems) and any("native_library" in p for p in problems)
    assert any(p.startswith("row 1:") for p in problems)
    assert report.validate({"schema": "other"})[0].startswith("schema")


def test_header_names_what_ran() -> None:
    from benchmarks.harness.commit import tree_commit
    from benchmarks.harness.header import REQUIRED, build_header

    header = build_header(torch.device("cpu"), 1, case="x", extra={"mine": 1})
    assert set(REQUIRED) <= set(header) and header["mine"] == 1 and header["case"] == "x"
    lib = header["native_library"]
    assert header["complete"] is False and (lib is None or "sha256" in lib)
    assert tree_commit(Path("/nonexistent-tree")) == "unknown"


def test_command_line_exact_when_the_harness_launched(monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks.harness import process

    monkeypatch.setenv(process.COMMAND_ENV, "python -m benchmarks.run a2a --nproc 2")
    assert process.command_line() == ("python -m benchmarks.run a2a --nproc 2", "exact")
    monkeypatch.delenv(process.COMMAND_ENV)
    for name, value in (("LOCAL_RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_WORLD_SIZE", "2"),
                        ("TORCHELASTIC_RUN_ID", "x")):
        monkeypatch.setenv(name, value)
    command, source = process.command_line()
    assert command.startswith("torchrun --nproc_per_node=2 ") and source.startswith("reconstructed")


# ---------------------------------------------------------------------------------------------- command line


def test_geometries_and_argv() -> None:
    assert cli.parse_geometry("h3-32k") == ("h3-32k", (3, 32768, 56, 128))
    assert cli.parse_geometry("2,64,4,8") == ("2x64x4x8", (2, 64, 4, 8))
    for bad in ("h3", "1,2,3", "1,0,4,8"):
        with pytest.raises(Exception, match="--geometry"):
            cli.parse_geometry(bad)
    assert cli.input_shape((3, 64, 8, 32), 0, 2) == (3, 32, 8, 32)
    assert cli.input_shape((3, 64, 8, 32), 1, 2) == (3, 64, 4, 32)
    assert cli.divisible((1, 75600, 40, 128), 3) and cli.divisible((1, 75600, 40, 128), 2) is None
    assert cli.parse_modes("0,1") == [0, 1]
    with pytest.raises(SystemExit, match="--modes"):
        cli.parse_modes("2")
    argv = ["--compare-revs", "A", "B", "--rounds=3", "--nproc", "2", "--", "--geometry", "toy", "--json", "x"]
    assert cli.child_argv(argv) == ["--geometry", "toy"]
    assert cli.child_argv(["--nproc", "2", "--quick"], {"--nproc": 1}) == ["--quick"]


def test_parse_applies_case_defaults_quick_and_bounds() -> None:
    from benchmarks.harness.main import parse

    class Toy(Case):
        name = "toy"
        defaults = {"iters": 7}  # noqa: RUF012 - a test's case
        quick = {"iters": 2, "repeat": 2}  # noqa: RUF012

    assert parse(Toy(), []).iters == 7
    quick = parse(Toy(), ["--quick"])
    assert (quick.iters, quick.repeat) == (2, 2)
    for flag in ("--iters", "--rounds"):  # --rounds 0 ran no round and then read round 0
        with pytest.raises(SystemExit):
            parse(Toy(), [flag, "0"])


def test_context_refuses_a_row_without_wrong() -> None:
    ctx = Context(Case(), None, 0, 1, torch.device("cpu"))
    ctx.add_row({"x": 1, "wrong": 0, "wrong_oracle": "o"})
    ctx.skip("why", x=2)
    assert ctx.rows[1] == {"x": 2, "skipped": "why", "wrong": None, "wrong_oracle": "not run"}
    with pytest.raises(ValueError):
        ctx.add_row({"x": 3})


def test_a_named_request_that_cannot_run_stops_the_run_a_default_one_is_noted() -> None:
    case = Case()
    case.name = "toy"
    ctx = Context(case, None, 0, 1, torch.device("cpu"))
    ctx.unavailable("--vote shm", "no library", named=False)
    assert ctx.notes == ["--vote shm skipped (in the default set, not asked for by name): no library"]
    with pytest.raises(SystemExit, match=r"^toy: --vote shm was asked for but cannot run here: no library$"):
        ctx.unavailable("--vote shm", "no library", named=True)


# ---------------------------------------------------------------------------------------------- a whole run


class WrongCase(Case):
    """A case whose second row counts one wrong element on each rank (a run's negative control)."""

    name = "wrong_toy"
    key = ("i",)
    columns = (report.Column("i", "i"),)

    def run(self, ctx: Context) -> None:
        for i in range(2):
            x = torch.arange(8.0)
            y = x.clone()
            if i == 1:
                y[3] = -1.0
            ctx.add_row({"i": i, "wrong": timing.rank_sum(oracle.count_bitwise_diff(y, x)),
                         "wrong_oracle": "arange(8)"})


CASE = WrongCase()


def _run_wrong_case(rank: int, world_size: int, json_path: str) -> tuple[int, str]:
    from benchmarks.harness import case, main

    case.CASES["wrong_toy"] = __name__  # this module's CASE
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main.main(["wrong_toy", "--device", "cpu", "--json", json_path])
    return status, out.getvalue()


@pytest.mark.timeout(120)
def test_a_run_with_a_wrong_row_exits_1(tmp_path: Path) -> None:
    path = tmp_path / "wrong.json"
    results = mp.run_ranks(2, _run_wrong_case, str(path), timeout_s=100)
    assert [status for status, _ in results] == [1, 1]
    printed = results[0][1]
    assert "# WRONG: 2 element(s): i=1" in printed and printed.index("#wrong") < printed.index("# WRONG")
    doc = json.loads(path.read_text())
    assert report.validate(doc) == [] and [r["wrong"] for r in doc["rows"]] == [0, 2]
    assert doc["header"]["complete"] and doc["header"]["lineup"]["kind"] == "none"  # nothing timed, no line-up


def _compare_toy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake_popen: type, rounds: int,
                 within: tuple[float, float] | None) -> tuple[int, str, dict]:
    """``revs.compare`` of a toy case (key ``k``, metric ``m``) over two stand-in trees, ``tmp_path/a`` (A) and
    ``tmp_path/b`` (B), with ``fake_popen`` as the launcher: (exit status, what it printed, its JSON document)."""
    import argparse
    import types

    from benchmarks.harness import revs

    for name in ("a", "b"):
        (tmp_path / name / "fastvideo").mkdir(parents=True, exist_ok=True)
    monkeypatch.setattr(revs.subprocess, "Popen", fake_popen)
    case = types.SimpleNamespace(name="toy", key=("k",), metric="m", saves_outputs=False, takes_turns=False,
                                 lane=lambda row: "toy lane")
    args = argparse.Namespace(compare_revs=[str(tmp_path / "a"), str(tmp_path / "b")], tree_libraries=False,
                              compare_out=str(tmp_path / "work"), nproc=1, rounds=rounds, json=str(tmp_path / "c.json"),
                              within=within)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = revs.compare(case, args, [], "run.py", [])
    return status, printed.getvalue(), json.loads((tmp_path / "c.json").read_text())


def _fake_label(cwd) -> str:
    """The tree a fake run was started in: A for ``_compare_toy``'s ``a``, else B."""
    return "A" if Path(cwd).name == "a" else "B"


def test_compare_revs_alternates_which_tree_runs_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--compare-revs runs A then B in even rounds and B then A in odd ones, so neither tree always runs second
    (after the other has warmed the host): the order the runs are started in, recorded from a fake launcher. A
    case that does not take turns runs one tree at a time (each run has ended before the next starts)."""
    started: list[str] = []
    running: list[str] = []

    class FakeRun:
        def __init__(self, cmd, env, cwd, stdout, stderr, preexec_fn) -> None:
            assert not running, f"{running} still running as another run starts"
            assert preexec_fn is None  # a case that does not take turns runs where the scheduler puts it
            self.label = _fake_label(cwd)
            started.append(self.label)
            running.append(self.label)
            out = Path(cmd[cmd.index("--json") + 1])
            rows = [{"k": 1, "m": 2.0}, {"k": 2, "m": -1.0 if self.label == "A" else 2.0}]
            out.write_text(json.dumps({"header": {"commit": self.label}, "rows": rows}))

        def wait(self) -> int:
            if self.label in running:
                running.remove(self.label)
            return 0

    status, printed, doc = _compare_toy(tmp_path, monkeypatch, FakeRun, 4, (0.5, 10.0))
    assert status == 0
    assert started == ["A", "B", "B", "A", "A", "B", "B", "A"]
    # A ratio to a non-positive A is none; the row is still bounded
    assert [r["ratio_b_over_a"] for r in doc["rows"]] == [1.0, None]
    assert len(doc["runs"]["A"]) == len(doc["runs"]["B"]) == 4
    assert doc["header"]["interleaved"] is False and "turn_orders" not in doc["header"]
    assert [r["within"] for r in doc["rows"]] == [True, False]
    assert doc["header"]["within_counts"] == {"toy lane": [1, 2]}
    assert "B within max(0.5, 10 % of A) of A: toy lane 1 of 2" in printed


def test_compare_revs_reports_each_rows_spread_across_rounds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Beside each row's medians, each tree's spread across its rounds (max - min), and per lane the median row's:
    what a single row's difference is read against. One round has no spread (None, no lane line)."""

    class FakeRun:
        def __init__(self, cmd, env, cwd, stdout, stderr, preexec_fn) -> None:
            out = Path(cmd[cmd.index("--json") + 1])
            rnd = int(out.stem[1:])  # <label><round>.json
            step = 1.0 if _fake_label(cwd) == "A" else 0.25
            rows = [{"k": 1, "m": 2.0 + step * rnd}, {"k": 2, "m": 10.0 - step * rnd * rnd}]
            out.write_text(json.dumps({"header": {"commit": _fake_label(cwd)}, "rows": rows}))

        def wait(self) -> int:
            return 0

    status, printed, doc = _compare_toy(tmp_path, monkeypatch, FakeRun, 3, None)
    assert status == 0
    assert [(r["a_m_spread"], r["b_m_spread"]) for r in doc["rows"]] == [(2.0, 0.5), (4.0, 1.0)]
    assert doc["header"]["round_spreads"] == {"toy lane": [3.0, 0.75]}
    assert "(max - min of a row's rounds; each lane's median row): toy lane A 3 / B 0.75" in printed
    status, printed, doc = _compare_toy(tmp_path, monkeypatch, FakeRun, 1, None)
    assert [(r["a_m_spread"], r["b_m_spread"]) for r in doc["rows"]] == [(None, None)] * 2
    assert "round_spreads" not in doc["header"] and "spread across rounds" not in printed


def test_compare_revs_fails_where_a_run_failed_or_lost_a_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run that exits 1 with a wrong row and a reported failure, and a row A measured that B did not (skipped
    there): the comparison prints each and exits 1, its header listing them; a row only B has is noted, not
    failed. The control (both runs clean, the same rows) exits 0."""
    from benchmarks.harness import revs

    def compare(b_rows, b_code=0, b_header=None):
        class FakeRun:
            def __init__(self, cmd, env, cwd, stdout, stderr, preexec_fn) -> None:
                b = _fake_label(cwd) == "B"
                self.code = b_code if b else 0
                rows = b_rows if b else [{"k": 1, "m": 2.0, "wrong": 0}, {"k": 2, "m": 3.0, "wrong": 0}]
                header = {"commit": "B" if b else "A", "complete": True, **((b_header or {}) if b else {})}
                Path(cmd[cmd.index("--json") + 1]).write_text(json.dumps({"header": header, "rows": rows}))

            def wait(self) -> int:
                return self.code

        status, printed, doc = _compare_toy(tmp_path, monkeypatch, FakeRun, 1, None)
        return status, printed, doc["header"]["failures"]

    clean = [{"k": 1, "m": 2.0, "wrong": 0}, {"k": 2, "m": 3.0, "wrong": 0}, {"k": 3, "m": 1.0, "wrong": 0}]
    status, printed, failures = compare(clean)
    assert status == 0 and failures == [] and "# measured in B only: {'k': 3}" in printed
    bad = [{"k": 1, "m": 2.0, "wrong": 5}, {"k": 2, "m": None, "wrong": None, "skipped": "no helper"}]
    status, printed, failures = compare(bad, 1, {"failures": ["a check failed"]})
    assert status == 1
    assert failures == ["B0 exited 1", "B0: 1 row(s) with wrong output", "B0: a check failed",
                        "measured in A, not in B: {'k': 2}"]
    assert all(f"# FAILED: {why}" in printed for why in failures)
    assert revs.run_failures("A0", 0, {"header": {"complete": False}, "rows": []}) == ["A0 did not complete"]
    assert revs.one_sided({(1,): 1.0, (2,): 0.0}, {(1,): 1.0, (3,): 2.0}) == ([(2,)], [(3,)])




def test_compare_revs_stopped_part_way_keeps_the_rounds_it_finished(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A comparison whose third round fails (as a run stopped by a time limit does) has written its first two
    rounds' comparison, marked incomplete; a merge takes them with a note. A whole run ends complete."""
    from benchmarks.harness import revs

    fail_round = [2]

    class FakeRun:
        def __init__(self, cmd, env, cwd, stdout, stderr, preexec_fn) -> None:
            out = Path(cmd[cmd.index("--json") + 1])
            self.code = 2 if int(out.stem[1:]) == fail_round[0] else 0
            if not self.code:
                header = {"commit": _fake_label(cwd), "case": "toy", "complete": True}
                out.write_text(json.dumps({"header": header, "rows": [{"k": 1, "m": 1.0}]}))

        def wait(self) -> int:
            return self.code

    with pytest.raises(SystemExit, match="run A2 failed with exit code 2"):
        _compare_toy(tmp_path, monkeypatch, FakeRun, 4, None)
    doc = json.loads((tmp_path / "c.json").read_text())
    assert doc["header"]["complete"] is False and doc["header"]["rounds"] == 2 and len(doc["runs"]["B"]) == 2
    case = types.SimpleNamespace(name="toy", key=("k",), metric="m", saves_outputs=False, lane=lambda row: "lane")
    args = argparse.Namespace(compare_merge=[str(tmp_path / "c.json")], within=None, json=str(tmp_path / "m.json"))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert revs.merge(case, args) == 0
    assert "c.json stopped after 2 round(s) (complete: false); they are merged" in printed.getvalue()
    assert json.loads((tmp_path / "m.json").read_text())["header"]["complete"] is True
    fail_round[0] = None
    assert _compare_toy(tmp_path, monkeypatch, FakeRun, 4, None)[2]["header"]["complete"] is True

def test_compare_merge_compares_the_rounds_of_several_parts_as_one(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """An A/B split over two runs (two rounds each, A's metric 1..4 over the four rounds, B's 0.5 above) merges
    into one comparison of four rounds: the medians and spreads over all of them, --within re-judged, the parts
    named; a part whose run failed fails the merge under its file's name. Refused, naming the file: a part of
    other commits, a JSON that is no comparison. Through the CLI (``--compare-merge``) on a real case's rows."""
    from benchmarks.harness import revs
    from benchmarks.harness.main import main

    made = iter(range(100))

    class FakeRun:
        def __init__(self, cmd, env, cwd, stdout, stderr, preexec_fn) -> None:
            value = 1.0 + next(made) // 2 + (0.5 if _fake_label(cwd) == "B" else 0.0)  # A and B of a round alike
            header = {"commit": _fake_label(cwd), "case": "toy", "complete": True, "host": "h1"}
            doc = {"header": header, "rows": [{"k": 1, "m": value}]}
            Path(cmd[cmd.index("--json") + 1]).write_text(json.dumps(doc))

        def wait(self) -> int:
            return 0

    parts = []
    for n in range(2):
        status, printed, doc = _compare_toy(tmp_path, monkeypatch, FakeRun, 2, (0.5, 10.0))
        assert status == 0 and doc["header"]["rounds"] == 2 and doc["header"]["run_failures"] == []
        parts.append(tmp_path / f"part{n}.json")
        parts[-1].write_text(json.dumps(doc))
    assert [r["m"] for run in json.loads(parts[1].read_text())["runs"]["A"] for r in run["rows"]] == [3.0, 4.0]
    case = types.SimpleNamespace(name="toy", key=("k",), metric="m", saves_outputs=False, lane=lambda row: "lane")

    def merge(files, within=(0.1, 0.0)):
        args = argparse.Namespace(compare_merge=[str(f) for f in files], within=within, json=str(tmp_path / "m.json"))
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            status = revs.merge(case, args)
        return status, printed.getvalue(), json.loads((tmp_path / "m.json").read_text())

    status, printed, doc = merge(parts)
    assert status == 0 and doc["rows"][0]["within"] is False  # B 0.5 above A, over the 0.1 bound: marked
    status, printed, doc = merge(parts, (0.5, 0.0))
    assert status == 0 and doc["header"]["rounds"] == 4 and len(doc["runs"]["B"]) == 4
    row = doc["rows"][0]
    assert (row["a_m"], row["b_m"], row["a_m_spread"], row["b_m_spread"], row["within"]) == (2.5, 3.0, 3.0, 3.0, True)
    assert doc["header"]["merged_from"] == [str(p) for p in parts] and doc["header"]["hosts"] == ["h1"]
    assert "part0.json (2 rounds), " in printed and "rounds 4" in printed

    failed = json.loads(parts[1].read_text())
    failed["header"]["run_failures"] = ["B1 exited 3"]
    (tmp_path / "failed.json").write_text(json.dumps(failed))
    status, printed, doc = merge([parts[0], tmp_path / "failed.json"], (0.5, 0.0))
    assert status == 1 and doc["header"]["failures"] == [f"{tmp_path / 'failed.json'}: B1 exited 3"]

    other = json.loads(parts[1].read_text())
    other["header"]["commit_b"] = "C"
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(SystemExit, match=r"other\.json's commit_b 'C' differs from .*part0\.json's 'B'"):
        merge([parts[0], tmp_path / "other.json"])
    (tmp_path / "plain.json").write_text(json.dumps({"header": {"case": "toy"}, "rows": []}))
    with pytest.raises(SystemExit, match=r"plain\.json is not a --compare-revs JSON of case toy"):
        merge([parts[0], tmp_path / "plain.json"])

    # The CLI: a real case's rows (its key and lanes), one part each way round
    rows = [{"geometry": "g", "mode": 0, "label": "floor copy", "paired_us": 1.0}]
    real = {"header": {"case": "fused_host_overhead", "commit": "x", "commit_a": "x", "commit_b": "y",
                       "bench_argv": [], "host": "h"},
            "runs": {"A": [{"header": {"commit": "x"}, "rows": rows}],
                     "B": [{"header": {"commit": "y"}, "rows": [dict(rows[0], paired_us=1.2)]}]}}
    (tmp_path / "real.json").write_text(json.dumps(real))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = main(["--compare-merge", str(tmp_path / "real.json"), str(tmp_path / "real.json"), "--within",
                       "0.5,10", "--json", str(tmp_path / "cli.json")], case_name="fused_host_overhead")
    assert status == 0 and "floor 1 of 1" in printed.getvalue()
    assert json.loads((tmp_path / "cli.json").read_text())["header"]["rounds"] == 2
    with pytest.raises(SystemExit, match="exclude each other"):
        main(["--compare-merge", "x.json", "--compare-revs", "a", "b"], case_name="fused_host_overhead")

def test_within_bounds_b_against_a_by_the_larger_of_the_two_bounds() -> None:
    """B may exceed A by max(ABS, PCT % of A), no more; a lower B is always within; counts go per lane. The flag
    refuses what is not two non-negative numbers, naming itself."""
    from benchmarks.harness import revs

    bound = (0.5, 10.0)
    assert revs.within(4.0, 4.5, bound) and not revs.within(4.0, 4.51, bound)  # 0.5 us over 10 %'s 0.4 us
    assert revs.within(10.0, 11.0, bound) and not revs.within(10.0, 11.01, bound)  # 10 % over 0.5 us
    assert revs.within(10.0, 1.0, bound) and revs.within(0.0, 0.5, bound) and not revs.within(0.0, 0.6, bound)
    assert revs.ratio(4.0, 5.0) == 1.25 and revs.ratio(0.0, 5.0) is None and revs.ratio(-1.0, 5.0) is None
    rows = [{"lane": "hot", "within": True}, {"lane": "hot", "within": False}, {"lane": "floor", "within": True}]
    assert revs.within_counts(rows, lambda row: row["lane"]) == {"hot": [1, 2], "floor": [1, 1]}
    assert cli.parse_bound("0.5,10") == (0.5, 10.0)
    for text in ("0.5", "a,b", "-1,10", "0.5,10,3"):
        with pytest.raises(SystemExit, match="--within"):
            cli.parse_bound(text)


def test_paired_difference_cancels_a_rounds_swing_and_still_catches_a_shift(tmp_path: Path) -> None:
    """Each row also carries the median over rounds of B - A, A's and B's runs of a round paired (they ran together):
    a host swing that lifts a round's A and B alike cancels there, where the difference of the two medians reads it
    as B's (row 1: not within, paired within); a constant shift of B is caught either way (row 2, the negative
    control); a round where one run has no value for the row is left out of its pairs (row 3)."""
    from benchmarks.harness import revs

    a = {1: [4.0, 4.0, 8.0], 2: [4.0, 4.0, 8.0], 3: [4.0, 4.0, 8.0]}
    b = {1: [4.1, 8.1, 8.1], 2: [5.0, 5.0, 9.0], 3: [None, 9.0, 8.2]}

    def run(values: dict, rnd: int, commit: str) -> dict:
        return {"header": {"commit": commit}, "rows": [{"k": k, "m": v[rnd]} for k, v in values.items()]}

    runs = {"A": [run(a, r, "x") for r in range(3)], "B": [run(b, r, "y") for r in range(3)]}
    assert revs.round_differences(runs, "m", ("k",)) == {(1,): pytest.approx([0.1, 4.1, 0.1]),
                                                         (2,): pytest.approx([1.0, 1.0, 1.0]),
                                                         (3,): pytest.approx([5.0, 0.2])}
    case = types.SimpleNamespace(name="toy", key=("k",), metric="m", saves_outputs=False, lane=lambda row: "lane")
    args = argparse.Namespace(within=(0.5, 10.0), json=str(tmp_path / "c.json"))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert revs.summarize(case, args, runs, [], {}, []) == 0
    rows = {row["k"]: row for row in json.loads((tmp_path / "c.json").read_text())["rows"]}
    assert rows[1]["paired_diff_m"] == pytest.approx(0.1) and (rows[1]["within"], rows[1]["within_paired"]) == (
        False, True)
    assert rows[2]["paired_diff_m"] == pytest.approx(1.0) and (rows[2]["within"], rows[2]["within_paired"]) == (
        False, False)
    assert rows[3]["paired_diff_m"] == pytest.approx(2.6)
    header = json.loads((tmp_path / "c.json").read_text())["header"]
    assert header["within_paired_counts"] == {"lane": [1, 3]} and header["within_counts"] == {"lane": [0, 3]}
    assert "paired by round (the median of each round's B - A) within max(0.5, 10 % of A): lane 1 of 3" in (
        printed.getvalue())


# ---------------------------------------------------------------------------------------------- turns

# A run that takes ROWS turns, each timed row a short sleep, and logs its rows' (start, end) on the system-wide
# monotonic clock; CRASH_AFTER: it dies after that many rows without saying it is finished; TOGETHER (a directory,
# without a conductor): it waits for the other run before its first row.
_TURN_RUN = r"""
import os, sys, time
from benchmarks.harness import turns
log = open(sys.argv[1], "w")
if os.environ.get("TOGETHER"):  # no conductor: both runs start their rows together (a file barrier)
    open(os.path.join(os.environ["TOGETHER"], os.path.basename(sys.argv[1])), "w").close()
    while len(os.listdir(os.environ["TOGETHER"])) < 2:
        time.sleep(0.001)
for row in range(int(os.environ["ROWS"])):
    if row == int(os.environ.get("CRASH_AFTER", -1)):
        os._exit(3)
    turns.take()
    start = time.monotonic()
    time.sleep(0.02)
    log.write(f"{start} {time.monotonic()}\n")
    log.flush()
print("taken", turns.taken())
turns.finish()
"""


def _turn_runs(tmp_path: Path, conduct: bool, rows: dict[str, int], crash: dict[str, int] | None = None):
    """Start one ``_TURN_RUN`` per label together (under a conductor or not): (each run's logged rows, its
    exit status, the order the turns were given)."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    labels = list(rows)
    tmp_path.mkdir(parents=True, exist_ok=True)

    def start(label: str, extra: dict[str, str]) -> subprocess.Popen:
        env = dict(os.environ, ROWS=str(rows[label]), **extra)
        if crash and label in crash:
            env["CRASH_AFTER"] = str(crash[label])
        return subprocess.Popen([sys.executable, "-c", _TURN_RUN, str(tmp_path / f"{label}.log")], cwd=root,
                                env=env, stdout=subprocess.PIPE, text=True)

    order: list[str] = []
    if conduct:
        with turns.Conductor(tmp_path / "turns", labels) as conductor:
            procs = {label: start(label, conductor.env(label)) for label in labels}
            conductor.run(procs)
            order = conductor.order
    else:
        (tmp_path / "together").mkdir()
        procs = {label: start(label, {"TOGETHER": str(tmp_path / "together")}) for label in labels}
    codes = {label: procs[label].wait(timeout=60) for label in labels}
    logged = {label: [tuple(map(float, line.split())) for line in (tmp_path / f"{label}.log").read_text().split("\n")
                      if line] for label in labels}
    return logged, codes, order


def _overlaps(logged: dict[str, list[tuple[float, float]]]) -> int:
    """How many pairs of rows of different runs overlap in time."""
    rows_a, rows_b = logged.values()
    return sum(1 for s1, e1 in rows_a for s2, e2 in rows_b if s1 < e2 and s2 < e1)


@pytest.mark.timeout(120)
def test_turns_let_one_run_at_a_time_time_a_row_in_alternation(tmp_path: Path) -> None:
    """Under a conductor two runs started together never time a row at the same time, and the turns alternate
    with the leader swapping every step (A B B A A B ...). Negative control: the same two runs without a
    conductor overlap, so the overlap check can fail."""
    logged, codes, order = _turn_runs(tmp_path, True, {"A": 6, "B": 6})
    assert codes == {"A": 0, "B": 0} and [len(v) for v in logged.values()] == [6, 6]
    assert _overlaps(logged) == 0
    assert "".join(order) == "ABBA" * 3  # a turn per row; the last one's hand-back is the word that it finished
    assert not (tmp_path / "turns").exists()  # the channels go with the round
    free, codes, _ = _turn_runs(tmp_path / "free", False, {"A": 6, "B": 6})
    assert codes == {"A": 0, "B": 0} and _overlaps(free) > 0


@pytest.mark.timeout(120)
def test_turns_go_on_alone_when_a_run_dies_or_finishes_first(tmp_path: Path) -> None:
    """A run that dies mid-way (no word to the conductor) or finishes first is dropped and the other takes its
    remaining turns alone: no hang, every row of the survivor timed, none overlapping."""
    logged, codes, order = _turn_runs(tmp_path, True, {"A": 5, "B": 5}, crash={"B": 2})
    assert codes == {"A": 0, "B": 3} and [len(v) for v in logged.values()] == [5, 2] and _overlaps(logged) == 0
    assert order.count("A") == 5 and order.count("B") == 2  # B died in its second turn, before handing it back
    logged, codes, order = _turn_runs(tmp_path / "short", True, {"A": 2, "B": 5})
    assert codes == {"A": 0, "B": 0} and [len(v) for v in logged.values()] == [2, 5] and _overlaps(logged) == 0


@pytest.mark.timeout(60)
def test_a_run_whose_conductor_is_gone_exits_instead_of_waiting(tmp_path: Path) -> None:
    """The conductor's end of a run's channel closes (the parent died): the run, waiting for its turn, reads the
    end of the channel and exits nonzero, naming it."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    with turns.Conductor(tmp_path / "turns", ["A"]) as conductor:
        proc = subprocess.Popen([sys.executable, "-c", _TURN_RUN, str(tmp_path / "A.log")], cwd=root,
                                env=dict(os.environ, ROWS="3", **conductor.env("A")), stderr=subprocess.PIPE,
                                text=True)
        assert conductor._handed_back("A", proc)  # it is set up and waits for its first turn
    _, err = proc.communicate(timeout=30)
    assert proc.returncode != 0 and "the conductor of this run's turns is gone" in err


def test_turns_pin_both_runs_to_the_highest_cpus() -> None:
    """Both runs of a round share the highest CPUs the parent may use; all of them where there are fewer; none
    for 0 (no pinning); a negative count is refused naming the flag."""
    assert turns.shared_cpus({0, 3, 7, 12, 15}, 2) == [12, 15]
    assert turns.shared_cpus({4, 1}, 3) == [1, 4]
    assert turns.shared_cpus({0, 1, 2}, 0) == []
    with pytest.raises(ValueError, match="--turn-cpus -1"):
        turns.shared_cpus({0, 1}, -1)


# ------------------------------------------------------------------------------------------- call stages


def _stage_helper(lane, *, voted: bool = True, older: bool = False):
    """A stand-in helper for ``product.call_stages``: this tree's shape (``stats()['voted_launch']``, the runtime's
    call vote) or an older tree's (``_fused_vote``, ``_call_vote`` on the helper), with ``lane`` as its hot lane."""
    import types

    calls: list[tuple] = []
    proposal = types.SimpleNamespace(geom="geom", plan="plan", fields=(1, 2))
    transport = types.SimpleNamespace(execute=lambda x, geom, plan, **kw: calls.append(("execute", kw)) or x)
    helper = types.SimpleNamespace(planner=types.SimpleNamespace(propose=lambda sig: proposal), transport=transport,
                                   call=lambda x, mode: (calls.append(("call", mode)) or x, 0), _hot=lane)
    if older:
        helper.stats, helper._fused_vote, helper._call_vote = (lambda: {}), voted, "the vote"
    else:
        helper.stats = lambda: {"voted_launch": voted}
        helper._runtime = types.SimpleNamespace(call_vote="the vote")
    return helper, calls


@pytest.mark.parametrize("older", [False, True])
def test_call_stages_cut_the_hot_lane_where_it_holds_the_signature(older: bool) -> None:
    """The ``native`` stage is the lane's run, then its finish with that launch and the call vote, for this tree's
    helper and an older one's; making the stages finishes the one probing launch it makes. A lane that does not
    hold the signature (run returns None) and a helper without a lane get no ``native`` stage; without the fused vote,
    neither ``voted`` nor ``native``."""
    import types

    from benchmarks.harness import product

    log: list[tuple] = []
    lane = types.SimpleNamespace(run=lambda x, mode, seq: log.append(("run", mode, seq)) or ("hit", seq),
                                 finish=lambda x, hit, vote: log.append(("finish", hit, vote)) or x)
    x = torch.zeros(1, 4, 2, 3)
    helper, calls = _stage_helper(lane, older=older)
    stages = product.call_stages(helper, x, 1)
    assert set(stages) == {"call", "native", "voted", "launch"}
    assert [e[0] for e in log] == ["run", "finish"] and log[1][1] == ("hit", log[0][2]) and log[1][2] == "the vote"
    assert stages["native"]() is x
    assert [e[0] for e in log] == ["run", "finish"] * 2 and log[3][1] == ("hit", log[2][2]) and log[2][2] != log[0][2]
    assert stages["voted"]() is x and calls[-1][1]["vote"] == "the vote"

    idle = types.SimpleNamespace(run=lambda x, mode, seq: None, finish=lambda *a: pytest.fail("nothing to finish"))
    assert set(product.call_stages(_stage_helper(idle, older=older)[0], x, 1)) == {"call", "voted", "launch"}
    assert set(product.call_stages(_stage_helper(None, older=older)[0], x, 1)) == {"call", "voted", "launch"}
    assert set(product.call_stages(_stage_helper(lane, voted=False, older=older)[0], x, 1)) == {"call", "launch"}


@pytest.mark.parametrize("home", ["fastvideo.distributed.all_to_all", "fastvideo.distributed.ulysses.layout",
                                  "fastvideo.distributed.communication_op"])
def test_send_layout_is_found_where_each_tree_kept_it(monkeypatch: pytest.MonkeyPatch, home: str) -> None:
    """The harness runs against older trees (--compare-revs), which kept the NCCL route's send layout in three
    places over time: each is found where it is the only one (the others made unimportable, or without the name)."""
    import sys
    import types

    from benchmarks.harness import product

    names = {"fastvideo.distributed.all_to_all": "send_layout", "fastvideo.distributed.ulysses.layout": "send_layout",
             "fastvideo.distributed.communication_op": "_send_layout"}
    for module, name in names.items():
        fake = types.ModuleType(module)
        if module == home:
            setattr(fake, name, lambda x, mode, world_size, _m=module: (_m, mode, world_size))
        monkeypatch.setitem(sys.modules, module, fake if module == home or module.endswith("communication_op")
                            else None)  # None: the import raises ImportError, as in a tree without the module
    assert product.send_layout(torch.zeros(1), 1, 2) == (home, 1, 2)
