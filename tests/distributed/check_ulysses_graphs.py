"""The fused route inside CUDA graphs and torch.compile, on 2+ GPUs: exactness, plans, latency.

    NCCL_NVLS_ENABLE=0 python -m torch.distributed.run --standalone --nproc_per_node=2 \\
        tests/distributed/check_ulysses_graphs.py --json OUT.json [--quick]

Checks (each prints PASS/FAIL on rank 0, every verdict agreed over the SP group's CPU group so that a
failure on one rank fails every rank at once; exit 1 when any failed):

(a) ``graph replay``: an SP attention block (LayerNorm -> QKV linear -> all-to-all mode 0 -> SDPA on the
    local heads -> all-to-all mode 1 -> proj), forward and backward, warmed up on a side stream under
    ``FASTVIDEO_ULYSSES_A2A=auto`` and captured with ``torch.cuda.graph``. The capture must have frozen
    the fused plan (``helper.history``: 4 captured fused records, 2 forwards and their backwards, with the
    policy's plans). Then 100 replays, each with fresh inputs copied into the static input and upstream
    gradient: the output and the input and parameter gradients bit-exact against the eager block on the
    NCCL route (``off``, the repo's oracle), and the helper's sequence number and history unchanged (no
    vote per replay). Controls: the eager oracle is deterministic (two runs bit-identical), the same block
    captured on the NCCL route replays exactly (a mismatch of the fused capture is then the fused route's),
    the plan assertion fails against a perturbed plan, and the exactness check fails on a perturbed output.
(a2) ``replay/eager interleaving``: replays on the current stream alternating with eager fused calls on a
    side stream without host synchronisation (the ordering through the library's completion event), all
    exact.
(b) ``torch.compile(mode="reduce-overhead")`` of the same block: the op is cudagraph-unsafe, so it runs
    (and votes) between the captured partitions; compiled under ``auto`` bit-exact against the same
    compiled block under ``off``; the routes that ran are recorded.
(c) ``latency``: the op alone (mode 0, bf16, SP per-rank shards) for wan720p (1, 75600, 40, 128) and h3-32k
    (3, 32768, 56, 128): eager, torch.compile'd and CUDA-graph replay, fused (``auto``) and NCCL (``off``),
    host-to-completion medians with p10/p90 over >= 50 iterations (rank max per iteration), printed as a
    table and written to the JSON with the commit (``COMMIT`` if present), GPU, torch and NCCL.

The SDPA backend is pinned to the math kernel (deterministic forward and backward; flash-attention's
backward may accumulate with atomics) and ``CUBLAS_WORKSPACE_CONFIG`` is set, so that exactness is judged
on deterministic kernels; the oracle control checks it.

``--capture-engines`` (default: the policy's ``CAPTURE_ENGINES``, the SM rows) sets every rank's
``UlyssesHelper.capture_engines`` before its first capture: ``--capture-engines ce,sm`` captures the H200 keys'
copy-engine rows (the build's ``ce_capture`` offering), and (a)'s plan assertion then expects those plans.

``--cpu-dry-run`` runs the script's own logic over 2+ gloo ranks with the CPU transport at small sizes:
(a) eager only (no CUDA graphs on CPU: the capture, replays and interleaving are skipped, saying so), (b)
with ``backend="aot_eager"`` (reduce-overhead needs CUDA), (c) eager and compiled rows only. Never a result.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time
import traceback
from collections.abc import Callable

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA initialises: deterministic cuBLAS

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "benchmarks"))

import common as bench  # noqa: E402

from fastvideo.distributed import parallel_state  # noqa: E402
from fastvideo.distributed.communication_op import sequence_model_parallel_all_to_all_4D as a2a  # noqa: E402
from fastvideo.distributed.ulysses import helper as helper_mod  # noqa: E402
from fastvideo.distributed.ulysses import registry  # noqa: E402
from fastvideo.distributed.ulysses.policy import CAPTURE_ENGINES, ENGINES, Geometry, Plan  # noqa: E402
from tests.distributed.check_launch import init_check_group  # noqa: E402

GEOMETRIES = {"wan720p": (1, 75600, 40, 128), "h3-32k": (3, 32768, 56, 128)}  # global [B, S, H, D]
DRY_RUN_SCALE = 512
REPLAYS = 100
AUTO, OFF = "auto", "off"


class AgreedFailure(AssertionError):
    """A failure every rank raised together, naming each failing rank."""


class PlanMismatch(AssertionError):
    """A record's route, phase, capture flag or plan is not the expected one."""


