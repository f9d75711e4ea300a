"""Every benchmark case on CPU over gloo at a toy size: it runs end to end, writes a valid run document (the header,
every row with ``wrong`` and ``wrong_oracle``), and finds zero wrong elements; a deliberately corrupted output is
counted and fails the run. Timings on CPU mean nothing and are not checked.

Most cases run inside gloo ranks started by ``tests/distributed/mp.py`` (the harness uses the ranks' process
group); the launch paths themselves (``--nproc``, a plain single process, ``torchrun`` under ``--compare-revs``)
are run as subprocesses once each. Every subprocess gets a clean environment (no ambient ``FASTVIDEO_*``) and a
hard timeout.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.cases import fused_host_overhead
from benchmarks.harness import revs, timing
from tests.distributed import mp

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
KERNEL_BUILD = ROOT / "build" / "kernel" / "libfastvideo_ulysses_a2a.so"


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FASTVIDEO_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def _subprocess(*cmd: str, timeout: float = 150, expect: int | None = 0) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, *cmd], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=timeout)
    if expect is not None:
        tail = f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        assert proc.returncode == expect, f"{cmd} exited {proc.returncode}\n{tail}"
    return proc


def _run_case(rank: int, world_size: int, argv: list[str]) -> tuple[int, str]:
    """Rank function: the harness's main on these ranks; (exit status, what it printed)."""
    from benchmarks.harness.main import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main(list(argv))
    return status, out.getvalue()


def _ranks(world: int, *argv: str, env: dict | None = None, timeout: float = 150) -> list[tuple[int, str]]:
    return mp.run_ranks(world, _run_case, list(argv), env={"OMP_NUM_THREADS": "1", **(env or {})},
                        timeout_s=timeout)


def _document(path: Path) -> dict:
    from benchmarks.harness import report

    doc = json.loads(path.read_text())
    assert report.validate(doc) == [], report.validate(doc)
    assert doc["header"]["complete"] is True
    return doc


def _ran(results: list[tuple[int, str]], status: int = 0) -> str:
    assert [s for s, _ in results] == [status] * len(results), results[0][1][-3000:]
    return results[0][1]


# ---------------------------------------------------------------------------------------------- every case


CASES = [  # (case, ranks, extra argv)
    ("a2a", 2, ["--geometry", "toy", "--geometry", "2,64,4,8"]),
    ("tune", 2, []),
    ("floor", 2, []),
    ("host_path", 2, ["--tag", "tagged"]),
    ("launch_host", 1, []),
    ("fused_host_overhead", 1, ["--tag", "both"]),
    ("vote_cost", 2, []),
    ("lineup_skew", 2, []),
    ("public_op_overhead", 2, []),
    ("route_vote", 2, ["--vote", "gloo", "--alternations", "2"]),
    ("copy_engine", 1, []),
    ("overlap", 2, ["--groups", "1,2,3,8", "--routes", "off,auto"]),  # 8: a group with none of a rank's heads
    ("dit_step", 2, ["--hidden", "32", "--heads", "2", "--blocks", "1", "--tokens", "64"]),
]


def test_every_case_is_covered() -> None:
    from benchmarks.harness.case import CASES as REGISTERED

    assert sorted(c for c, _, _ in CASES) == sorted(REGISTERED)


@pytest.mark.timeout(200)
@pytest.mark.parametrize(("case", "world", "extra"), CASES, ids=[c for c, _, _ in CASES])
def test_case_runs_on_cpu_and_writes_a_valid_document(tmp_path: Path, case: str, world: int, extra: list) -> None:
    out = tmp_path / f"{case}.json"
    printed = _ran(_ranks(world, case, "--device", "cpu", "--quick", "--json", str(out), *extra))
    doc = _document(out)
    header = doc["header"]
    assert header["case"] == case and header["sp_size"] == world and header["device"] == "cpu"
    assert header["command"] and header["torch"] and header["commit"] != "unknown"
    ran = [r for r in doc["rows"] if "skipped" not in r]
    assert ran, doc["rows"]
    assert all(r["wrong"] == 0 for r in ran), [r for r in ran if r["wrong"]]
    assert "#wrong" in printed and "# #wrong: " in printed


