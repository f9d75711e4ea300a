"""The native gate: the fused route against the NCCL route on 2+ GPUs, with the plans that ran asserted.

    torchrun --standalone --nproc_per_node=N tests/distributed/check_ulysses_h3_native.py [--quick] [--json PATH]

Checks (each prints PASS/FAIL on rank 0; the summary line is ``N passed, N failed``):

* parity: H=56, D=128, bf16, packed QKV (B=3) and QKVG (B=4) at 32k, 128k and 250k global tokens,
  and Wan 720p (1, 75600, 40, 128): the fused forward is bit-identical to the NCCL route's, the
  gradient (the inverse all-to-all of the same upstream gradient) too, and the forward and
  backward plans that actually ran (route, CTAs, chunking) are the ones the policy promises;
* long training: grad-tracked planes over 512 MiB keep the original policy under ``auto`` and take
  tuned chunks under ``chunked``;
* output ownership: a retained output is unchanged by later calls and never aliases the window;
* recovery: one rank losing capability for one call declines every rank together, the next call
  runs fused again;
* plan sweep: every plan kind at 32k and 250k in both modes (the original plan; whole operand, 2 planes
  then 1, one plane; even and uneven sub-plane row chunks; window-limited rows; 1, 36, 72 and 144 CTAs),
  not just the plans the policy picks for this GPU: each bit-exact with its plan asserted;
* uneven parity: ``seq_splits`` / ``head_splits`` through the public op (Wan-like balanced tables at 75601
  tokens and 40 heads; skewed shares with rank 0's empty at 41 heads), each with the SM kind's and the
  copy-engine kind's rows, both modes, forward and backward: bit-exact against the ``off`` route, the fused
  plan (and its engine) asserted on the forward and the backward;
* DistributedAttention (replicated text tokens, rotary, skewed ``seq_splits``, 41 heads) on the fused route
  against its single-device reference, forward and backward, fp32; its 4 all-to-alls asserted fused;
* upstream parity worker: the helper from ``get_sp_group().device_communicator.ulysses_a2a``, its
  ``try_all_to_all_4D`` against ``DeviceCommunicatorBase.all_to_all_4D`` (the NCCL route), bf16/fp16/fp32,
  both directions and the round trip, then operands growing past the window and back; plans asserted;
* stress: 100 rounds of random shapes, dtypes, modes and windows (down to 256 KiB), bit-exact, plan
  asserted;
* epoch checker (``--epoch-check``, native only, on the test library: run with
  ``FASTVIDEO_KERNEL_LIBRARY=.../libfastvideo_ulysses_a2a_testing.so``): uneven plans through the test
  library's epoch-checked launch (``tests/kernel/native_testing.debug_execute``), which stamps every window
  granule; 0 violations with the kernel's layout, and violations reported with the pre-fix layout (the
  negative control on real hardware);
* negative controls, each of which must fail: with tuning disabled the plan assertions of a parity case; an
  uneven copy-engine run checked against the SM kind's plan and against a reference with the head table
  reversed; DistributedAttention on the ``off`` route (the route assertion) and read at the balanced shards'
  rows; ``ulysses_a2a`` on the ``off`` route and a reference from an input with one element changed.

Fail fast and together: every check's verdict, and every round of the sweep and the stress, is agreed
over the SP group's CPU group before any rank goes on, so a check that fails on one rank fails on every
rank at once and no rank is left waiting in a vote or a collective.

Where no measured tuned row exists for this GPU and geometry, the gate injects one (144 CTAs, one
plane per chunk) as a fixture so that tuned and original plans differ; the negative control runs
without it. With fewer than 2 GPUs the gate says so and exits non-zero.

``--cpu-dry-run`` runs the same checks over gloo ranks with the CPU transport (GlooPlanTransport),
with every sequence length, the window and the 512 MiB long-training boundary divided by the same
factor (512), so every policy branch the real gate meets (tuned planes, the long-training fallback,
sub-plane chunks) is taken at a size a CPU can hold. It tests the gate's own logic; it is never a
gate result (it says so, and the native transport does not run).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import os
import pathlib
import random
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.distributed as dist

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from fastvideo import envs  # noqa: E402
from fastvideo.distributed import parallel_state  # noqa: E402
from fastvideo.distributed.communication_op import (  # noqa: E402
    balanced_splits,
    nccl_route,
    sequence_model_parallel_all_to_all_4D,
)
from fastvideo.distributed.device_communicators import ulysses_a2a  # noqa: E402
from fastvideo.distributed.device_communicators.base_device_communicator import DeviceCommunicatorBase  # noqa: E402
from fastvideo.distributed.ulysses import helper as helper_mod  # noqa: E402
from fastvideo.distributed.ulysses.contract import DeclineReason, Phase  # noqa: E402
from fastvideo.distributed.ulysses.policy import (  # noqa: E402
    ENGINE_CE,
    ENGINE_SM,
    TUNED_TABLE,
    Geometry,
    Plan,
    TunedRow,
    choose_plan,
    even_rows,
    lookup,
    normalize_gpu_name,
)
from tests.distributed.check_launch import init_check_group  # noqa: E402
from tests.distributed.conftest import a2a  # noqa: E402

H3 = {"32k": 32768, "128k": 131072, "250k": 250000}
WAN720P = 75600
WAN_UNEVEN = 75601  # a Wan-like token count no SP size from 2 to 8 divides
# DistributedAttention against its single-device reference: tokens, replicated text tokens, heads (no SP size
# from 2 to 8 divides 41), head dim; fp32 (SDPA on the GPU).
ATTENTION = {"tokens": 9451, "text": 512, "heads": 41, "dim": 128}
# Every check sets both variables itself: the gate's verdict must not depend on the caller's shell.
AUTO = {"FASTVIDEO_ULYSSES_A2A": "auto", "FASTVIDEO_ULYSSES_A2A_LONG_TRAINING": "auto"}
DRY_RUN_SCALE = 512  # --cpu-dry-run divides sequences, the window and the long-training boundary by this


class PlanMismatch(AssertionError):
    """The plan that ran is not the one the policy promises."""


class AgreedFailure(AssertionError):
    """A failure every rank raised together (after ``Gate.agree``), naming each failing rank."""


def _commit() -> str:
    stamp = ROOT / "COMMIT"
    if stamp.exists():
        return stamp.read_text().strip()
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=ROOT, text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _library() -> dict:
    try:
        import fastvideo_kernel

        info = dict(fastvideo_kernel.info())
    except Exception as exc:  # noqa: BLE001 - reported in the header
        return {"error": str(exc)}
    path = info.get("path")
    if path and os.path.exists(path) and "sha256" not in info:
        info["sha256"] = hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()
    return info


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _wrong(a: torch.Tensor, b: torch.Tensor) -> int:
    """Elements whose bits differ; every element where the shapes differ."""
    if a.shape != b.shape:
        return max(a.numel(), b.numel())
    return int((_bits(a) != _bits(b)).sum().item())


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute difference over the reference's largest magnitude (0 for two empty tensors)."""
    if a.shape != b.shape:
        return float("inf")
    if b.numel() == 0:
        return 0.0
    return (a.double() - b.double()).abs().max().item() / max(b.double().abs().max().item(), 1e-30)