def wrong(a: torch.Tensor, b: torch.Tensor) -> int:
    """Elements whose bits differ (shape or dtype mismatch: every element)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return max(a.numel(), b.numel())
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return int((a.detach().contiguous().view(ints) != b.detach().contiguous().view(ints)).sum().item())


def route(name: str):
    """Collective: the SP group agrees this route for the block (``override_ulysses_settings``)."""
    return parallel_state.override_ulysses_settings(FASTVIDEO_ULYSSES_A2A=name,
                                                    FASTVIDEO_ULYSSES_A2A_LONG_TRAINING="auto")


class Block(nn.Module):
    """LayerNorm -> QKV linear -> all-to-all (mode 0) -> SDPA on the local heads -> all-to-all (mode 1) -> proj."""

    def __init__(self, hidden: int, heads: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.norm = nn.LayerNorm(hidden, dtype=dtype, device=device)
        self.qkv = nn.Linear(hidden, 3 * hidden, dtype=dtype, device=device)
        self.proj = nn.Linear(hidden, hidden, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.qkv(self.norm(x)).view(b, s, 3, self.heads, self.head_dim)
        qkv = qkv.permute(2, 0, 1, 3, 4).reshape(3 * b, s, self.heads, self.head_dim).contiguous()
        q, k, v = a2a(qkv, 2, 1).split(b, dim=0)  # [B, S, H/P, D]
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        out = a2a(out.transpose(1, 2).contiguous(), 1, 2)  # [B, S/P, H, D]
        return self.proj(out.reshape(b, s, -1))


class Check:
    def __init__(self, quick: bool, dry_run: bool, capture_engines: tuple[str, ...] = CAPTURE_ENGINES) -> None:
        self.capture_engines = capture_engines  # the plan kinds a capture may freeze (every rank the same)
        self.sp = parallel_state.get_sp_group()
        self.p, self.rank, self.device = self.sp.world_size, self.sp.rank_in_group, self.sp.device
        self.cuda = self.device.type == "cuda"
        self.quick, self.dry_run = quick, dry_run
        self.dtype = torch.bfloat16 if self.cuda else torch.float32
        self.results: list[dict] = []
        self.latency: list[dict] = []
        # The block: Wan-like heads (H=40, D=128) over 8192 tokens on GPU; small on CPU.
        self.hidden, self.heads, self.seq = (5120, 40, 8192) if self.cuda else (64, 8, 16 * self.p)
        torch.manual_seed(0)  # the same parameters on every rank
        self.block = Block(self.hidden, self.heads, self.dtype, self.device)
        self.params = list(self.block.parameters())

    # ------------------------------------------------------------------ plumbing

    def log(self, message: str) -> None:
        if self.rank == 0:
            print(message, flush=True)

    def agree(self, error: str) -> None:
        errors: list = [None] * self.p
        dist.all_gather_object(errors, error, group=self.sp.cpu_group)
        bad = [f"rank {r}: {e}" for r, e in enumerate(errors) if e]
        if bad:
            raise AgreedFailure("; ".join(bad))

    def check(self, name: str, fn: Callable[[], str]) -> None:
        start = time.perf_counter()
        self.log(f"... {name}")
        error = ""
        try:
            detail = fn()
        except AgreedFailure as exc:
            detail, error = "", str(exc)
        except Exception as exc:  # noqa: BLE001 - every check reports; the script goes on
            detail, error = "", f"{type(exc).__name__}: {exc}"
            if os.environ.get("GATE_TRACEBACK"):
                traceback.print_exc()
        if self.cuda:
            torch.cuda.synchronize()
        try:
            self.agree(error)
            ok = True
        except AgreedFailure as exc:
            ok, error = False, str(exc)
        row = {"check": name, "ok": ok, "detail": detail, "error": error, "s": round(time.perf_counter() - start, 2)}
        self.results.append(row)
        self.log(f"{'PASS' if ok else 'FAIL'} {name} ({row['s']:.1f} s) {detail or error}")

    def helper(self) -> helper_mod.UlyssesHelper:
        h = registry.current_default_helper()
        if h is None:
            raise RuntimeError("no default helper: the auto route never ran")
        if not h.fused_available:
            raise RuntimeError(f"the fused route declined at construction: {h.construction_reason} "
                               f"({h.construction_detail})")
        if h.capture_engines != self.capture_engines:
            h.capture_engines = self.capture_engines
        return h

    def inputs(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay i's input shard and upstream gradient (rank-distinct, reproducible)."""
        g = torch.Generator(device=self.device).manual_seed(7919 * i + self.rank)
        shape = (1, self.seq // self.p, self.hidden)
        x = torch.randn(shape, generator=g, device=self.device, dtype=self.dtype)
        return x, torch.randn(shape, generator=g, device=self.device, dtype=self.dtype)

    def step(self, x: torch.Tensor, grad_out: torch.Tensor, block: Callable | None = None) -> list[torch.Tensor]:
        """Forward and backward of the block: [output, input grad, parameter grads...]."""
        out = (self.block if block is None else block)(x)
        grads = torch.autograd.grad(out, [x, *self.params], grad_out)
        return [out, *grads]

    def eager(self, name: str, x: torch.Tensor, g: torch.Tensor) -> list[torch.Tensor]:
        with route(name):
            return [t.detach().clone() for t in self.step(x.detach().clone().requires_grad_(), g)]

    def expected_plans(self, h, captured: bool = False) -> list[tuple[str, int, Plan]]:
        """(phase, mode, plan) of the block's four calls as the policy promises (backwards run their forward's);
        under capture, from the rows that can be frozen (the helper's ``plan_for(capturing=True)``)."""
        hl, s = self.heads // self.p, self.seq // self.p
        geoms = [Geometry.from_input((3, s, self.heads, self.head_dim), 0, self.p, self.dtype),
                 Geometry.from_input((1, self.seq, hl, self.head_dim), 1, self.p, self.dtype)]
        plans = []
        for geom in geoms:
            choice = h.plan_for(geom, grad=True, long_training="auto", capturing=captured)
            if choice.plan is None:
                raise PlanMismatch(f"the policy declines {geom} ({choice.reason.label if choice.reason else '?'}): "
                                   "no fused plan to assert")
            plans.append(choice.plan)
        return [("FORWARD_GRAD", 0, plans[0]), ("FORWARD_GRAD", 1, plans[1]), ("BACKWARD", 0, plans[1]),
                ("BACKWARD", 1, plans[0])]

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @staticmethod
    def assert_records(records, expected, captured: bool) -> None:
        got = [(r.route, r.phase.name, r.mode, r.plan, r.captured) for r in records]
        want = [("fused", phase, mode, plan, captured) for phase, mode, plan in expected]
        if got != want:
            raise PlanMismatch(f"expected {want}, ran {got}")

    # ------------------------------------------------------------------ (a) capture and replay

    def graph_replay(self) -> str:
        x0, g0 = self.inputs(0)
        ref_a, ref_b = self.eager(OFF, x0, g0), self.eager(OFF, x0, g0)
        nondet = sum(wrong(a, b) for a, b in zip(ref_a, ref_b, strict=True))
        if nondet:
            raise AssertionError(f"the eager NCCL-route oracle is not deterministic ({nondet} elements differ "
                                 "between two runs): exactness cannot be judged")
        if not self.cuda:
            fused = self.eager(AUTO, x0, g0)
            h = self.helper()
            self.assert_records(list(h.history)[-4:], self.expected_plans(h), captured=False)
            bad = sum(wrong(a, b) for a, b in zip(fused, ref_a, strict=True))
            if bad:
                raise AssertionError(f"eager fused block: {bad} elements differ from the NCCL route")
            return ("CPU dry run: eager fused block exact with its plans asserted; capture and 100 replays "
                    "SKIPPED (no CUDA graphs on CPU)")
        graph, static_x, static_g, static_out = self.capture(AUTO)
        h = self.helper()
        records = list(h.history)[-4:]
        self.assert_records(records, self.expected_plans(h, captured=True), captured=True)
        seq, length = h.stats()["calls"], len(h.history)
        bad_replays, worst = 0, 0
        with route(OFF):  # the graph ignores the setting (the plan is frozen); the oracle needs it
            for i in range(REPLAYS):
                x, g = self.inputs(1 + i)
                with torch.no_grad():
                    static_x.copy_(x)
                    static_g.copy_(g)
                graph.replay()
                ref = self.eager(OFF, x, g)
                n = sum(wrong(a, b) for a, b in zip(static_out, ref, strict=True))
                bad_replays += bool(n)
                worst = max(worst, n)
        if (h.stats()["calls"], len(h.history)) != (seq, length):
            raise AssertionError(f"replays did host work: sequence {seq} -> {h.stats()['calls']}, history {length} -> "
                                 f"{len(h.history)}")
        if bad_replays:
            raise AssertionError(f"{bad_replays}/{REPLAYS} replays differ from the eager NCCL route "
                                 f"(worst {worst} elements)")
        plans = "; ".join(f"{r.phase.name.lower()} mode {r.mode}: {r.plan.describe(g)}" for r, g in zip(
            records, self._record_geoms(), strict=True))
        del graph
        return f"captured fused ({plans}); {REPLAYS} replays exact (output, input and {len(self.params)} " \
               "parameter grads), no vote per replay"

    def _record_geoms(self) -> list[Geometry]:
        hl, s = self.heads // self.p, self.seq // self.p
        g0 = Geometry.from_input((3, s, self.heads, self.head_dim), 0, self.p, self.dtype)
        g1 = Geometry.from_input((1, self.seq, hl, self.head_dim), 1, self.p, self.dtype)
        return [g0, g1, Geometry.from_input((1, s, self.heads, self.head_dim), 0, self.p, self.dtype),
                Geometry.from_input((3, self.seq, hl, self.head_dim), 1, self.p, self.dtype)]

    def capture(self, name: str):
        """Warm up on a side stream (as torch requires), then capture forward and backward under ``name``."""
        static_x, static_g = self.inputs(0)
        static_x.requires_grad_()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with route(name), torch.cuda.stream(side):
            for _ in range(3):
                self.step(static_x, static_g)
        torch.cuda.current_stream().wait_stream(side)
        if name == AUTO:
            self.helper()  # built by the warm-up: takes --capture-engines before the capture plans
        graph = torch.cuda.CUDAGraph()
        with route(name), torch.cuda.graph(graph):
            static_out = self.step(static_x, static_g)
        return graph, static_x, static_g, static_out

    def nccl_graph_control(self) -> str:
        """The same block captured on the NCCL route replays exactly (so a fused-capture mismatch is the fused
        route's, not the graph's)."""
        graph, static_x, static_g, static_out = self.capture(OFF)
        bad = 0
        with route(OFF):
            for i in range(10):
                x, g = self.inputs(500 + i)
                with torch.no_grad():
                    static_x.copy_(x)
                    static_g.copy_(g)
                graph.replay()
                bad += sum(wrong(a, b) for a, b in zip(static_out, self.eager(OFF, x, g), strict=True))
        if bad:
            raise AssertionError(f"the NCCL-route capture differs from eager by {bad} elements over 10 replays")
        return "NCCL route captured: 10 replays exact"

    def negative_controls(self) -> str:
        """The plan assertion and the exactness count can fail."""
        h = self.helper()
        records = [r for r in h.history if r.route == "fused"][-4:]
        captured = bool(records and records[-1].captured)
        expected = self.expected_plans(h, captured=captured)
        self.assert_records(records, expected, captured=captured)  # holds, so the control below means something
        perturbed = [(ph, mode, Plan(plan.ctas - 1 if plan.ctas > 1 else 2, plan.planes_per_chunk,
                                     plan.rows_per_chunk, plan.tuned, plan.engine)) for ph, mode, plan in expected]
        try:
            self.assert_records(records, perturbed, captured=captured)
        except PlanMismatch:
            pass
        else:
            raise AssertionError("the plan assertion passed against a perturbed plan")
        x, g = self.inputs(0)
        ref = self.eager(OFF, x, g)
        flipped = ref[0].clone()
        ints = flipped.view(-1).view({2: torch.int16, 4: torch.int32}[flipped.element_size()])
        ints[0] ^= 1  # one bit of one element
        if wrong(flipped, ref[0]) != 1:
            raise AssertionError("the exactness count missed a perturbed output element")
        return "plan assertion failed against a perturbed plan; a perturbed output counted 1 wrong element"

    def interleaving(self) -> str:
        """Replays on the current stream alternating with eager fused calls on a side stream, no host sync."""
        graph, static_x, static_g, static_out = self.capture(AUTO)
        side = torch.cuda.Stream()
        shape = (3, self.seq // self.p, self.heads, self.head_dim)
        kept, eager_io = [], []
        with route(AUTO), torch.no_grad():
            for i in range(20):
                x, g = self.inputs(900 + i)
                static_x.copy_(x)
                static_g.copy_(g)
                graph.replay()
                kept.append((x, g, static_out[0].clone()))
                with torch.cuda.stream(side):
                    xe = torch.randn(shape, device=self.device, dtype=self.dtype)
                    eager_io.append((xe, a2a(xe, 2, 1)))
                # No stream sync: the next replay is ordered after this eager call by the library alone.
        torch.cuda.synchronize()
        h = self.helper()
        eager_fused = [r for r in list(h.history)[-20:] if r.route == "fused" and not r.captured]
        if len(eager_fused) != 20:
            raise AssertionError(f"only {len(eager_fused)}/20 eager calls took the fused route")
        bad = 0
        for x, g, out in kept:  # the reference runs forward and backward: outside no_grad
            bad += wrong(out, self.eager(OFF, x, g)[0])
        with route(OFF), torch.no_grad():
            for xe, ye in eager_io:
                bad += wrong(ye, a2a(xe, 2, 1))
        if bad:
            raise AssertionError(f"{bad} wrong elements with replays and eager fused calls interleaved")
        return "20 replays and 20 eager fused calls on another stream interleaved without host sync: exact"

    # ------------------------------------------------------------------ (b) torch.compile

    def compiled(self) -> str:
        if self.cuda:
            fn = torch.compile(self.block, mode="reduce-overhead")
            how = 'mode="reduce-overhead"'
        else:
            fn = torch.compile(self.block, backend="aot_eager")
            how = 'backend="aot_eager" (CPU dry run: reduce-overhead needs CUDA)'
        results, routes = {}, {}
        for name in (AUTO, OFF):
            before = len(self.helper().history) if name == AUTO else 0
            with route(name):
                for i in range(3):  # cudagraph trees record on the later runs
                    if self.cuda:
                        torch.compiler.cudagraph_mark_step_begin()
                    x, g = self.inputs(300 + i)
                    out = [t.detach().clone() for t in self.step(x.requires_grad_(), g, block=fn)]
            results[name] = out
            if name == AUTO:
                recs = list(self.helper().history)[before:]
                routes[name] = sorted({f"{r.route}{' captured' if r.captured else ''}" for r in recs})
                if not recs or any(r.route != "fused" for r in recs):
                    raise AssertionError(f"compiled calls under auto did not all take the fused route: {routes}")
            else:
                routes[name] = ["nccl (off: no helper)"]
        bad = sum(wrong(a, b) for a, b in zip(results[AUTO], results[OFF], strict=True))
        if bad:
            raise AssertionError(f"compiled block: auto differs from off by {bad} elements")
        eager = self.eager(OFF, *self.inputs(302))
        diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(results[OFF], eager, strict=True))
        self.compile_routes = routes
        return (f"{how}: auto (routes {routes[AUTO]}) bit-exact vs off; max |compiled - eager| {diff:.3g} "
                "(inductor's own kernels, informational)")

    # ------------------------------------------------------------------ (c) latency

    def latency_table(self) -> str:
        iters = 50 if self.quick else 100
        lines = []
        for label, (b, s_global, heads, d) in GEOMETRIES.items():
            s_global //= DRY_RUN_SCALE if self.dry_run else 1
            s_local = max(1, s_global // self.p)
            x = torch.randn((b, s_local, heads, d), device=self.device, dtype=self.dtype)
            compiled = torch.compile(lambda t: a2a(t, 2, 1), backend="inductor" if self.cuda else "aot_eager")
            for name in (AUTO, OFF):
                modes: list[tuple[str, Callable[[], object] | None, str]] = [
                    ("eager", lambda x=x: a2a(x, 2, 1), ""), ("compiled", lambda x=x, c=compiled: c(x), "")]
                if self.cuda:
                    modes.append(("graph replay", self.graph_of_op(x, name), ""))
                else:
                    modes.append(("graph replay", None, "skipped: no CUDA graphs on CPU"))
                for mode, fn, note in modes:
                    row = {"geometry": label, "shape_per_rank": [b, s_local, heads, d], "route": name, "how": mode}
                    if fn is None:
                        row.update(note=note)
                    else:
                        with route(name), torch.no_grad():
                            times = bench.host_latencies(fn, self.device, iters, warmup=5)
                        row.update(bench.summarize(times), iters=iters)
                        if name == AUTO:
                            # A replay adds no history: its row reports the captured call's record.
                            last = getattr(fn, "record", None) or self.helper().history[-1]
                            row["ran"] = f"{last.route}{' (captured)' if last.captured else ''}" + (
                                f" {last.plan.describe(Geometry.from_input(x.shape, 0, self.p, self.dtype))}"
                                if last.plan else f" ({last.reason.label})")
                        else:
                            row["ran"] = "nccl"
                    self.latency.append(row)
        lines.append(f"{'geometry':<9} {'route':<5} {'how':<13} {'median ms':>10} {'p10':>8} {'p90':>8}  ran")
        for r in self.latency:
            if "median_ms" in r:
                lines.append(f"{r['geometry']:<9} {r['route']:<5} {r['how']:<13} {r['median_ms']:>10.3f} "
                             f"{r['p10_ms']:>8.3f} {r['p90_ms']:>8.3f}  {r['ran']}")
            else:
                lines.append(f"{r['geometry']:<9} {r['route']:<5} {r['how']:<13} {r['note']}")
        self.log("\n".join(lines))
        declined = [f"{r['geometry']} {r['how']}: {r['ran']}" for r in self.latency
                    if r["route"] == AUTO and "ran" in r and not r["ran"].startswith("fused")]
        if declined:
            raise AssertionError(f"auto rows that did not run the fused route: {declined}")
        return f"{sum('median_ms' in r for r in self.latency)} rows, {iters} iterations each"

    def graph_of_op(self, x: torch.Tensor, name: str) -> Callable[[], object]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with route(name), torch.no_grad():
            with torch.cuda.stream(side):
                for _ in range(3):
                    a2a(x, 2, 1)
            torch.cuda.current_stream().wait_stream(side)
            if name == AUTO:
                self.helper()  # takes --capture-engines before the capture plans
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                a2a(x, 2, 1)
        def replay() -> None:
            graph.replay()

        if name == AUTO:
            last = self.helper().history[-1]
            if not (last.route == "fused" and last.captured):
                raise AssertionError(f"the op's capture under auto did not freeze the fused route: {last}")
            replay.record = last  # type: ignore[attr-defined]
        return replay

    # ------------------------------------------------------------------ run

    def run(self) -> int:
        if not self.cuda:
            bench.install_cpu_transport_helper()  # auto on CPU: the fused pipeline over gloo
        with route(AUTO), torch.no_grad():  # build the default helper (collective) before any capture
            a2a(torch.zeros((1, self.p, self.p, 8), device=self.device, dtype=self.dtype), 2, 1)
        self.check("(a) graph replay: captured fused block vs eager NCCL route", self.graph_replay)
        if self.cuda:
            self.check("(a) control: the block captured on the NCCL route replays exactly", self.nccl_graph_control)
        self.check("(a) negative controls: the plan and exactness assertions can fail", self.negative_controls)
        if self.cuda:
            self.check("(a2) replays and eager fused calls interleaved on two streams", self.interleaving)
        else:
            self.log("SKIP (a2) interleaving: no CUDA graphs on CPU")
        self.check("(b) torch.compile of the block, auto vs off", self.compiled)
        self.check("(c) latency: eager, compiled, graph replay", self.latency_table)
        failed = [r for r in self.results if not r["ok"]]
        self.log(f"{len(self.results) - len(failed)} passed, {len(failed)} failed")
        return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=pathlib.Path, help="write the results here (rank 0)")
    parser.add_argument("--quick", action="store_true", help="50 latency iterations (100 without)")
    parser.add_argument("--cpu-dry-run", action="store_true", help="the script's logic over gloo at small sizes")
    parser.add_argument("--capture-engines", default=",".join(CAPTURE_ENGINES),
                        help="comma list of the plan kinds a capture may freeze (UlyssesHelper.capture_engines): "
                             f"default the policy's ({','.join(CAPTURE_ENGINES)}); 'ce,sm' captures the copy-engine "
                             "rows where the build offers ce_capture")
    args = parser.parse_args()
    capture_engines = tuple(e.strip() for e in args.capture_engines.split(",") if e.strip())
    unknown = [e for e in capture_engines if e not in ENGINES]
    if unknown:
        parser.error(f"--capture-engines: {unknown} not among {ENGINES}")
    start = time.perf_counter()
    if not init_check_group("check_ulysses_graphs", args.cpu_dry_run):
        return 2
    if not args.cpu_dry_run:
        # Deterministic attention for the exactness checks (flash-attention's backward may use atomics).
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        torch.backends.cuda.enable_cudnn_sdp(False)
        torch.backends.cuda.enable_math_sdp(True)
    parallel_state.initialize_sequence_parallel(dist.get_world_size())
    check = Check(args.quick, args.cpu_dry_run, capture_engines)
    header = bench.env_header(check.device, check.p, extra={
        "script": "tests/distributed/check_ulysses_graphs.py", "quick": args.quick, "sdpa": "math",
        "capture_engines": list(capture_engines),
        "block": {"hidden": check.hidden, "heads": check.heads, "seq_global": check.seq, "dtype": str(check.dtype)}})
    if args.cpu_dry_run:
        header["note"] = ("DRY RUN: gloo + CPU transport, small sizes; CUDA graphs skipped; tests the script's "
                          "logic, never a result")
    if check.rank == 0:
        bench.print_header(header)
    try:
        rc = check.run()
        if check.rank == 0:
            header["native_library"] = bench.native_library(registry.current_default_helper())
    finally:
        parallel_state.destroy_sequence_parallel()
    elapsed = time.perf_counter() - start
    check.log(f"elapsed {elapsed:.0f} s")
    if check.rank == 0 and args.json:
        args.json.write_text(json.dumps({"header": header, "results": check.results, "latency": check.latency,
                                         "elapsed_s": round(elapsed, 1)}, indent=1))
    dist.destroy_process_group()
    return rc


if __name__ == "__main__":
    sys.exit(main())
