"""The capturable fused route on gloo ranks, with CUDA-graph capture forced on (CPU has no graphs).

What a capture must do, and what a replay must not (``docs/compile_and_cuda_graphs.md``):

* every rank votes exactly once per captured call, at capture, and freezes the agreed plan (the same
  plan word on every rank; a backward freezes its forward's plan);
* a replay does no host work: no vote, no sequence number, no call into the helper or the transport's
  host API. The replay is simulated: ``RecordingTransport.execute`` records each captured
  launch (its input and output tensors, geometry and plan) as a graph would, and ``replay`` moves the
  data of every recorded launch in order (what the captured kernels do on the device), after fresh
  inputs were copied into the static input, as with ``torch.cuda.graph``;
* a plan that cannot be frozen (a transport that does host work per call, a refused plan) declines
  ``cuda_graph_capture`` on every rank, and the NCCL route runs; one rank refusing declines
  ``peer_disagreement``; a capture on some ranks only declines ``peer_disagreement``.

Each assertion has a negative control showing it can fail: a "replay" that calls the op again votes and
is caught; a stale static input fails the exactness check; an untuned helper freezes another plan than the
one asserted; a vote without the capture bit lets one rank capture while its peer runs eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from fastvideo.distributed.ulysses import contract
from fastvideo.distributed.ulysses.contract import DeclineReason, Field, Phase, Verdict
from fastvideo.distributed.ulysses.policy import Geometry, Plan
from fastvideo.distributed.ulysses.transport import ENTRY_CAPTURE, ENTRY_CE_CAPTURE, output_shape
from tests.distributed.conftest import (
    READS_LONG_TRAINING,
    a2a,
    bit_equal,
    build_helper,
    capture_switch,
    forced_capture,
    oracle,
    rank_input,
    script_env,
)
from tests.plan_transport import GlooPlanTransport

SHAPE = (3, 16, 12, 8)  # [B, S_local, H, D] at SP2: the fixture row freezes 144 CTAs, one plane per chunk
TUNED = Plan(144, 1, 16, True)
ORIGINAL = Plan(36, 3, 16, False)


@dataclass
class Launch:
    """One captured launch, as a graph holds it: the tensors it reads and writes, geometry and plan."""

    x: torch.Tensor
    out: torch.Tensor
    geom: Geometry
    plan: Plan


class RecordingTransport(GlooPlanTransport):
    """The CPU transport with a capturable route: a captured ``execute`` records instead of moving data.

    ``host_calls`` counts every call into the host API the helper uses per call (the capture check, eager and
    captured execute); ``replay`` is the device side and counts nothing. ``refuse``: the
    reason ``capture_decline`` gives (None: the plan can be frozen). ``move=False``: eager ``execute``
    records without any collective (for the negative control where ranks disagree on the route).
    """

    name = "recording"

    def __init__(self, refuse: str | None = None, move: bool = True, entries: frozenset[str] = frozenset()) -> None:
        super().__init__()
        self.refuse, self.move, self.extra_entries = refuse, move, entries
        self.host_calls = 0
        self.captured: list[Launch] = []
        self.eager: list[Plan] = []

    def capability(self):
        cap = super().capability()
        return type(cap)(self.name, True, abi_version=cap.abi_version,
                         entry_points=cap.entry_points | {ENTRY_CAPTURE} | self.extra_entries, dtypes=cap.dtypes,
                         supports_unaligned=True)

    def capture_decline(self, geom, plan):
        self.host_calls += 1
        return self.refuse

    def execute(self, x, geom, plan, *, capture=False, vote=None, fields=None):
        self.host_calls += 1
        if capture:
            out = torch.full(output_shape(geom, self._ctx.rank), float("nan"), dtype=x.dtype)  # nothing runs yet
            self.captured.append(Launch(x, out, geom, plan))
            return out
        self.eager.append(plan)
        if not self.move:
            return torch.empty(output_shape(geom, self._ctx.rank), dtype=x.dtype)
        return super().execute(x, geom, plan)

    def replay(self) -> None:
        """The device side of one replay: every captured launch, in capture order, with its frozen plan."""
        for launch in self.captured:
            launch.out.copy_(GlooPlanTransport.execute(self, launch.x, launch.geom, launch.plan))


class Counters:
    """Host-side work of a helper: votes exchanged, sequence number (the call count), fused calls recorded, transport
    host calls."""

    def __init__(self, h) -> None:
        self.h = h

    @property
    def votes(self) -> int:
        return len(self.h.vote_seconds())  # every vote's time is kept (up to 4096)

    def snapshot(self) -> tuple[int, int, int, int]:
        stats = self.h.stats()
        return (len(self.h.vote_seconds()), stats["calls"], stats["fused"], self.h.transport.host_calls)


def host_work(before: tuple, after: tuple) -> str:
    """'' when nothing host-side happened between two snapshots, else what did (the replay assertion)."""
    names = ("votes", "sequence number", "fused calls", "transport host calls")
    return ", ".join(f"{n} {a} -> {b}" for n, a, b in zip(names, before, after, strict=True) if a != b)


def _capture_block(h, x_static: torch.Tensor, g_static: torch.Tensor):
    """Capture (forced) a forward and backward of two calls: mode 0, then mode 1 back, and the gradient."""
    with forced_capture(h):
        xg = x_static.requires_grad_()
        y = a2a(h, xg, 0)
        z = a2a(h, y, 1)
        (gx,) = torch.autograd.grad(z, xg, g_static)
    return z, gx


def _capture_and_replay(rank, world_size, tuned, replays):
    h = build_helper(transport=RecordingTransport(), tuned=tuned)
    counters = Counters(h)
    x_static = rank_input(rank, SHAPE, seed=0)
    g_static = rank_input(rank, SHAPE, seed=1)
    z, gx = _capture_block(h, x_static, g_static)
    t = h.transport
    capture = {
        "votes": counters.votes,
        "launches": len(t.captured),
        "eager": len(t.eager),
        "records": [(r.route, r.phase.name, r.mode, r.plan.word if r.plan else 0, r.captured) for r in h.history],
        "frozen": [launch.plan.word for launch in t.captured],
        "statics": [launch.x is x_static for launch in t.captured[:1]],
    }
    exact, work = [], []
    for i in range(replays):
        # Fresh inputs into the static input and gradient, as with torch.cuda.graph; then replay.
        x_static.data.copy_(rank_input(rank, SHAPE, seed=10 + i))
        g_static.copy_(rank_input(rank, SHAPE, seed=100 + i))
        before = counters.snapshot()
        t.replay()
        work.append(host_work(before, counters.snapshot()))
        y_ref = oracle(x_static, 0)
        exact.append(bit_equal(t.captured[0].out, y_ref) and bit_equal(z, x_static)  # mode 1 undoes mode 0
                     and bit_equal(t.captured[1].out, oracle(y_ref, 1)) and bit_equal(gx, g_static))
    # Negative control of the exactness check: new data in a tensor the graph does not read (stale static input).
    fresh = rank_input(rank, SHAPE, seed=999)
    t.replay()
    stale_exact = bit_equal(t.captured[0].out, oracle(fresh, 0))
    # Negative control of the no-host-work check: a "replay" that runs the op again (as an uncaptured
    # graph would) votes, and the same check must report it.
    before = counters.snapshot()
    with torch.no_grad():
        a2a(h, x_static.detach(), 0)
    rerun_work = host_work(before, counters.snapshot())
    eager_after = (h.history[-1].route, h.history[-1].captured)
    stats = h.stats()
    h.destroy()
    return capture, exact, work, stale_exact, rerun_work, eager_after, stats["captured"], stats["fused"]


@READS_LONG_TRAINING
def test_one_vote_per_capture_frozen_plan_and_no_host_work_per_replay(ranks):
    """Forward and backward of two calls captured (forced) on 2 gloo ranks: 4 votes per rank at capture,
    4 captured launches with the tuned plan on every rank (the backward with its forward's), nothing run
    eagerly; 5 simulated replays with fresh inputs do no host work and are bit-exact against the NCCL route."""
    results = ranks(2, _capture_and_replay, True, 5, timeout_s=90)
    frozen = []
    for capture, exact, work, stale_exact, rerun_work, eager_after, captured, fused in results:
        assert capture["votes"] == 4 and capture["launches"] == 4 and capture["eager"] == 0
        assert capture["records"] == [
            ("fused", "FORWARD_GRAD", 0, TUNED.word, True), ("fused", "FORWARD_GRAD", 1, TUNED.word, True),
            ("fused", "BACKWARD", 0, TUNED.word, True), ("fused", "BACKWARD", 1, TUNED.word, True)]
        assert capture["statics"] == [True]  # the captured launch reads the static input itself
        assert exact == [True] * 5
        assert work == [""] * 5
        # Negative controls: the checks above can fail.
        assert stale_exact is False
        assert "votes 4 -> 5" in rerun_work and "sequence number 4 -> 5" in rerun_work
        assert eager_after == ("fused", False)  # after capture, eager calls run (and are not marked captured)
        assert (captured, fused) == (4, 5)
        frozen.append(capture["frozen"])
    assert frozen[0] == frozen[1] == [TUNED.word] * 4  # the same frozen plan on every rank


@READS_LONG_TRAINING
def test_plan_assertion_negative_control_untuned_freezes_the_original_plan(ranks):
    """Control for the plan assertion: without the tuned rows the capture freezes the original plan, so the
    assertion of the tuned plan above would fail (it tells plans apart)."""
    for capture, exact, *_ in ranks(2, _capture_and_replay, False, 1, timeout_s=90):
        assert capture["frozen"] == [ORIGINAL.word] * 4 and ORIGINAL.word != TUNED.word
        assert exact == [True]


def _refused(rank, world_size, scenario):
    if scenario == "cpu transport":  # the plain CPU transport: gloo collectives on the host per chunk
        transport = GlooPlanTransport()
    elif scenario == "all refuse":
        transport = RecordingTransport(refuse="test: this plan needs host work per call")
    else:  # "one refuses"
        transport = RecordingTransport(refuse="test: this plan needs host work per call" if rank == 1 else None)
    h = build_helper(transport=transport)
    x = rank_input(rank, SHAPE)
    with forced_capture(h), torch.no_grad():
        y = a2a(h, x, 0)
    first = (h.history[-1].route, h.history[-1].reason.label, h.history[-1].captured, bit_equal(y, oracle(x, 0)))
    launches = len(getattr(transport, "captured", []))
    detail = h.stats()["capture_detail"]
    with torch.no_grad():
        y2 = a2a(h, x, 0)  # not capturing: the fused route again
    second = (h.history[-1].route, bit_equal(y2, oracle(x, 0)))
    h.destroy()
    return first, launches, detail, second


@pytest.mark.parametrize("scenario, reason", [("cpu transport", "cuda_graph_capture"),
                                              ("all refuse", "cuda_graph_capture"),
                                              ("one refuses", "peer_disagreement")])
@READS_LONG_TRAINING
def test_plan_that_cannot_be_frozen_declines_with_its_reason(ranks, scenario, reason):
    """Under capture, a plan no rank can freeze declines ``cuda_graph_capture`` on every rank (the NCCL route
    runs, exact, nothing is captured); one rank refusing declines ``peer_disagreement``; the next eager call
    runs fused again."""
    results = ranks(2, _refused, scenario, timeout_s=60)
    for rank, (first, launches, detail, second) in enumerate(results):
        assert first == ("nccl", reason, False, True)
        assert launches == 0
        assert second == ("fused", True)
        if scenario == "cpu transport":
            assert "does host work per call" in detail
        elif scenario == "all refuse" or rank == 1:
            assert detail == "test: this plan needs host work per call"


def _capture_on_one_rank(rank, world_size, with_bit):
    from fastvideo.distributed.ulysses import contract

    if not with_bit:  # negative control: the vote no longer says which ranks capture
        contract.WINDOW_CAPTURED = 0
    h = build_helper(transport=RecordingTransport(move=False))
    x = rank_input(rank, SHAPE)
    capture_switch(h).on = lambda t: rank == 0
    with torch.no_grad():
        a2a(h, x, 0)
    record = h.history[-1]
    how = "captured" if h.transport.captured else ("eager fused" if h.transport.eager else "nccl")
    h.destroy()
    return how, record.reason.label if record.reason is not None else None


@READS_LONG_TRAINING
def test_capture_on_some_ranks_only_declines_together(ranks):
    """Rank 0 captures, rank 1 calls eagerly: the capture bit in the vote differs, so both decline
    ``peer_disagreement`` and take the NCCL route. Control: without the bit the vote agrees, rank 0 captures
    while rank 1 runs the fused route eagerly (the ranks disagree on how the call runs)."""
    assert ranks(2, _capture_on_one_rank, True, timeout_s=60) == [("nccl", "peer_disagreement")] * 2
    assert ranks(2, _capture_on_one_rank, False, timeout_s=60) == [("captured", None), ("eager fused", None)]


def test_capture_bit_in_the_vote():
    """The verdict on the capture bit (pure): identical capturing votes RUN, one rank without it DECLINEs."""
    geom = Geometry.from_input(SHAPE, 0, 2, torch.float32)
    row = [0] * contract.NUM_FIELDS
    row[Field.HEADER], row[Field.B], row[Field.S], row[Field.H], row[Field.D] = contract.header(1), *SHAPE
    row[Field.DTYPE], row[Field.PLAN] = 1, TUNED.word
    row[Field.MODE_PHASE] = contract.mode_phase(0, Phase.FORWARD_NO_GRAD)
    row[Field.WINDOW_BYTES] = TUNED.window_bytes(geom) | contract.WINDOW_CAPTURED
    eager = list(row)
    eager[Field.WINDOW_BYTES] = TUNED.window_bytes(geom)
    assert TUNED.window_bytes(geom) < contract.WINDOW_CAPTURED
    assert contract.decide(torch.tensor([row, row])).verdict is Verdict.RUN
    mixed = contract.decide(torch.tensor([row, eager]))
    assert (mixed.verdict, mixed.reason) == (Verdict.DECLINE, DeclineReason.PEER_DISAGREEMENT)



# ---------------------------------------------------------------------- the 2-GPU check script's CPU dry run


def _run_check(*args: str, **env: str):
    import pathlib
    import subprocess
    import sys

    script = pathlib.Path(__file__).with_name("check_ulysses_graphs.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script),
           "--cpu-dry-run", "--quick", *args]
    return subprocess.run(cmd, env=script_env(**env), capture_output=True, text=True, timeout=240)


def test_graph_check_script_cpu_dry_run(tmp_path):
    """tests/distributed/check_ulysses_graphs.py over 2 gloo ranks (CPU transport): every check it can run on
    CPU passes, the CUDA-only parts say they were skipped, and the JSON has the latency rows and the header."""
    import json

    out = tmp_path / "graphs.json"
    proc = _run_check("--json", str(out))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "4 passed, 0 failed" in proc.stdout and "DRY RUN" in proc.stdout
    assert "capture and 100 replays SKIPPED (no CUDA graphs on CPU)" in proc.stdout
    assert "SKIP (a2) interleaving" in proc.stdout
    report = json.loads(out.read_text())
    assert {"commit", "gpu", "torch", "nccl"} <= set(report["header"])
    timed = [r for r in report["latency"] if "median_ms" in r]
    assert {(r["geometry"], r["route"], r["how"]) for r in timed} == {
        (g, r, h) for g in ("wan720p", "h3-32k") for r in ("auto", "off") for h in ("eager", "compiled")}
    assert all(r["iters"] >= 50 and r["p10_ms"] <= r["median_ms"] <= r["p90_ms"] for r in timed)
    assert all(r["ran"].startswith("fused") for r in timed if r["route"] == "auto")


def test_graph_check_script_fails_when_the_fused_plan_did_not_run():
    """Negative control: a window too small for the block's operands makes the fused route decline (window),
    so the plan assertion of check (a) must fail and the script exit non-zero."""
    proc = _run_check(FASTVIDEO_ULYSSES_A2A_WINDOW_BYTES="1024")
    assert proc.returncode != 0, proc.stdout[-3000:]
    assert "FAIL (a) graph replay" in proc.stdout and "no fused plan to assert" in proc.stdout
    assert "FAIL (c) latency" in proc.stdout and "did not run the fused route" in proc.stdout
    assert "0 passed, 4 failed" in proc.stdout


def test_graph_check_script_refuses_without_two_gpus():
    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        pytest.skip("this host has 2+ GPUs; the refusal path is for smaller hosts")
    import pathlib
    import subprocess
    import sys

    script = pathlib.Path(__file__).with_name("check_ulysses_graphs.py")
    proc = subprocess.run([sys.executable, str(script)], env=script_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "needs 2+ GPUs" in proc.stderr and "nothing was checked" in proc.stderr


def _capture_plans_from_sm_rows(rank, world_size):
    from tests.distributed.conftest import fixture_rows

    table = fixture_rows(engine="ce", ctas=132) + fixture_rows(engine="sm")  # a key's ce row first, as in the table
    h = build_helper(transport=RecordingTransport(), table=table)
    x = rank_input(rank, SHAPE, seed=0)
    with forced_capture(h), torch.no_grad():
        a2a(h, x, 0)
    with torch.no_grad():
        y = a2a(h, x, 0)
    result = ([(r.plan.engine, r.plan.ctas, r.captured) for r in h.history], bit_equal(y, oracle(x, 0)))
    h.destroy()
    return result


@READS_LONG_TRAINING
def test_capture_plans_from_the_sm_rows(ranks):
    """A key with a copy-engine row (first) and an SM row: a captured call freezes the SM row's plan (the
    copy-engine kind cannot be captured), an eager call runs the copy-engine plan; both exact."""
    for records, exact in ranks(2, _capture_plans_from_sm_rows, timeout_s=60):
        assert records == [("sm", 144, True), ("ce", 132, False)] and exact


def _capture_engines(rank, world_size, engines_by_rank, ce_capture):
    from tests.distributed.conftest import fixture_rows

    table = fixture_rows(engine="ce", ctas=132) + fixture_rows(engine="sm")
    entries = frozenset({ENTRY_CE_CAPTURE}) if ce_capture else frozenset()
    t = RecordingTransport(entries=entries)
    h = build_helper(transport=t, table=table)
    if engines_by_rank[rank] is not None:
        h.capture_engines = engines_by_rank[rank]
    x = rank_input(rank, SHAPE, seed=0)
    with forced_capture(h), torch.no_grad():
        y_captured = a2a(h, x, 0)
    exact = None
    if t.captured:
        t.replay()  # the device side of a replay: the frozen plan, collective on every rank
        exact = bit_equal(t.captured[0].out, oracle(x, 0))
    else:
        exact = bit_equal(y_captured, oracle(x, 0))  # declined: the NCCL route ran at capture
    record = h.history[-1]
    result = ((record.route, record.plan.engine if record.plan else None, record.captured,
               record.reason.label if record.reason else None), exact)
    h.destroy()
    return result


@READS_LONG_TRAINING
@pytest.mark.parametrize(("engines", "ce_capture", "expected"), [
    pytest.param((None, None), True, ("fused", "sm", True, None), id="default-sm-rows"),
    pytest.param((("ce", "sm"), ("ce", "sm")), True, ("fused", "ce", True, None), id="opted-in-ce"),
    pytest.param((("ce", "sm"), ("ce", "sm")), False, ("fused", "sm", True, None), id="no-ce-capture-build"),
    pytest.param((("ce", "sm"), None), True, ("nccl", None, False, "peer_disagreement"), id="ranks-differ"),
])
def test_capture_engines_choose_the_captured_plan_kind(ranks, engines, ce_capture, expected):
    """``capture_engines`` decides which rows a capture plans from: the SM rows by default; the copy-engine
    row when every rank opted in and the build captures that kind; ranks that differ decline together."""
    for record, exact in ranks(2, _capture_engines, engines, ce_capture, timeout_s=60):
        assert record == expected and exact


def test_capture_engines_rejects_unknown_engines():
    from fastvideo.distributed.ulysses.planner import Planner

    planner = Planner.__new__(Planner)  # the setter's check needs no configuration
    with pytest.raises(ValueError, match="not among"):
        planner.capture_engines = ("tma",)


def _captured_backward_of_an_eager_copy_engine_forward(rank, world_size, opt_in):
    from tests.distributed.conftest import fixture_rows

    table = fixture_rows(engine="ce", ctas=132) + fixture_rows(engine="sm")
    t = RecordingTransport(entries=frozenset({ENTRY_CE_CAPTURE}))
    h = build_helper(transport=t, table=table)
    if opt_in:
        h.capture_engines = ("ce", "sm")
    x = rank_input(rank, SHAPE, seed=0).requires_grad_()
    y = a2a(h, x, 0)  # eager: the copy-engine row's plan
    g = rank_input(rank, tuple(y.shape), seed=1)
    with forced_capture(h):  # the backward is captured (a graph of the backward pass only)
        (gx,) = torch.autograd.grad(y, x, g)
    forward, backward = h.history[-2], h.history[-1]
    exact = bit_equal(gx, oracle(g, 1)) if not t.captured else None
    if t.captured:
        t.replay()
        exact = bit_equal(t.captured[-1].out, oracle(g, 1))
    result = ((forward.route, forward.plan.engine), (backward.route, backward.captured,
              backward.plan.engine if backward.plan else None, backward.reason.label if backward.reason else None),
              exact)
    h.destroy()
    return result


@READS_LONG_TRAINING
@pytest.mark.parametrize(("opt_in", "expected_backward"), [
    pytest.param(False, ("nccl", False, None, "cuda_graph_capture"), id="default-declines"),
    pytest.param(True, ("fused", True, "ce", None), id="opted-in-captures"),
])
def test_a_captured_backward_keeps_to_capture_engines(ranks, opt_in, expected_backward):
    """A backward runs its forward's plan: an eager copy-engine forward whose backward is captured must not
    freeze the copy-engine kind unless ``capture_engines`` allows it; by default every rank declines
    ``cuda_graph_capture`` (the NCCL route is captured)."""
    for forward, backward, exact in ranks(2, _captured_backward_of_an_eager_copy_engine_forward, opt_in,
                                          timeout_s=60):
        assert forward == ("fused", "ce") and backward == expected_backward and exact