@pytest.mark.timeout(200)
def test_fused_host_overhead_rows_carry_the_floor_the_paired_overhead_and_the_decomposition(tmp_path: Path) -> None:
    out = tmp_path / "fho.json"
    _ran(_ranks(1, "fused_host_overhead", "--device", "cpu", "--quick", "--decompose", "--json", str(out)))
    rows = _document(out)["rows"]
    floor, fused = rows[0], rows[1:]
    assert floor["label"].startswith("floor") and floor["engine"] == "torch" and floor["wrong"] == 0
    assert len(fused) == 6 and all(r["engine"] in ("sm", "ce") for r in fused)
    for row in rows:
        assert row["paired_p25_us"] <= row["paired_us"] <= row["paired_p75_us"], row
        busy = [row.get(k) for k in ("busy_p25_us", "busy_us", "busy_p75_us", "device_busy_ms")]
        assert all(isinstance(v, float) and math.isfinite(v) for v in busy), row
        assert busy[0] <= busy[1] <= busy[2] and busy[3] > 0, row
        assert row["busy_spin_us"] == 0.0 and row["busy_spin_doubled"] == 0, row  # no spin on CPU
    # The CPU transport fuses no vote: the voted stage is absent there, the other two are measured and checked.
    assert all("call_us" in r and "launch_us" in r and "voted_us" not in r and r["wrong"] == 0 for r in fused)
    assert "call_us" not in floor
    # --compared-only: the compared metric alone, every row still checked
    _ran(_ranks(1, "fused_host_overhead", "--device", "cpu", "--quick", "--compared-only", "--json", str(out)))
    rows = _document(out)["rows"]
    assert len(rows) == 7 and all(r["wrong"] == 0 and r["paired_p25_us"] <= r["paired_us"] for r in rows), rows
    assert not any(k in r for r in rows for k in ("host_ms", "device_ms", "busy_us")), rows


@pytest.mark.timeout(200)
def test_host_path_with_the_voted_launch_times_the_path_before_the_launch(tmp_path: Path) -> None:
    """``host_path --voted-launch``: the transport takes the shared-memory vote as the native one does; every call
    fused, and the time to the transport's entry is part of the call's."""
    from tests.distributed.conftest import SHM_VOTE_ENV, SHM_VOTE_SKIP

    if SHM_VOTE_SKIP:
        pytest.skip(SHM_VOTE_SKIP)
    out = tmp_path / "host_path.json"
    _ran(_ranks(2, "host_path", "--device", "cpu", "--quick", "--vote", "shm", "--voted-launch", "--json", str(out),
                env=SHM_VOTE_ENV))
    doc = _document(out)
    assert doc["header"]["voted_launch"] is True and len(doc["rows"]) == 2
    for row in doc["rows"]:
        assert row["vote"] == "shm" and row["fused_calls"] == row["calls"] and row["wrong"] == 0
        assert 0 < row["pre_us_median"] < row["call_us_median"] and row["vote_us_median"] > 0


# ------------------------------------------------------------------------------------ requests that cannot run

# The kernel library made unloadable, so that the shared-memory vote cannot run wherever the tests run.
NO_LIBRARY = {"FASTVIDEO_KERNEL_LIBRARY": "/nonexistent/libfastvideo_ulysses_a2a.so"}
NAMED_BUT_UNAVAILABLE = [  # (ranks, argv, the request the failure names, the reason it gives)
    (2, ["vote_cost", "--vote", "shm"], "--vote shm", "shared-memory vote unavailable"),
    (2, ["vote_cost", "--vote", "both"], "--vote shm", "shared-memory vote unavailable"),
    (2, ["route_vote", "--vote", "shm", "--alternations", "2"], "--vote shm", "the helper votes over gloo"),
    (2, ["host_path", "--vote", "shm"], "--vote shm", "the helper votes over gloo"),
    (2, ["a2a", "--routes", "nccl,peer", "--geometry", "toy", "--floor", ""], "--routes fast-ulysses",
     "not installed"),
    (2, ["a2a", "--routes", "upstream", "--geometry", "toy", "--floor", ""], "--routes upstream-0.2.1",
     "FASTVIDEO_UPSTREAM_PEER unset"),
    (1, ["overlap", "--routes", "off,auto", "--groups", "1"], "--routes auto", "SP 1 exchanges nothing"),
    (1, ["dit_step", "--attention", "sparse", "--hidden", "32", "--heads", "2", "--blocks", "1", "--tokens", "64"],
     "--attention sparse", "needs CUDA"),
]


@pytest.mark.timeout(200)
@pytest.mark.parametrize(("world", "argv", "request_", "why"), NAMED_BUT_UNAVAILABLE,
                         ids=[" ".join(a[:3]) for _, a, _, _ in NAMED_BUT_UNAVAILABLE])