def skewed_splits(total: int, world_size: int, zero_rank: int | None = None) -> tuple[int, ...]:
    """``total`` cut into shares growing with the rank (``zero_rank``'s share 0): a table no balanced cut gives."""
    weights = [0 if r == zero_rank else r + 1 for r in range(world_size)]
    shares = [total * w // sum(weights) for w in weights]
    shares[-1] += total - sum(shares)
    return tuple(shares)


class Gate:
    def __init__(self, quick: bool, dry_run: bool = False, epoch: bool = False,
                 inject_wrong_round: int = -1) -> None:
        self.sp = parallel_state.get_sp_group()
        self.p, self.rank = self.sp.world_size, self.sp.rank_in_group
        self.device = self.sp.device
        self.cuda = self.device.type == "cuda"
        self.gpu = normalize_gpu_name(torch.cuda.get_device_name(self.device)) if self.cuda else "CPU"
        self.quick = quick
        self.dry_run = dry_run
        self.epoch = epoch
        self.inject_wrong_round = inject_wrong_round
        self.scale = DRY_RUN_SCALE if dry_run else 1
        self.window_bytes = (1 << 30) // self.scale
        # The upstream head counts; an SP size that does not divide them (3, 5, 6, 7) runs the same
        # checks with the heads padded up to a multiple of it, and the check names say so.
        self.h3_heads, self.wan_heads = -(-56 // self.p) * self.p, -(-40 // self.p) * self.p
        self.results: list[dict] = []
        self.fixture = self._fixture_rows()

    def _fixture_rows(self) -> tuple[TunedRow, ...]:
        rows = list(TUNED_TABLE)
        for heads in (self.h3_heads, self.wan_heads):
            geom = Geometry(0, torch.bfloat16, 1, 1, heads, 128, self.p)
            if lookup(rows, self.gpu, geom) is None:
                rows.append(TunedRow(self.gpu, self.p, torch.bfloat16, heads, 128, ctas=144, planes_per_chunk=1,
                                     source="gate fixture (not a measurement)"))
        return tuple(rows)

    def tokens(self, s_global: int) -> int:
        """A global sequence length as this run uses it (scaled down in a dry run, a multiple of P)."""
        s = s_global // self.scale
        return max(self.p, s - s % self.p)

    def helper(self, table=None, window_bytes=None) -> helper_mod.UlyssesHelper:
        transport = None
        if self.dry_run:
            from tests.plan_transport import GlooPlanTransport

            transport = GlooPlanTransport()
        h = helper_mod.UlyssesHelper(self.sp, tuned_table=self.fixture if table is None else table,
                                     window_bytes=window_bytes or self.window_bytes, transport=transport,
                                     gpu_name=None if self.cuda else self.gpu)
        if not h.fused_available:
            raise RuntimeError(f"fused route declined at construction: {h.construction_reason} "
                               f"({h.construction_detail})")
        return h

    def agree(self, error: str) -> None:
        """Every rank's error for one step, gathered over the CPU group: raise on every rank if any failed.

        Called wherever one rank could fail alone (a wrong count, a plan assertion), before the next
        collective, so no rank goes on into a vote or an NCCL call that a failed peer never enters.
        """
        errors = [None] * self.p
        dist.all_gather_object(errors, error, group=self.sp.cpu_group)
        bad = [f"rank {r}: {e}" for r, e in enumerate(errors) if e]
        if bad:
            raise AgreedFailure("; ".join(bad))

    def check(self, name: str, fn: Callable[[], str]) -> None:
        start = time.perf_counter()
        error = ""
        try:
            detail = fn()
        except AgreedFailure as exc:  # already agreed: every rank raised it together
            detail, error = "", str(exc)
        except Exception as exc:  # noqa: BLE001 - every check reports, the gate goes on
            detail, error = "", f"{type(exc).__name__}: {exc}"
            if os.environ.get("GATE_TRACEBACK"):
                traceback.print_exc()
        try:
            self.agree(error)
            ok = True
        except AgreedFailure as exc:
            ok, error = False, str(exc)
        row = {"check": name, "ok": ok, "detail": detail, "error": error, "s": time.perf_counter() - start}
        self.results.append(row)
        if self.rank == 0:
            status = "PASS" if ok else "FAIL"
            print(f"[rank {self.rank}] {status} {name} ({row['s']:.1f} s) {detail or error}", flush=True)
        if self.cuda:
            torch.cuda.empty_cache()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    # ------------------------------------------------------------------ expectations

    def expected(self, h: helper_mod.UlyssesHelper, shape, grad: bool, long_training: str, table=None):
        geom = Geometry.from_input(shape, 0, self.p, torch.bfloat16)
        table = h.tuned_table if table is None else table
        return choose_plan(geom, gpu=h.gpu_name, window_bytes=h.window_bytes, grad=grad, long_training=long_training,
                           table=table), geom

    @staticmethod
    def assert_plan(record, want: Plan | None, phase: Phase) -> None:
        if record.phase != phase:
            raise PlanMismatch(f"expected a {phase.name} record, got {record.phase.name}")
        ran = record.plan if record.route == "fused" else None
        if ran != want:
            raise PlanMismatch(f"{phase.name}: expected {want}, ran {record.route} {ran} ({record.reason})")

    # ------------------------------------------------------------------ checks

    def parity(self, h, b: int, s_global: int, heads: int, *, grad: bool, long_training: str,
               expect_table=None) -> str:
        """Fused forward (and backward when ``grad``) bit-identical to the NCCL route; plans asserted."""
        shape = (b, self.tokens(s_global) // self.p, heads, 128)
        torch.manual_seed(1000 + self.rank + s_global + b)
        x = torch.randn(shape, dtype=torch.bfloat16, device=self.device)
        choice, geom = self.expected(h, shape, grad, long_training, expect_table)
        saved, h.long_training = h.long_training, long_training  # on every rank
        try:
            if grad:
                xg = x.clone().requires_grad_()
                y = a2a(h, xg, 0)
                upstream = torch.randn_like(y)
                (gx,) = torch.autograd.grad(y, xg, upstream)
            else:
                with torch.no_grad():
                    y = a2a(h, x, 0)
        finally:
            h.long_training = saved
        self.sync()
        ref = nccl_route(x, 0, self.sp.device_group)
        wrong = _wrong(y, ref)
        records = list(h.history)
        if grad:
            ref_g = nccl_route(upstream.contiguous(), 1, self.sp.device_group)
            wrong_g = _wrong(gx, ref_g)
            self.assert_plan(records[-2], choice.plan, Phase.FORWARD_GRAD)
            self.assert_plan(records[-1], choice.plan, Phase.BACKWARD)  # backward runs the forward's plan
        else:
            wrong_g = 0
            self.assert_plan(records[-1], choice.plan, Phase.FORWARD_NO_GRAD)
        if wrong or wrong_g:
            raise AssertionError(f"{wrong} wrong forward / {wrong_g} wrong gradient elements vs the NCCL route")
        ran = choice.plan.describe(geom) if choice.plan else f"nccl ({choice.reason.label})"
        return f"plane {geom.plane_bytes} B: {ran}; 0 wrong"

    def ownership(self, h) -> str:
        shape = (3, max(1, 4096 // self.scale), self.h3_heads, 128)
        x1 = torch.randn(shape, dtype=torch.bfloat16, device=self.device)
        with envs.override(**AUTO), torch.no_grad():
            y1 = a2a(h, x1, 0)
            keep = y1.clone()
            for _ in range(3):
                a2a(h, torch.randn_like(x1), 0)
        self.sync()
        if h.history[-1].route != "fused":
            raise AssertionError("ownership check did not run the fused route")
        if not torch.equal(_bits(y1), _bits(keep)):
            raise AssertionError("a retained output changed after later calls")
        window = getattr(h.transport, "window_range", None)
        if window is not None:
            lo, hi = window()
            ptr = y1.data_ptr()
            if lo <= ptr < hi:
                raise AssertionError("the output aliases the symmetric window")
        return "retained output unchanged after 3 later calls; not in the window"

    def recovery(self, h) -> str:
        shape = (3, max(1, 2048 // self.scale), self.h3_heads, 128)
        x = torch.randn(shape, dtype=torch.bfloat16, device=self.device)
        # One rank cannot take exactly one call: it passes the same values in a non-contiguous layout.
        local = x
        if self.rank == self.p - 1:
            local = torch.empty_strided(x.shape, (1, x.shape[0], x.shape[0] * x.shape[1],
                                                  x.shape[0] * x.shape[1] * x.shape[2]),
                                        dtype=x.dtype, device=x.device).copy_(x)
        with envs.override(**AUTO), torch.no_grad():
            y_declined = a2a(h, local, 0)
            first = h.history[-1]
            y_recovered = a2a(h, x, 0)
            second = h.history[-1]
        ref = nccl_route(x, 0, self.sp.device_group)
        if first.route != "nccl" or first.reason != DeclineReason.PEER_DISAGREEMENT:
            raise AssertionError(f"disagreement did not decline together: {first}")
        if second.route != "fused":
            raise AssertionError(f"the next compatible call did not recover: {second}")
        wrong = _wrong(y_declined, ref) + _wrong(y_recovered, ref)
        if wrong:
            raise AssertionError(f"{wrong} wrong elements")
        return "declined (peer_disagreement) on every rank, then fused again; 0 wrong"

    def stress(self, rounds: int) -> str:
        """Random shapes, dtypes, modes, grad flags, windows and plans; bit-exact, plan asserted every round.

        Tuned helpers carry a fixture row for every geometry the rounds can draw (random CTA counts and
        planes per chunk), so most rounds run tuned plans, sub-plane chunks included; the untuned
        helpers run the original whole-operand plan where it fits and decline where it does not.
        """
        rng = random.Random(4242)  # same sequence on every rank
        dtypes = (torch.bfloat16, torch.float16, torch.float32)
        head_dims = (128, 64, 80, 3, 7, 256)
        table = tuple(
            TunedRow(self.gpu, self.p, dt, hl * self.p, d, ctas=rng.choice((5, 36, 72, 132, 144)),
                     planes_per_chunk=rng.choice((1, 2)), source="gate stress fixture")
            for dt in dtypes for hl in range(1, 9) for d in head_dims
        )
        windows = (64 << 20, 1 << 20, 256 << 10)  # every row (<= 64 KiB at SP8) fits the smallest
        helpers = {(w, tuned): self.helper(table=table if tuned else (), window_bytes=w)
                   for w in windows for tuned in (True, False)}
        fused = 0
        try:
            for i in range(rounds):
                b, s, hl = rng.randint(1, 4), rng.randint(1, 700), rng.randint(1, 8)
                d = rng.choice(head_dims)
                mode, dtype, w = rng.randint(0, 1), rng.choice(dtypes), rng.choice(windows)
                h = helpers[(w, rng.random() < 0.75)]
                shape = (b, s, hl * self.p, d) if mode == 0 else (b, s * self.p, hl, d)
                gen = torch.Generator(device=self.device).manual_seed(i * 100 + self.rank)
                x = torch.randn(shape, generator=gen, device=self.device, dtype=torch.float32).to(dtype)
                grad = rng.random() < 0.3
                with envs.override(**AUTO):
                    if grad:
                        xg = x.clone().requires_grad_()
                        y = a2a(h, xg, mode)
                        up = torch.randn_like(y)
                        (gx,) = torch.autograd.grad(y, xg, up)
                    else:
                        with torch.no_grad():
                            y = a2a(h, x, mode)
                geom = Geometry.from_input(shape, mode, self.p, dtype)
                want = choose_plan(geom, gpu=h.gpu_name, window_bytes=w, grad=grad, long_training="auto",
                                   table=h.tuned_table).plan
                record = h.history[-2] if grad else h.history[-1]
                wrong = _wrong(y, nccl_route(x, mode, self.sp.device_group))
                if grad:
                    wrong += _wrong(gx, nccl_route(up.contiguous(), 1 - mode, self.sp.device_group))
                error = ""
                try:
                    self.assert_plan(record, want, Phase.FORWARD_GRAD if grad else Phase.FORWARD_NO_GRAD)
                    if grad:
                        self.assert_plan(h.history[-1], want, Phase.BACKWARD)
                except PlanMismatch as exc:
                    error = str(exc)
                if wrong:
                    error += f" {wrong} wrong"
                if i == self.inject_wrong_round and self.rank == self.p - 1:
                    wrong += 1  # --inject-wrong-round: this rank alone "sees" a wrong result (test of fail-fast)
                    error = error or f"{wrong} wrong (injected)"
                # Every round agreed before the next: a rank that found a wrong result stops every rank.
                self.agree(f"round {i} {shape} {dtype} mode {mode} window {w}: {error}" if error else "")
                fused += record.route == "fused"
        finally:
            for h in helpers.values():
                h.destroy()
        if fused < rounds // 2:
            raise AssertionError(f"only {fused}/{rounds} rounds ran the fused route: the stress did not stress it")
        return f"{rounds} rounds bit-exact, {fused} fused"

    def small_window(self) -> int:
        """2/5 of a 32k plane: every plane of the sweep exceeds it, so the policy cuts window-limited rows."""
        return (self.tokens(H3["32k"]) // self.p) * self.h3_heads * 128 * 2 * 2 // 5

    def sweep_candidates(self, b: int) -> list[tuple[str, tuple[TunedRow, ...], bool]]:
        """(label, table, small window?) per plan kind; the policy turns each into the plan the check asserts."""
        heads = self.h3_heads
        out: list[tuple[str, tuple[TunedRow, ...], bool]] = [("original (36 CTAs, whole operand)", (), False)]
        for ctas in (1, 36, 72, 144):
            for planes, row_chunks, label in ((b, 1, "whole"), (2, 1, "2 planes then 1"), (1, 1, "one plane"),
                                              (1, 2, "2 even row chunks"), (1, 3, "3 uneven row chunks")):
                row = TunedRow(self.gpu, self.p, torch.bfloat16, heads, 128, ctas=ctas, planes_per_chunk=planes,
                               row_chunks=row_chunks, source="gate sweep")
                out.append((f"{ctas} CTAs, {label}", (row,), False))
        row = TunedRow(self.gpu, self.p, torch.bfloat16, heads, 128, ctas=144, planes_per_chunk=1,
                       source="gate sweep")
        out.append(("144 CTAs, window-limited rows", (row,), True))
        # The copy-engine kind: the same chunk shapes (its chunks double-buffered in the window).
        for ctas in (7, 132):
            for planes, row_chunks, label in ((b, 1, "whole"), (2, 1, "2 planes then 1"), (1, 3, "3 uneven row chunks"),
                                              (1, 8, "8 row chunks")):
                row = TunedRow(self.gpu, self.p, torch.bfloat16, heads, 128, ctas=ctas, planes_per_chunk=planes,
                               row_chunks=row_chunks, source="gate sweep", engine="ce")
                out.append((f"copy engine, {ctas} CTAs, {label}", (row,), False))
        row = TunedRow(self.gpu, self.p, torch.bfloat16, heads, 128, ctas=132, planes_per_chunk=1,
                       source="gate sweep", engine="ce")
        out.append(("copy engine, window-limited rows", (row,), True))
        return out

    def copy_engine_table(self) -> tuple[TunedRow, ...]:
        """The fixture's rows for this GPU and SP size, as copy-engine rows."""
        return tuple(replace(r, engine="ce", ctas=132, source="gate fixture (copy engine)") for r in self.fixture
                     if r.gpu == self.gpu and r.world_size == self.p)

    def sweep(self, h, small_window_helper, b: int, s_global: int) -> str:
        """Every plan kind, both modes, no grad: bit-exact against the NCCL route, the plan asserted."""
        heads = self.h3_heads
        s_local = self.tokens(s_global) // self.p
        ran = []
        saved = h.tuned_table
        try:
            for label, table, window in self.sweep_candidates(b):
                helper = small_window_helper if window else h
                for mode in (0, 1):
                    shape = (b, s_local, heads, 128) if mode == 0 else (b, s_local * self.p, heads // self.p, 128)
                    geom = Geometry.from_input(shape, mode, self.p, torch.bfloat16)
                    if window and geom.plane_bytes <= helper.window_bytes:
                        raise AssertionError(f"{label}: the small window {helper.window_bytes} holds a plane")
                    helper.tuned_table = table
                    want = choose_plan(geom, gpu=helper.gpu_name, window_bytes=helper.window_bytes, table=table)
                    gen = torch.Generator(device=self.device).manual_seed(77 + self.rank + mode)
                    x = torch.randn(shape, generator=gen, device=self.device, dtype=torch.bfloat16)
                    with envs.override(**AUTO), torch.no_grad():
                        y = a2a(helper, x, mode)
                    wrong = _wrong(y, nccl_route(x, mode, self.sp.device_group))
                    error = ""
                    try:
                        self.assert_plan(helper.history[-1], want.plan, Phase.FORWARD_NO_GRAD)
                    except PlanMismatch as exc:
                        error = str(exc)
                    if want.plan is None and label != "original (36 CTAs, whole operand)":
                        error += f" the sweep candidate declined ({want.reason}): it tests nothing"
                    if wrong:
                        error += f" {wrong} wrong"
                    self.agree(f"{label} mode {mode}: {error}" if error else "")
                    ran.append((want.plan, geom))
                    del x, y
        finally:
            h.tuned_table = saved
            small_window_helper.tuned_table = saved
        chunked = [(p, g) for p, g in ran if p is not None and p.num_chunks(g) > 1]
        uneven = sum(len({(p1 - p0) * (r1 - r0) for p0, p1, r0, r1 in p.chunks(g)}) > 1 for p, g in chunked)
        return (f"{len(ran)} plans bit-exact and as planned ({len(chunked)} chunked, {uneven} with chunks of "
                f"different sizes), e.g. {ran[-1][0].describe(ran[-1][1])}")

    def epoch_check(self, h) -> str:
        """The real kernel with the epoch checker (the test library's, on the helper's communicator): uneven plans
        report 0 violations, and the pre-fix layout (the negative control) reports violations on real hardware."""
        from tests.kernel.native_testing import debug_execute

        transport = h.transport
        shape = (3, self.tokens(H3["32k"]) // self.p, self.h3_heads, 128)
        x = torch.randn(shape, dtype=torch.bfloat16, device=self.device)
        geom = Geometry.from_input(shape, 0, self.p, torch.bfloat16)
        ref = nccl_route(x, 0, self.sp.device_group)
        lines, error = [], ""
        for plan in (Plan(36, 2, geom.S, tuned=True), Plan(144, 1, even_rows(geom.S, geom.S // 3 + 1), tuned=True),
                     Plan(72, 2, geom.S // 2 + 7, tuned=True)):
            out, report = debug_execute(transport, x, geom, plan, moving=False)
            wrong = _wrong(out, ref)
            _, moving = debug_execute(transport, x, geom, plan, moving=True)
            # A violation is reported on the rank that saw it (often only the sender into the window
            # the bad layout overlaps): the pre-fix layout must be reported somewhere, summed over ranks.
            moving_total = torch.tensor([moving[0]], dtype=torch.int64)
            dist.all_reduce(moving_total, group=self.sp.cpu_group)
            lines.append(f"{plan.describe(geom)}: {report[0]} violations, {wrong} wrong; pre-fix layout "
                         f"{int(moving_total)} violations over the ranks")
            if report[0] or wrong:
                error += f" {plan}: {report[0]} violations, {wrong} wrong;"
            if not int(moving_total):
                error += f" {plan}: the pre-fix layout was NOT reported on any rank;"
        self.agree(error)
        return "; ".join(lines)

    # ------------------------------------------------------------------ the public op: uneven, attention, upstream

    @contextlib.contextmanager
    def public_op(self, helper, route: str, **settings: str):
        """The public op under ``route`` (agreed on every rank), with ``helper`` (if any) as its ``auto`` helper."""
        saved = helper.long_training if helper is not None else None
        if helper is not None:
            ulysses_a2a.install_default_helper(helper)
        try:
            with parallel_state.override_ulysses_settings(FASTVIDEO_ULYSSES_A2A=route, **settings):
                yield
        finally:
            if helper is not None:
                ulysses_a2a.install_default_helper(None)
                helper.long_training = saved

    @staticmethod
    def records_since(helper, calls_before: int) -> list:
        """The records of the calls ``helper`` saw since its call count was ``calls_before``."""
        calls = helper.stats()["calls"] - calls_before
        return list(helper.history)[-calls:] if calls else []

    def uneven_cases(self) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
        """Label -> (seq_splits, head_splits): Wan-like balanced tables, and skewed shares with rank 0's empty."""
        s = WAN_UNEVEN // self.scale
        s += s % self.p == 0  # a token count P does not divide
        return {f"{s} tokens balanced, 40 heads": (balanced_splits(s, self.p), balanced_splits(40, self.p)),
                f"{s} tokens skewed (rank 0 none), 41 heads": (skewed_splits(s, self.p, zero_rank=0),
                                                               balanced_splits(41, self.p))}

    def uneven_table(self, engine: str) -> tuple[TunedRow, ...]:
        """Tuned rows of one plan kind for the uneven cases' head counts (the fixture's row where it has one)."""
        rows = []
        for heads in (40, 41):
            row = lookup(self.fixture, self.gpu, Geometry(0, torch.bfloat16, 1, 1, heads, 128, self.p))
            if row is None or row.engine != ENGINE_SM:
                row = TunedRow(self.gpu, self.p, torch.bfloat16, heads, 128, ctas=144, planes_per_chunk=1,
                               source="gate fixture (not a measurement)")
            if engine == ENGINE_CE:
                row = replace(row, engine=ENGINE_CE, ctas=132, source="gate fixture (copy engine)")
            rows.append(row)
        return tuple(rows)

    def uneven_run(self, helper, seq, heads, mode: int, *, ref_heads=None):
        """One uneven call of the public op, forward and backward, fused on ``helper`` and on the ``off`` route
        (with ``ref_heads`` there if given): (the fused calls' records, wrong outputs, wrong gradients, geometry)."""
        bf16 = torch.bfloat16
        shape = (3, seq[self.rank], sum(heads), 128) if mode == 0 else (3, sum(seq), heads[self.rank], 128)
        dims = (2, 1) if mode == 0 else (1, 2)
        gen = torch.Generator(device=self.device).manual_seed(500 + 10 * self.rank + mode)
        x = torch.randn(shape, generator=gen, device=self.device, dtype=bf16)
        before = helper.stats()["calls"]
        with self.public_op(helper, "auto", FASTVIDEO_ULYSSES_A2A_LONG_TRAINING="chunked"):
            xg = x.clone().requires_grad_()
            y = sequence_model_parallel_all_to_all_4D(xg, *dims, seq_splits=seq, head_splits=heads)
            upstream = torch.randn(y.shape, generator=gen, device=self.device, dtype=bf16)
            (gx,) = torch.autograd.grad(y, xg, upstream)
        records = self.records_since(helper, before)
        with self.public_op(None, "off"):
            xr = x.clone().requires_grad_()
            yr = sequence_model_parallel_all_to_all_4D(xr, *dims, seq_splits=seq,
                                                       head_splits=heads if ref_heads is None else ref_heads)
            (gr,) = torch.autograd.grad(yr, xr, upstream if yr.shape == upstream.shape else torch.zeros_like(yr))
        self.sync()
        geom = Geometry.from_input(shape, mode, self.p, bf16, seq_splits=seq, head_splits=heads)
        return records, _wrong(y, yr), _wrong(gx, gr), geom

    def uneven_error(self, records, want: Plan | None, engine: str) -> str:
        """Why the records of one forward and its backward are not ``want`` of ``engine`` ("" when they are)."""
        if want is None or want.engine != engine:
            return f"the policy planned {want} from the {engine} rows: the check would test nothing"
        if len(records) != 2:
            return f"the helper saw {len(records)} calls, not 2: the public op did not take its route"
        try:
            self.assert_plan(records[0], want, Phase.FORWARD_GRAD)
            self.assert_plan(records[1], want, Phase.BACKWARD)
        except PlanMismatch as exc:
            return str(exc)
        return ""

    def uneven_plan(self, helper, geom, engine: str) -> Plan | None:
        return choose_plan(geom, gpu=helper.gpu_name, window_bytes=helper.window_bytes, grad=True,
                           long_training="chunked", table=self.uneven_table(engine)).plan

    def uneven_parity(self, helper, seq, heads, engine: str) -> str:
        """Uneven tables through the public op, both modes, forward and backward: bit-exact against the ``off``
        route, the fused plan of ``engine`` asserted on the forward and the backward."""
        saved, lines = helper.tuned_table, []
        try:
            helper.tuned_table = self.uneven_table(engine)
            for mode in (0, 1):
                records, wrong, wrong_g, geom = self.uneven_run(helper, seq, heads, mode)
                want = self.uneven_plan(helper, geom, engine)
                error = self.uneven_error(records, want, engine)
                if wrong or wrong_g:
                    error += f" {wrong} wrong forward / {wrong_g} wrong gradient elements vs the off route"
                self.agree(f"mode {mode}: {error}" if error else "")
                lines.append(f"mode {mode}: {want.describe(geom)}")
        finally:
            helper.tuned_table = saved
        return f"seq {seq}, heads {heads}: " + "; ".join(lines) + "; 0 wrong"

    def negative_control_uneven(self) -> str:
        """A copy-engine uneven run checked against the SM kind's plan, and against a reference whose head table
        is reversed: both must fail."""
        seq, heads = list(self.uneven_cases().values())[1]
        helper = self.helper(table=self.uneven_table(ENGINE_CE))
        try:
            records, wrong, _, geom = self.uneven_run(helper, seq, heads, 0, ref_heads=heads[::-1])
            plan_error = self.uneven_error(records, self.uneven_plan(helper, geom, ENGINE_SM), ENGINE_SM)
        finally:
            helper.destroy()
        total = torch.tensor([wrong], dtype=torch.int64)
        dist.all_reduce(total, group=self.sp.cpu_group)
        error = "" if "ran fused" in plan_error else f"the SM plan passed on a fused run: {plan_error}"
        if not int(total):
            error += " the reference with the head table reversed matched"
        self.agree(error)
        return (f"plan assertion failed as it must ({plan_error}); {int(total)} wrong elements over the ranks "
                f"against the head table {heads[::-1]}")

    def attention_sizes(self) -> tuple[int, int, int, int]:
        """(tokens, text tokens, heads, head dim) of the attention check, tokens and text scaled in a dry run."""
        s = max(3 * self.p + 1, ATTENTION["tokens"] // self.scale)
        s += s % self.p == 0
        return s, max(2, ATTENTION["text"] // self.scale), ATTENTION["heads"], ATTENTION["dim"]

    def attention_run(self, helper, route: str) -> tuple[dict[str, float], list[str], float, tuple[int, ...]]:
        """DistributedAttention (replicated text tokens, rotary, skewed seq_splits, heads P does not divide) forward
        and backward under ``route``, against the single-device reference each rank computes from the same seeded
        global tensors: (relative errors, routes of the helper's calls, the error of this rank's output read at
        the balanced shards' rows, seq_splits)."""
        from fastvideo.attention.dense import attention
        from fastvideo.attention.layer import DistributedAttention
        from fastvideo.attention.rotary import apply_rotary

        seq, text, heads, dim = self.attention_sizes()
        splits = skewed_splits(seq, self.p, zero_rank=1 if self.p > 2 else None)
        gen = torch.Generator(device=self.device).manual_seed(9000 + seq)

        def rand(*shape):
            return torch.randn(*shape, generator=gen, device=self.device, dtype=torch.float32)

        t = {n: rand(1, seq, heads, dim) for n in ("q", "k", "v", "g")}
        t.update({n: rand(1, text, heads, dim) for n in ("rq", "rk", "rv", "rg")})
        angles = torch.rand(seq, dim // 2, generator=gen, device=self.device) * 6.0
        cos, sin = angles.cos(), angles.sin()
        leaves = {n: t[n].clone().requires_grad_() for n in ("q", "k", "v", "rq", "rk", "rv")}
        q, k = (apply_rotary(leaves[n], cos, sin, is_neox_style=False) for n in ("q", "k"))
        out = attention(*(torch.cat([a, leaves[r]], dim=1) for a, r in ((q, "rq"), (k, "rk"), (leaves["v"], "rv"))))
        ((out[:, :seq] * t["g"]).sum() + (out[:, seq:] * t["rg"]).sum()).backward()
        ref = {"out": out[:, :seq].detach(), "replicated out": out[:, seq:].detach(),
               **{f"d{n}": leaf.grad for n, leaf in leaves.items()}}
        del out, q, k, leaves
        start = sum(splits[:self.rank])
        mine = slice(start, start + splits[self.rank])
        local = {n: t[n][:, mine].clone().requires_grad_() for n in ("q", "k", "v")}
        rep = {n: t[n].clone().requires_grad_() for n in ("rq", "rk", "rv")}
        layer = DistributedAttention(heads, dim, prefix="gate.attn")
        before = helper.stats()["calls"]
        with self.public_op(helper, route):
            out, rep_out = layer(local["q"], local["k"], local["v"], replicated_q=rep["rq"], replicated_k=rep["rk"],
                                 replicated_v=rep["rv"], freqs_cis=(cos, sin), seq_splits=splits)
            ((out * t["g"][:, mine]).sum() + (rep_out * t["rg"]).sum() / self.p).backward()
        routes = [r.route for r in self.records_since(helper, before)]
        errs = {"out": _rel_err(out.detach(), ref["out"][:, mine]),
                "replicated out": _rel_err(rep_out.detach(), ref["replicated out"])}
        for n in ("q", "k", "v"):
            errs[f"d{n}"] = _rel_err(local[n].grad, ref[f"d{n}"][:, mine])
        for n in ("rq", "rk", "rv"):  # each rank's gradient covers its own heads
            total = rep[n].grad.clone()
            dist.all_reduce(total, group=self.sp.device_group)
            errs[f"d{n} (sum over ranks)"] = _rel_err(total, ref[f"d{n}"])
        even = sum(balanced_splits(seq, self.p)[:self.rank])
        rows = min(splits[self.rank], seq - even)
        shifted = 0.0
        if rows > 0 and even != start:
            shifted = _rel_err(out.detach()[:, :rows], ref["out"][:, even:even + rows])
        return errs, routes, shifted, splits

    def attention_tolerance(self) -> float:
        return 1e-4 if self.cuda else 1e-5  # fp32; on the GPU SDPA's kernels differ in accumulation order

    def attention_check(self, helper) -> str:
        """DistributedAttention on the fused route against its single-device reference, forward and backward."""
        errs, routes, _, splits = self.attention_run(helper, "auto")
        tol = self.attention_tolerance()
        bad = {n: e for n, e in errs.items() if not e <= tol}
        error = f"errors over {tol}: {bad}" if bad else ""
        if routes != ["fused"] * 4:
            error += f" routes {routes}: not the 4 all-to-alls (qkv, out, and their backwards) fused"
        self.agree(error)
        seq, text, heads, dim = self.attention_sizes()
        return (f"{seq} tokens {splits} + {text} text, {heads} heads, D={dim}, fp32: largest relative error "
                f"{max(errs.values()):.1e} (tolerance {tol}); 4 all-to-alls fused")

    def negative_control_attention(self) -> str:
        """The attention check's assertions must fail: its route on the ``off`` route, its rows at the balanced
        shards' offsets."""
        helper = self.helper()
        try:
            errs, routes, shifted, _ = self.attention_run(helper, "off")
        finally:
            helper.destroy()
        worst = torch.tensor([shifted], dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=self.sp.cpu_group)
        tol = self.attention_tolerance()
        error = "" if routes != ["fused"] * 4 else "the route assertion passed on the off route"
        if not float(worst) > tol:
            error += f" the output read at the balanced shards' rows matched ({float(worst):.1e})"
        if max(errs.values()) > tol:
            error += f" the off route itself missed the reference: {errs}"
        self.agree(error)
        return (f"off: routes {routes} fail the fused-route assertion; rows at the balanced offsets: relative "
                f"error {float(worst):.1e} > {tol}")

    def upstream_call(self, helper, got, x: torch.Tensor, dims: tuple[int, int]) -> tuple[torch.Tensor, Plan | None]:
        """One upstream-style call: ``try_all_to_all_4D``, the NCCL route where it returns None; bit-exact against
        ``DeviceCommunicatorBase.all_to_all_4D``, its plan asserted, agreed."""
        comm = self.sp.device_communicator
        mode = 0 if dims == (2, 1) else 1
        before = helper.stats()["calls"]
        with torch.no_grad():
            y = got.try_all_to_all_4D(x, *dims)
            ref = DeviceCommunicatorBase.all_to_all_4D(comm, x, *dims)
        records = self.records_since(helper, before)
        geom = Geometry.from_input(x.shape, mode, self.p, x.dtype)
        want = choose_plan(geom, gpu=helper.gpu_name, window_bytes=helper.window_bytes, table=helper.tuned_table).plan
        error = "" if len(records) == 1 else f"the helper saw {len(records)} calls, not 1"
        try:
            if records:
                self.assert_plan(records[-1], want, Phase.FORWARD_NO_GRAD)
        except PlanMismatch as exc:
            error += str(exc)
        if (y is None) != (want is None):
            error += f" try_all_to_all_4D returned {'None' if y is None else 'an output'} for plan {want}"
        wrong = _wrong(y, ref) if y is not None else 0
        if wrong:
            error += f" {wrong} wrong"
        self.agree(f"{tuple(x.shape)} {x.dtype} {dims}: {error}" if error else "")
        return (ref if y is None else y), want

    def upstream_worker(self, helper) -> str:
        """Upstream FastVideo's parity worker: the helper from ``device_communicator.ulysses_a2a``; its
        ``try_all_to_all_4D`` against ``DeviceCommunicatorBase.all_to_all_4D`` (the NCCL route) for every dtype
        in both directions (and the round trip), then operands growing past the window and back; plans asserted."""
        heads, d, w = self.h3_heads, 128, helper.window_bytes
        calls = fused = chunked = declined = 0
        with self.public_op(helper, "auto"):
            got = self.sp.device_communicator.ulysses_a2a
            self.agree("" if getattr(got, "helper", got) is helper else f"device_communicator.ulysses_a2a is {got!r}")
            for i, dtype in enumerate((torch.bfloat16, torch.float16, torch.float32)):
                row = heads * d * dtype.itemsize
                fit, big = max(1, w // (2 * 3 * row)), 2 * w // row + 1  # half the window; a plane over twice it
                gen = torch.Generator(device=self.device).manual_seed(700 + 10 * self.rank + i)
                x = torch.randn((3, fit, heads, d), generator=gen, device=self.device, dtype=dtype)
                y, want_y = self.upstream_call(helper, got, x, (2, 1))
                back, want_back = self.upstream_call(helper, got, y.contiguous(), (1, 2))
                error = "" if _wrong(back, x) == 0 else f"{dtype}: the round trip changed the input"
                if want_y is None or want_back is None:
                    error += f" {dtype}: an operand of half the window was not planned fused: it tests nothing"
                self.agree(error)
                for s in (fit, big, fit):
                    x = torch.randn((3, s, heads, d), generator=gen, device=self.device, dtype=dtype)
                    _, want = self.upstream_call(helper, got, x, (2, 1))
                    geom = Geometry.from_input(x.shape, 0, self.p, dtype)
                    calls, fused = calls + 1, fused + (want is not None)
                    chunked += want is not None and geom.plane_bytes > w
                    declined += want is None and geom.plane_bytes > w
                    self.agree(f"{dtype}: a fitting operand was not planned fused" if s == fit and want is None else "")
        if not chunked or not declined:
            raise AssertionError(f"growth: {chunked} chunked and {declined} declined calls over the window: the "
                                 "operands did not grow past it on both the tuned and the untuned rows")
        return (f"bf16/fp16/fp32 both directions and the round trip bit-exact; growth past the window "
                f"{w} B: {fused} of {calls} calls fused ({chunked} chunked), {declined} declined (window)")

    def negative_control_upstream(self, helper) -> str:
        """The upstream worker's assertions must fail: ``ulysses_a2a`` on the ``off`` route, and a reference
        computed from an input with one element changed on one rank."""
        with self.public_op(helper, "off"):
            off = self.sp.device_communicator.ulysses_a2a
        x = torch.randn((3, 4, self.h3_heads, 128), device=self.device, dtype=torch.bfloat16)
        bad = x.clone()
        if self.rank == self.p - 1:
            bad.view(-1)[0] += 1
        with self.public_op(helper, "auto"), torch.no_grad():
            y = self.sp.device_communicator.ulysses_a2a.try_all_to_all_4D(x, 2, 1)
            ref = DeviceCommunicatorBase.all_to_all_4D(self.sp.device_communicator, bad, 2, 1)
        total = torch.tensor([_wrong(y, ref) if y is not None else 0], dtype=torch.int64)
        dist.all_reduce(total, group=self.sp.cpu_group)
        error = "" if getattr(off, "helper", off) is not helper else "ulysses_a2a was the helper on the off route"
        if y is None or not int(total):
            error += f" the changed reference matched (output {'None' if y is None else 'fused'})"
        self.agree(error)
        return f"off: ulysses_a2a is {off!r}; changed reference: {int(total)} wrong elements over the ranks"

    def run(self) -> int:
        tokens = {"32k": H3["32k"]} if self.quick else H3
        h3 = f"H={self.h3_heads}" + (" (56 padded)" if self.h3_heads != 56 else "")
        wan = f"H={self.wan_heads}" + (" (40 padded)" if self.wan_heads != 40 else "")
        h = self.helper()
        try:
            for label, s_global in tokens.items():
                for b, pack in ((3, "QKV"), (4, "QKVG")):
                    for grad in (False, True):
                        name = f"parity {label} {pack} {h3} {'train' if grad else 'infer'}"
                        self.check(name, lambda b=b, s=s_global, g=grad: self.parity(
                            h, b, s, self.h3_heads, grad=g, long_training="auto"))
                self.check(f"long-training chunked {label} QKV {h3}", lambda s=s_global: self.parity(
                    h, 3, s, self.h3_heads, grad=True, long_training="chunked"))
            for grad in (False, True):
                self.check(f"parity wan720p {wan} {'train' if grad else 'infer'}", lambda g=grad: self.parity(
                    h, 1, WAN720P, self.wan_heads, grad=g, long_training="auto"))
            ce_table, saved = self.copy_engine_table(), h.tuned_table
            try:
                h.tuned_table = ce_table
                for label, s_global in tokens.items():
                    for grad in (False, True):
                        self.check(f"parity copy engine {label} QKV {h3} {'train' if grad else 'infer'}",
                                   lambda s=s_global, g=grad: self.parity(h, 3, s, self.h3_heads, grad=g,
                                                                          long_training="chunked"))
                self.check(f"parity copy engine wan720p {wan} train", lambda: self.parity(
                    h, 1, WAN720P, self.wan_heads, grad=True, long_training="chunked"))
            finally:
                h.tuned_table = saved
            self.check("output ownership", lambda: self.ownership(h))
            self.check("recovery after capability disagreement", lambda: self.recovery(h))
            small = self.helper(window_bytes=self.small_window())
            try:
                for label in tokens:
                    self.check(f"plan sweep {label} QKV {h3}", lambda s=H3[label]: self.sweep(h, small, 3, s))
            finally:
                small.destroy()
            for engine, kind in ((ENGINE_SM, "SM kind"), (ENGINE_CE, "copy-engine kind")):
                for label, (seq, heads) in self.uneven_cases().items():
                    self.check(f"uneven parity {label}, {kind}, train", lambda q=seq, hd=heads, e=engine:
                               self.uneven_parity(h, q, hd, e))
            self.check("DistributedAttention vs its single-device reference, fused",
                       lambda: self.attention_check(h))
            if self.epoch:
                self.check("epoch checker on the real kernel (and the pre-fix layout flagged)",
                           lambda: self.epoch_check(h))
        finally:
            h.destroy()
        upstream = self.helper(window_bytes=self.window_bytes // 8)
        try:
            self.check("upstream parity worker (device_communicator.ulysses_a2a)",
                       lambda: self.upstream_worker(upstream))
            self.check("negative control: upstream worker off route and changed reference must fail",
                       lambda: self.negative_control_upstream(upstream))
        finally:
            upstream.destroy()
        self.check("stress", lambda: self.stress(20 if self.quick else 100))
        self.check("negative control: tuning disabled must fail the plan assertions", self.negative_control)
        self.check("negative control: uneven parity against the other plan kind and a reversed head table must fail",
                   self.negative_control_uneven)
        self.check("negative control: DistributedAttention off route and balanced offsets must fail",
                   self.negative_control_attention)
        failed = [r for r in self.results if not r["ok"]]
        if self.rank == 0:
            print(f"{len(self.results) - len(failed)} passed, {len(failed)} failed", flush=True)
        return 1 if failed else 0

    def negative_control(self) -> str:
        """Tuning disabled in the helper while the expectation assumes it: the plan assertion must fail."""
        untuned = self.helper(table=())
        try:
            self.parity(untuned, 3, H3["32k"], self.h3_heads, grad=False, long_training="auto",
                        expect_table=self.fixture)
        except PlanMismatch as exc:
            return f"plan assertion failed as it must: {exc}"
        finally:
            untuned.destroy()
        raise AssertionError("the plan assertions passed with tuning disabled: they cannot tell plans apart")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="32k only and a 20-round stress")
    parser.add_argument("--json", type=pathlib.Path, help="write the results here (rank 0)")
    parser.add_argument("--epoch-check", action="store_true",
                        help="also run uneven plans through the epoch-checked launch (native only, on the test "
                             "library: FASTVIDEO_KERNEL_LIBRARY=.../libfastvideo_ulysses_a2a_testing.so; needs the "
                             "window headroom)")
    parser.add_argument("--cpu-dry-run", action="store_true",
                        help="test the gate logic over gloo, CPU transport, 1/512 scale (not a gate result)")
    parser.add_argument("--inject-wrong-round", type=int, default=-1, help=argparse.SUPPRESS)  # fail-fast test
    args = parser.parse_args()
    if args.cpu_dry_run:
        from fastvideo.distributed.ulysses import policy

        policy.LONG_TRAINING_PLANE_BYTES //= DRY_RUN_SCALE  # scaled with the sequences and the window
    if not init_check_group("check_ulysses_h3_native", args.cpu_dry_run):
        return 2
    parallel_state.initialize_sequence_parallel(dist.get_world_size())
    if args.epoch_check and args.cpu_dry_run:
        parser.error("--epoch-check runs the native kernel; it cannot be combined with --cpu-dry-run")
    gate = Gate(args.quick, dry_run=args.cpu_dry_run, epoch=args.epoch_check,
                inject_wrong_round=args.inject_wrong_round)
    if gate.rank == 0:
        header = {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": _commit(),
            "gpu": torch.cuda.get_device_name() if gate.cuda else "none (CPU dry run)",
            "sp": gate.p,
            "torch": torch.__version__,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if gate.cuda else None,
            "library": _library() if gate.cuda else "none: CPU transport (GlooPlanTransport)",
            "argv": sys.argv,
        }
        if args.cpu_dry_run:
            header["note"] = (f"DRY RUN: gloo + CPU transport, sizes / {DRY_RUN_SCALE}; tests the gate's logic, "
                              "not the kernel; never a gate result")
        print(json.dumps(header, indent=1), flush=True)
    try:
        rc = gate.run()
    finally:
        parallel_state.destroy_sequence_parallel()
    if gate.rank == 0 and args.json:
        args.json.write_text(json.dumps({"header": header, "results": gate.results}, indent=1))
    dist.destroy_process_group()
    return rc


if __name__ == "__main__":
    sys.exit(main())