def test_a_named_request_that_cannot_run_fails_the_run(tmp_path: Path, world: int, argv: list[str], request_: str,
                                                       why: str) -> None:
    """Asked for by name, a route, vote channel or attention that cannot run here stops the run on every rank,
    naming the request and why; no document passes for one with it."""
    out = tmp_path / "run.json"
    with pytest.raises(mp.RankError) as failed:
        _ranks(world, *argv, "--device", "cpu", "--quick", "--json", str(out), env=NO_LIBRARY)
    assert sorted(failed.value.errors) == list(range(world))
    for kind, message, _ in failed.value.errors.values():
        assert kind == "SystemExit" and f"{argv[0]}: {request_} was asked for but cannot run here: " in message
        assert why in message, message
    assert not out.exists() or not json.loads(out.read_text())["header"]["complete"]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("case", ["vote_cost", "route_vote"])
def test_the_default_vote_set_skips_a_channel_that_cannot_run_with_a_note(tmp_path: Path, case: str) -> None:
    """The control: without ``--vote`` the same unavailable channel is a skipped row with its reason and a note,
    and the other channel runs."""
    out = tmp_path / f"{case}.json"
    extra = ["--alternations", "2"] if case == "route_vote" else []
    _ran(_ranks(2, case, "--device", "cpu", "--quick", "--json", str(out), *extra, env=NO_LIBRARY))
    doc = _document(out)
    shm = [r for r in doc["rows"] if r["vote"] == "shm"]
    assert len(shm) == 1 and shm[0]["wrong"] is None and shm[0]["skipped"]
    assert any(r["vote"] == "gloo" and r["wrong"] == 0 for r in doc["rows"])
    assert any(n.startswith("--vote shm skipped (in the default set") for n in doc["header"]["notes"])


# ---------------------------------------------------------------------------------------------- a2a


@pytest.mark.timeout(200)
def test_a2a_rows_routes_rotation_and_floor(tmp_path: Path) -> None:
    out = tmp_path / "a2a.json"
    printed = _ran(_ranks(2, "a2a", "--device", "cpu", "--geometry", "toy", "--quick", "--overlap", "--require-fused",
                          "--json", str(out), "--save-outputs", str(tmp_path / "outputs")))
    doc = _document(out)
    rows = doc["rows"]
    assert [(r["mode"], r["route"]) for r in rows] == [(m, r) for m in (0, 1) for r in
                                                       ("nccl", "fused", "fast-ulysses", "fast-ulysses-out",
                                                        "upstream-0.2.1")]
    for row in (r for r in rows if r["route"] in ("nccl", "fused")):
        for field in ("median_ms", "p10_ms", "p90_ms", "min_ms", "max_ms", "vote_us", "transfer_ms", "gbps",
                      "floor_fraction", "floor_ms", "aligned_median_ms", "entry_skew_us", "route_ran", "plan"):
            assert field in row, (field, row)
        assert row["min_ms"] <= row["p10_ms"] <= row["median_ms"] <= row["p90_ms"] <= row["max_ms"]
        assert row["n"] == 5 * 2  # --quick: 5 iterations x 2 rotated rounds
        assert row["route_ran"] == row["route"] and row["wrong"] == 0
        assert row["gemm_slowdown"] is None and "CUDA" in row["overlap_note"]
    fused = [r for r in rows if r["route"] == "fused"]
    assert all(r["plan"] and r["transfer_what"] == "transport.execute" and r["chunks"] == 1 for r in fused)
    assert all(r["host_overhead_us"] is not None for r in fused)
    # The peer is not installed here: its rows are skipped, with the reason, never an import error.
    peer = [r for r in rows if r["route"].startswith("fast-ulysses")]
    assert peer and all("not installed" in r["skipped"] and r["wrong"] is None for r in peer)
    assert "not installed" in doc["header"]["peer"]["skipped"]
    # Upstream 0.2.1's fused route is not built here either: skipped, naming how to build it.
    upstream = [r for r in rows if r["route"] == "upstream-0.2.1"]
    assert upstream and all("FASTVIDEO_UPSTREAM_PEER unset" in r["skipped"] for r in upstream)
    assert "FASTVIDEO_UPSTREAM_PEER unset" in doc["header"]["upstream_peer"]["skipped"]
    # No floor candidate runs on CPU (the peer copy needs GPUs, the pushes the native transport): said so.
    floor = next(iter(doc["floor"].values()))
    assert floor["floor_ms"] is None and set(floor["refs"]) == {"p2p", "ce", "sm", "nccl"}
    assert "needs CUDA" in floor["refs"]["p2p"]["skipped"] and "gbps" in floor["refs"]["nccl"]
    assert "# floor at" in printed and (tmp_path / "outputs" / "rank0.safetensors").exists()


FAKE_PEER = '''
"""A stand-in with fast-ulysses' documented API (the NCCL route underneath), for the harness's CPU tests."""
import os

import torch
from fastvideo.distributed.communication_op import nccl_route
from fastvideo.distributed.parallel_state import get_sp_group

__version__ = "0.0-test"
CALLS = {"owned": 0, "out": 0}


class UlyssesGroup:
    def __init__(self, process_group=None):
        self.group = get_sp_group().device_group
        self.destroyed = False

    def all_to_all_4d(self, x, mode=0, out=None):
        y = nccl_route(x, mode, self.group)
        if out is None:
            CALLS["owned"] += 1
            return y
        CALLS["out"] += 1
        out.copy_(y)
        if os.environ.get("FAKE_PEER_CORRUPT") == "1":
            out.view(-1)[0] += 1  # the negative control: one element wrong
        return out

    def empty_output(self, x, mode=0):
        b, s, h, d = x.shape
        p = get_sp_group().world_size
        return torch.empty((b, s * p, h // p, d) if mode == 0 else (b, s // p, h * p, d), dtype=x.dtype)

    def destroy(self):
        self.destroyed = True
'''


@pytest.fixture
def fake_peer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "peerpkg" / "fast_ulysses").mkdir(parents=True)
    (tmp_path / "peerpkg" / "fast_ulysses" / "__init__.py").write_text(FAKE_PEER)
    monkeypatch.syspath_prepend(str(tmp_path / "peerpkg"))  # the ranks start with this process's sys.path
    return tmp_path / "peerpkg"


@pytest.mark.timeout(200)
def test_a2a_times_the_peer_in_the_same_run(tmp_path: Path, fake_peer: Path) -> None:
    out = tmp_path / "peer.json"
    _ran(_ranks(2, "a2a", "--device", "cpu", "--geometry", "toy", "--quick", "--modes", "0", "--floor", "",
                "--routes", "nccl,peer", "--json", str(out)))
    doc = _document(out)
    rows = {r["route"]: r for r in doc["rows"]}
    assert set(rows) == {"nccl", "fast-ulysses", "fast-ulysses-out"}
    for route in ("fast-ulysses", "fast-ulysses-out"):
        row = rows[route]
        assert row["route_ran"] == route and row["wrong"] == 0 and row["n"] == 10
        assert row["transfer_ms"] is None and row["host_overhead_us"] is None  # the peer exposes no transfer alone
    assert doc["header"]["peer"]["version"] == "0.0-test" and doc["header"]["peer"]["path"].startswith(str(fake_peer))


@pytest.mark.timeout(200)
def test_a2a_counts_a_corrupted_output_and_fails(tmp_path: Path, fake_peer: Path) -> None:
    """The negative control of ``#wrong``: the peer's out= path writes one wrong element on each rank."""
    out = tmp_path / "bad.json"
    printed = _ran(_ranks(2, "a2a", "--device", "cpu", "--geometry", "toy", "--quick", "--modes", "0", "--floor", "",
                          "--routes", "nccl,peer", "--json", str(out), env={"FAKE_PEER_CORRUPT": "1"}), status=1)
    rows = {r["route"]: r for r in _document(out)["rows"]}
    assert rows["fast-ulysses-out"]["wrong"] == 2  # one element per rank, summed over the 2 ranks
    assert rows["fast-ulysses"]["wrong"] == 0 and rows["nccl"]["wrong"] == 0
    assert "# WRONG: 2 element(s)" in printed
    from benchmarks import check_results

    found, _ = check_results.judge(json.loads(out.read_text()))
    assert found[0]["verdict"] == "FAIL" and "toy 0 fast-ulysses-out" in found[0]["detail"]


@pytest.mark.timeout(120)
def test_a2a_sp1_as_one_plain_process(tmp_path: Path) -> None:
    out = tmp_path / "sp1.json"
    _subprocess(str(BENCH / "benchmark_ulysses_a2a.py"), "--device", "cpu", "--quick", "--json", str(out))
    doc = _document(out)
    rows = [r for r in doc["rows"] if r["route"] in ("nccl", "fused")]
    assert doc["header"]["sp_size"] == 1 and doc["header"]["command_source"] == "exact"
    assert rows and all(r["wrong"] == 0 and r["route_ran"].startswith("identity") for r in rows)


@pytest.mark.timeout(150)
def test_nproc_launches_the_ranks_and_records_the_command(tmp_path: Path) -> None:
    out = tmp_path / "skew.json"
    cmd = ["-m", "benchmarks.run", "lineup_skew", "--nproc", "2", "--quick", "--json", str(out)]
    _subprocess(*cmd)
    doc = _document(out)
    assert doc["header"]["sp_size"] == 2 and doc["header"]["command_source"] == "exact"
    assert doc["header"]["command"].endswith(" ".join(cmd[1:]))
    rows = doc["rows"]
    assert [r["lineup"] for r in rows] == ["gloo", "shm"] and rows[0]["ran"] == "gloo"
    assert rows[1]["ran"] == ("shm" if KERNEL_BUILD.is_file() else "gloo")  # the development build where it exists
    assert all(r["iters"] == 40 and 0 <= r["median_us"] <= r["p90_us"] <= r["max_us"] for r in rows)


@pytest.mark.timeout(240)
def test_a2a_compare_revs(tmp_path: Path) -> None:
    tree_a = tmp_path / "rev_a"
    shutil.copytree(ROOT / "fastvideo", tree_a / "fastvideo", ignore=shutil.ignore_patterns("__pycache__"))
    (tree_a / "COMMIT").write_text("test-export\n")
    out = tmp_path / "cmp.json"
    _subprocess(str(BENCH / "benchmark_ulysses_a2a.py"), "--compare-revs", str(tree_a), str(ROOT), "--rounds", "1",
                "--nproc", "2", "--compare-out", str(tmp_path / "runs"), "--json", str(out), "--", "--device", "cpu",
                "--geometry", "toy", "--quick", "--modes", "0", "--routes", "nccl,fused", timeout=230)
    data = json.loads(out.read_text())
    assert data["header"]["commit_a"] == "test-export"
    assert {(r["geometry"], r["route"]) for r in data["rows"]} == {("toy", "nccl"), ("toy", "fused")}
    assert all(r["ratio_b_over_a"] > 0 for r in data["rows"])  # times of a whole call: always positive
    assert data["outputs"] and all(o["identical"] for o in data["outputs"])
    run_a = json.loads((tmp_path / "runs" / "A0.json").read_text())
    assert Path(run_a["header"]["fastvideo_tree"]) == tree_a.resolve()
    assert run_a["header"]["bench_commit"]  # the benchmark code's own commit, beside the tree's


@pytest.mark.parametrize("iters", [fused_host_overhead.SLICES * 50, fused_host_overhead.SLICES + 1, 2])
def test_fused_host_overhead_times_the_compared_metric_in_slices_with_a_turn_between(
        monkeypatch: pytest.MonkeyPatch, iters: int) -> None:
    """The compared metric's iterations, all of them once, in slices (each warmed up), a turn before every slice
    after the first; never an empty slice. Negative control: the same record with the turns removed fails."""
    events: list[str] = []

    def paired(host_fn, device_fn, device, n, warmup):
        events.append(f"slice {n} warmup {warmup}")
        return [float(n)] * n

    monkeypatch.setattr(timing, "paired_overhead", paired)
    args = type("Args", (), {"iters": iters, "warmup": 3})()
    seconds = fused_host_overhead.sliced_paired(None, None, None, args, lambda: events.append("turn"))
    sizes = [int(e.split()[1]) for e in events if e.startswith("slice")]
    assert len(seconds) == sum(sizes) == iters and min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
    assert len(sizes) == min(iters, fused_host_overhead.SLICES) and all("warmup 3" in e for e in events if "slice" in e)

    def alternates(record: list[str]) -> bool:
        return record[0] != "turn" and all((e == "turn") == (i % 2 == 1) for i, e in enumerate(record))

    assert alternates(events)
    assert not alternates([e for e in events if e != "turn"])  # the negative control


@pytest.mark.timeout(200)
def test_fused_host_overhead_compare_revs_runs_both_trees_in_turns(tmp_path: Path) -> None:
    """A case that takes turns, at one rank per run: both trees of a round run together, one row of each in
    alternation (the turns recorded per round, each run's count of turns taken in its header), and the rows
    compare as ever."""
    tree_a = tmp_path / "rev_a"
    shutil.copytree(ROOT / "fastvideo", tree_a / "fastvideo", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "cmp.json"
    _subprocess("-m", "benchmarks.run", "fused_host_overhead", "--compare-revs", str(tree_a), str(ROOT), "--nproc",
                "1", "--rounds", "2", "--turn-cpus", "1", "--within", "0.5,10", "--compare-out", str(tmp_path / "runs"),
                "--json", str(out), "--", "--device", "cpu", "--quick", "--decompose", timeout=190)
    data = json.loads(out.read_text())
    assert data["header"]["interleaved"] is True
    headers = {name: json.loads((tmp_path / "runs" / f"{name}.json").read_text())["header"]
               for name in ("A0", "B0", "A1", "B1")}
    taken = {name: header["turns_taken"] for name, header in headers.items()}
    # Both runs of every round ran on the one CPU the parent chose: the highest it may use (where it may use more
    # than one, a run left unpinned would report them all).
    assert data["header"]["turn_cpus"] == [max(os.sched_getaffinity(0))]
    assert all(header["cpus"] == data["header"]["turn_cpus"] for header in headers.values())
    # The floor and one row per plan and mode, each a turn per slice of its compared metric and of each stage it is
    # cut into (--decompose); one turn more for the synchronize's timing. The leader swaps every step.
    rows = len(data["rows"])
    stages = {name: sum(f"{stage}_us" in row for row in json.loads((tmp_path / "runs" / f"{name}.json").read_text())
                        ["rows"] for stage in fused_host_overhead.STAGES) for name in headers}
    assert len(set(stages.values())) == 1 and stages["A0"] >= rows - 1  # both trees cut every fused row alike
    steps = 1 + (rows + stages["A0"]) * fused_host_overhead.SLICES
    assert rows == 7 and set(taken.values()) == {steps}
    assert data["header"]["turn_orders"] == ["".join(("AB", "BA")[(i + r) % 2] for i in range(steps)) for r in (0, 1)]
    # Each row's A and B are the medians of their runs' rows (on CPU the overhead is noise around a few us and
    # may centre below zero: then there is no ratio)
    case = fused_host_overhead.CASE
    metric = case.metric
    for r in data["rows"]:
        for label in "AB":
            runs = [json.loads((tmp_path / "runs" / f"{label}{i}.json").read_text())["rows"] for i in (0, 1)]
            values = [row[metric] for run in runs for row in run
                      if all(row.get(k) == r[k] for k in case.key) and row.get(metric)]
            assert r[f"{label.lower()}_{metric}"] == statistics.median(values)
        assert r["ratio_b_over_a"] == revs.ratio(r[f"a_{metric}"], r[f"b_{metric}"])
    assert not list((tmp_path / "runs").glob("turns*")) and (tmp_path / "runs" / "B1.log").is_file()
    # --within: every row marked, counted per lane (as built on CPU: the floor and the fused rows)
    counts = data["header"]["within_counts"]
    assert set(counts) == {"floor", "fused"} and sum(total for _, total in counts.values()) == rows
    assert sum(n for n, _ in counts.values()) == sum(r["within"] for r in data["rows"])


def test_fused_host_overhead_lanes() -> None:
    """--within's lanes: the floor, the hot path's and the Python path's rows of --hot both, the rest fused."""
    lane = fused_host_overhead.CASE.lane
    assert [lane({"label": label}) for label in ("floor: torch copy_", "sm 144 CTAs x1 hot", "ce 66 CTAs x2 python",
                                                 "ce 66 CTAs x1", "sm 144 CTAs x1 tagged")] == \
        ["floor", "hot", "python", "fused", "fused"]


@pytest.mark.timeout(60)
def test_compare_revs_tree_libraries_need_each_trees_build(tmp_path: Path) -> None:
    """--tree-libraries runs each tree on its own loader and build, and refuses, naming the build command, a tree
    without one (before any run)."""
    tree_a = tmp_path / "rev_a"
    shutil.copytree(ROOT / "fastvideo", tree_a / "fastvideo", ignore=shutil.ignore_patterns("__pycache__"))
    proc = _subprocess(str(BENCH / "benchmark_ulysses_a2a.py"), "--compare-revs", str(tree_a), str(ROOT),
                       "--tree-libraries", "--rounds", "1", "--", "--device", "cpu", "--geometry", "toy", "--quick",
                       timeout=50, expect=None)
    assert proc.returncode != 0 and "--tree-libraries" in proc.stderr and "build_lib.py --out build/kernel" in \
        proc.stderr, proc.stdout[-2000:] + proc.stderr[-2000:]


# ---------------------------------------------------------------------------------------------- tune


@pytest.mark.timeout(200)
def test_tune_rows_feed_the_a2a_policy(tmp_path: Path) -> None:
    out = tmp_path / "tune.json"
    printed = _ran(_ranks(2, "tune", "--device", "cpu", "--quick", "--json", str(out)))
    data = _document(out)
    assert data["rows"] and all(r["wrong"] == 0 for r in data["rows"])
    assert data["best"] and data["tuned_rows"] and "meaningless" in printed
    namespace: dict = {}
    exec("import torch\nfrom fastvideo.distributed.ulysses.policy import TunedRow\nT = (\n"
         + "\n".join(data["tuned_rows"]) + "\n)", namespace)
    assert namespace["T"][0].heads == 8
    # Both engines were swept and held to exactness; the structured rows load back as the same TunedRows.
    assert {r["engine"] for r in data["rows"]} == {"sm", "ce"}
    assert [(r.engine, r.ctas, r.planes_per_chunk, r.row_chunks, r.source) for r in namespace["T"]] == [
        (d["engine"], d["ctas"], d["planes_per_chunk"], d["row_chunks"], d["source"]) for d in data["tuned_rows_data"]]
    # The benchmark runs the policy on exactly those rows (--tuned-from), and records them in its header.
    bench = tmp_path / "a2a.json"
    _ran(_ranks(2, "a2a", "--device", "cpu", "--quick", "--routes", "fused", "--floor", "", "--tuned-from", str(out),
                "--json", str(bench)))
    result = _document(bench)
    assert result["header"]["tuned_from"]["rows"] == [repr(r) for r in namespace["T"]]
    chosen = namespace["T"][0]
    auto = result["rows"]
    assert auto and all(r["route_ran"] == "fused" and r["wrong"] == 0 for r in auto)
    assert all(("copy engine" in r["plan"]) == (chosen.engine == "ce") for r in auto)


# ---------------------------------------------------------------------------------------------- floor, others


@pytest.mark.timeout(120)
def test_floor_dry_run_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "floor.json"
    _ran(_ranks(2, "floor", "--device", "cpu", "--quick", "--mib", "1", "--json", str(out)))
    doc = _document(out)
    (row,) = doc["rows"]
    assert doc["header"]["dry_run"] is True and row["bytes_each_way"] == 1 << 20
    p2p = row["refs"]["p2p"]
    assert p2p["dry_run"] and p2p["pairs"] == 2 and p2p["gbps"] > 0 and row["wrong"] == 0  # both directions checked
    assert row["floor_ref"] == "p2p" and row["floor_ms"] == p2p["ms"]
    assert "native transport" in row["refs"]["ce"]["skipped"] and "native transport" in row["refs"]["sm"]["skipped"]


def test_floor_skips_cleanly_without_two_gpus() -> None:
    import torch

    from benchmarks.cases import floor

    assert floor.p2p_reference(1 << 20, torch.device("cpu"), 2, 0) == {"skipped": "needs CUDA GPUs"}
    if torch.cuda.device_count() < 2:
        assert "GPUs visible" in floor.p2p_reference(1 << 20, torch.device("cuda"), 2, 0)["skipped"]
    fabric = floor.fabric_reference(None, 1 << 20, torch.device("cpu"), 2, 0)
    assert set(fabric) == {"ce", "sm"} and all("skipped" in v for v in fabric.values())


def test_peer_copy_oracle_counts_a_wrong_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """The p2p reference's own negative control: a copy that drops a byte is counted."""
    import torch

    from benchmarks.cases import floor

    devices = [torch.device("cpu")] * 2
    assert floor.peer_copy(4096, devices, 1, 0)["wrong"] == 0
    real = torch.Tensor.copy_

    def lossy(self, src, non_blocking=False):
        out = real(self, src, non_blocking)
        self.view(-1)[7] ^= 0xFF
        return out

    monkeypatch.setattr(torch.Tensor, "copy_", lossy)
    assert floor.peer_copy(4096, devices, 1, 0)["wrong"] == 2  # one byte per direction


@pytest.mark.timeout(120)
def test_public_op_overhead_in_process_script(tmp_path: Path) -> None:
    out = tmp_path / "op.json"
    _subprocess(str(ROOT / "scripts" / "measure_public_op_overhead.py"), "--in-process", "--iters", "1000",
                "--json", str(out))
    (row,) = _document(out)["rows"]
    assert row["ns_per_call"] > 0 and row["wrong"] == 0 and "moves no data" in row["wrong_oracle"]


# ---------------------------------------------------------------------------------------------- DiT step


@pytest.mark.timeout(240)
def test_dit_step_benchmark_cpu(tmp_path: Path) -> None:
    out, plot = tmp_path / "dit.json", tmp_path / "dit.png"
    blocks = 2
    printed = _ran(_ranks(2, "dit_step", "--device", "cpu", "--hidden", "64", "--heads", "4", "--blocks", str(blocks),
                          "--tokens", "256", "--long-training", "auto,chunked", "--json", str(out), "--plot", str(plot),
                          "--save", str(tmp_path / "save"), timeout=230))
    data = _document(out)
    assert not data["header"]["failures"] and data["header"]["long_training"] == ["auto", "chunked"]
    share = data["a2a_share"][0]
    assert "train" in share and share["train"]["local_s"] > 0 and len(share["train"]["local_trial_s"]) == 3
    rows = data["rows"]
    # The LONG_TRAINING sweep: one auto variant per value; no-grad calls ignore it, so inference rows only for the
    # first value.
    assert [(r["route"], r["long_training"], r["kind"]) for r in rows] == [
        ("off", "auto", "infer"), ("off", "auto", "train"), ("auto", "auto", "infer"), ("auto", "auto", "train"),
        ("auto", "chunked", "train")]
    for row in rows:
        assert len(row["trial_s"]) >= 3 and row["wrong"] == 0
        assert row["route_ran"] == ("fused" if row["route"] == "auto" else "nccl")
        if row["kind"] == "infer":
            # The probe saw every call of one inference forward: one per op per block.
            assert row["in_step"]["counts"] == {"out/fwd": blocks, "qkv/fwd": blocks}
            assert "bitwise" in row["wrong_oracle"]
        else:
            assert row["grad_ok"] and row["grad_max_abs_diff"] <= row["grad_threshold"]
            assert "threshold" in row["wrong_oracle"]
            # Training with checkpointing: forward, recompute and backward of each op per block.
            assert row["in_step"]["counts"] == {f"{op}/{ph}": blocks for op in ("qkv", "out")
                                                for ph in ("fwd_grad", "recompute", "bwd")}
        assert row["in_step"]["op_device_s"] > 0 and row["op_step_s"] > 0
        assert row["share"] == share[row["kind"]]["share"]
    for row in (r for r in rows if r["route"] == "auto"):
        # Plans per row from the helper history: every call of the row's trials is accounted for.
        assert sum(row["plans"].values()) == row["helper_calls"]["calls"] > 0
        assert all(": fused, original: 36 CTAs" in text for text in row["plans"])
        nccl = next(r for r in rows if r["route"] == "off" and r["kind"] == row["kind"])
        assert row["measured_gain"] == pytest.approx(1 - row["median_s"] / nccl["median_s"])
        # On a loaded CPU the step without the op can measure slower than with it (a negative share): no ideal gain
        # is reported then rather than a meaningless one (runner.ideal_gain).
        if row["share"] < 0:
            assert row["ideal_gain"] is None
        else:
            assert row["ideal_gain"] == pytest.approx(row["share"] * (1 - row["op_step_s"] / nccl["op_step_s"]))
        assert row["memory"] is None and row["window_bytes"] > 0  # no CUDA memory stats on CPU
    ops = data["op_level"][0]
    assert set(ops["units_s"]) == {"off", "auto[auto]", "auto[chunked]"}
    assert set(ops["units_s"]["auto[chunked]"]["qkv"]) == {"grad", "fwdbwd"}
    assert all(v > 0 for per in ops["units_s"].values() for u in per.values() for v in u.values())
    # The estimate's step count is the procedure's (warm-up, rotated trials with the local stand-in, check pass,
    # calibration).
    from benchmarks.dit import estimate

    assert share["steps_run"] == dict(zip(("infer", "train"), estimate.steps_per_tokens(2, 3, local=True)))
    assert "check_results.py" in printed
    if importlib.util.find_spec("matplotlib") is not None:
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and data["plot"]["path"] == str(plot)
    else:
        assert not plot.exists() and "matplotlib" in data["plot"]["skipped"]
    assert (tmp_path / "save" / "dit_rank1.safetensors").exists()
    # The checker judges the run: correctness PASS, the timing and memory targets NOT MEASURED on CPU.
    proc = _subprocess(str(BENCH / "check_results.py"), str(out), "--json", str(tmp_path / "verdicts.json"))
    verdicts = {v["target"]: v for v in json.loads((tmp_path / "verdicts.json").read_text())[str(out)]}
    assert len(verdicts) == 7 and "# verdict:" in proc.stdout
    for target, v in verdicts.items():
        expected = "PASS" if target.startswith(("inference bit-identical", "gradients")) else "NOT MEASURED"
        assert v["verdict"] == expected, (target, v)


@pytest.mark.timeout(120)
def test_dit_step_sp1_and_the_offline_answers(tmp_path: Path) -> None:
    out = tmp_path / "dit1.json"
    _ran(_ranks(1, "dit_step", "--device", "cpu", "--hidden", "32", "--heads", "2", "--blocks", "1", "--tokens", "64",
                "--json", str(out)))
    data = _document(out)
    assert "SP1" in data["a2a_share"][0]["note"]
    assert all(r["route_ran"].startswith("identity") for r in data["rows"])
    assert all(r["ideal_gain"] is None for r in data["rows"] if r["route"] == "auto")
    # --estimate and --plot-from need no ranks.
    est = _subprocess(str(BENCH / "benchmark_dit_step.py"), "--estimate", "--tokens", "32k", "--blocks", "2")
    assert "# estimate:" in est.stdout and "total" in est.stdout
    plot = _subprocess(str(BENCH / "benchmark_dit_step.py"), "--plot-from", str(out), "--plot", str(tmp_path / "p.png"))
    assert "# plot:" in plot.stdout
