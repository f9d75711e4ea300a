"""The DiT step benchmark's procedure, timed on the harness (``benchmarks.harness.timing``).

Variants: the NCCL route (``off``) and, for every ``--long-training`` value, the ``auto`` route with
``FASTVIDEO_ULYSSES_A2A_LONG_TRAINING`` set to it; ``local`` (the op replaced by a communication-free stand-in of
the same shape) measures the all-to-all's share. Inference (no-grad) operands ignore LONG_TRAINING, so only the
first value gets inference rows. Per token count (``Bench.run_tokens``):

1. Warm-up: one inference forward and one training step on the NCCL route and the first auto variant.
2. ``--repeat`` (>= 3) rotated trials: trial t runs [off, local, auto[lt]...] rotated by t, each a no-grad
   inference forward and a full training step (forward, backward, clip_grad_norm_, optimizer step), each timed
   host-to-completion from a line-up, rank-max (``timing.host_latencies``). share = 1 - t_local / t_nccl.
   Allocator retries and peak memory per trial, rank-max.
3. Check pass (untimed), per variant one inference forward and one training step with the probe on: CUDA events
   around every all-to-all call inside the model (forward, recompute, backward) give the in-step op time. Its
   outputs and gradients are compared with the NCCL route's: ``wrong`` counts inference elements whose bits
   differ, and gradient elements whose difference exceeds the calibrated threshold (``--grad-factor`` x the max
   abs diff of two NCCL-route steps).
4. Op level: the step's own all-to-all calls in isolation, every variant side by side (rotated rounds of
   ``--iters`` calls after ``--warmup``), weighted by the calls the probe counted: op seconds per step.

Per auto row the measured quantities the targets are judged on (``benchmarks/check_results.py``): ideal gain =
share x (1 - op_fused / op_nccl), measured gain = 1 - t_fused / t_nccl, the memory against the NCCL row's
plus the window, and the candidates that explain a gap between the two gains.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import Counter
from collections.abc import Callable, Sequence

import torch

from benchmarks.harness import oracle, process, stats, timing
from benchmarks.harness.cli import DTYPES
from benchmarks.harness.timing import rotated

LONG_VAR = "FASTVIDEO_ULYSSES_A2A_LONG_TRAINING"
OPS = ("qkv", "out")  # the step's two all-to-alls: packed QKV (mode 0) and the attention output (mode 1)


# ---------------------------------------------------------------------------------------------- the all-to-all


class Landed:
    """A stand-in's ``async_op`` handle: the output is already there."""

    def __init__(self, out: torch.Tensor) -> None:
        self.out = out

    def wait(self) -> torch.Tensor:
        return self.out


def local_a2a(x: torch.Tensor, scatter_dim: int = 2, gather_dim: int = 1, *, tag: str | None = None,
              async_op: bool = False, **splits) -> torch.Tensor | Landed:
    """Communication-free stand-in with the op's output shape and about its memory traffic (even calls only; the
    call tag has nothing to check without a vote). ``async_op``: the output in a handle (the pipelined layer)."""
    if async_op:
        return Landed(local_a2a(x, scatter_dim, gather_dim, **splits))
    from fastvideo.distributed.parallel_state import get_sp_group

    if any(v is not None for v in splits.values()):
        raise NotImplementedError(f"the local all-to-all stand-in serves even calls only, got {splits}; use a "
                                  "geometry whose sequence and heads the SP size divides.")
    p = get_sp_group().world_size
    if p == 1:
        return x
    if (scatter_dim, gather_dim) == (2, 1):
        return x[:, :, : x.shape[2] // p].repeat(1, p, 1, 1)
    return x[:, : x.shape[1] // p].repeat(1, 1, p, 1)


class Probe:
    """Times every all-to-all call the model makes while ``active`` (the check pass only).

    Device time: CUDA events recorded on the current stream just before and just after the call. They
    bracket everything the stream did for the call, including time it sat idle while the host was busy
    in the call (the vote): that is what the call cost the step, and what tells lost overlap or an extra
    sync apart from the op's own speed when compared with the isolated op time. Backward calls run
    inside autograd: a pre-hook and a post-hook on the op's own autograd node bracket exactly its
    backward. Forward calls made while ``in_backward`` are checkpoint recomputes. On CPU, perf_counter
    stands in for the events (smoke only). Host time: perf_counter around each call (the vote, the plan,
    the launches).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.active = False
        self.in_backward = False  # Runner.train sets it around backward()
        self.records: list[tuple[str, object, object, float]] = []
        self.dispatch: Dispatch | None = None  # set by the Dispatch it belongs to

    def _mark(self) -> object:
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _elapsed(self, start: object, end: object) -> float:
        if self.device.type == "cuda":
            return start.elapsed_time(end) / 1e3  # type: ignore[attr-defined]
        return float(end) - float(start)  # type: ignore[arg-type]

    def timed_all_to_all(self, x: torch.Tensor, scatter_dim: int, gather_dim: int, name: str, **kwargs) -> torch.Tensor:
        if kwargs.get("async_op"):  # in flight (the pipelined layer): a start's time is not the exchange's; untimed
            return self.dispatch.fn(x, scatter_dim, gather_dim, **kwargs)
        grad = torch.is_grad_enabled() and x.requires_grad
        phase = "recompute" if self.in_backward else ("fwd_grad" if grad else "fwd")
        h0 = time.perf_counter()
        m0 = self._mark()
        y = self.dispatch.fn(x, scatter_dim, gather_dim, **kwargs)
        m1 = self._mark()
        self.records.append((f"{name}/{phase}", m0, m1, time.perf_counter() - h0))
        node = y.grad_fn
        # At SP1 the op returns its input: its grad_fn is another op's node, which must not be timed.
        if grad and not self.in_backward and node is not None and y is not x:
            box: dict[str, object] = {}

            def started(grad_outputs):
                box["h"], box["m"] = time.perf_counter(), self._mark()

            def done(grad_inputs, grad_outputs):
                self.records.append((f"{name}/bwd", box["m"], self._mark(), time.perf_counter() - box["h"]))

            node.register_prehook(started)
            node.register_hook(done)
        return y

    def collect(self) -> dict[str, dict]:
        """Per label (``op/phase``): calls, device seconds, host seconds; clears the records. After a sync."""
        out: dict[str, dict] = {}
        for label, m0, m1, host_s in self.records:
            entry = out.setdefault(label, {"calls": 0, "device_s": 0.0, "host_s": 0.0})
            entry["calls"] += 1
            entry["device_s"] += self._elapsed(m0, m1)
            entry["host_s"] += host_s
        self.records.clear()
        return out


class Dispatch:
    """The all-to-all the model calls (``model.build_model``'s ``all_to_all``): the public op, or the ``local``
    stand-in, through the probe while it is active."""

    def __init__(self, probe: Probe) -> None:
        from fastvideo.distributed.communication_op import sequence_model_parallel_all_to_all_4D

        self.public_op = sequence_model_parallel_all_to_all_4D
        self.fn: Callable[..., torch.Tensor] = self.public_op
        self.probe = probe
        probe.dispatch = self

    def __call__(self, x: torch.Tensor, scatter_dim: int, gather_dim: int, name: str, **kwargs) -> torch.Tensor:
        """``kwargs``: the public op's keywords (``seq_splits``, ``head_splits`` where the model's call is uneven,
        ``tag``: the layer's call tag)."""
        if self.probe.active:
            return self.probe.timed_all_to_all(x, scatter_dim, gather_dim, name, **kwargs)
        return self.fn(x, scatter_dim, gather_dim, **kwargs)


# ---------------------------------------------------------------------------------------------- steps


class Runner:
    def __init__(self, args, model: torch.nn.Module, device: torch.device, probe: Probe) -> None:
        self.args, self.model, self.device, self.probe = args, model, device, probe
        # LR and weight decay 0: the step runs in full, and the weights stay bit-identical.
        self.opt = torch.optim.AdamW(model.parameters(), lr=0.0, weight_decay=0.0)
        self.params = [(n, p) for n, p in model.named_parameters()]
        self.offload_now = False  # set per token count (--offload-activations, --offload-above)
        self.steps: Counter[str] = Counter()  # steps run, per kind (checks the estimate's step count)

    def offload(self):
        if self.offload_now:
            return torch.autograd.graph.save_on_cpu(pin_memory=self.device.type == "cuda")
        return contextlib.nullcontext()

    def infer(self, x: torch.Tensor) -> torch.Tensor:
        self.steps["infer"] += 1
        with torch.no_grad():
            return self.model(x)

    def train(self, x: torch.Tensor, capture: bool = False) -> list[torch.Tensor] | None:
        self.steps["train"] += 1
        self.opt.zero_grad(set_to_none=True)
        with self.offload():
            out = self.model(x)
        self.probe.in_backward = True  # forward calls from here on are checkpoint recomputes
        try:
            out.float().pow(2).mean().backward()
        finally:
            self.probe.in_backward = False
        grads = None
        if capture:
            grads = [p.grad.to_local().detach().float().cpu() for _, p in self.params]
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.args.clip)
        self.opt.step()
        return grads


def alloc_retries(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))


def max_abs_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """Max absolute difference over the paired tensors, rank-max. Collective."""
    local = max((float((x - y).abs().max()) if x.numel() else 0.0 for x, y in zip(a, b)), default=0.0)
    return timing.rank_max([local])[0]


def beyond(a: list[torch.Tensor], b: list[torch.Tensor], threshold: float) -> int:
    """Elements of the paired tensors that differ by more than ``threshold``, summed over ranks. Collective."""
    return timing.rank_sum(sum(oracle.count_beyond(x, y, threshold) for x, y in zip(a, b, strict=True)))


def add_calls(ran: dict, key: tuple, before: dict, after: dict) -> None:
    """Accumulate the helper's fused/total calls and declines between two ``stats()`` snapshots."""
    prev = ran.setdefault(key, {"fused": 0, "calls": 0, "declines": {}})
    prev["fused"] += after["fused"] - before["fused"]
    prev["calls"] += after["calls"] - before["calls"]
    for reason, n in after["declines"].items():
        delta = n - before["declines"].get(reason, 0)
        if delta:
            prev["declines"][reason] = prev["declines"].get(reason, 0) + delta


def history_mark(helper) -> int:
    """The last sequence number in the helper's history (records after it are the next calls')."""
    history = getattr(helper, "history", None)
    return history[-1].seq if history else -1


def records_since(helper, mark: int) -> list:
    """History records after ``mark`` (none without a history: rows then show no plans, and the CPU
    test, which checks plans against call counts, fails loudly)."""
    return [r for r in getattr(helper, "history", ()) if r.seq > mark]


def describe_calls(records: Sequence, geoms: dict[str, object]) -> dict[str, int]:
    """``'op phase: route, plan or decline reason' -> calls`` for helper history records of the step.

    The step's calls are known: forward mode 0 and backward mode 1 move the packed QKV (``qkv``),
    forward mode 1 and backward mode 0 the attention output (``out``); ``geoms`` has their geometries.
    """
    out: Counter[str] = Counter()
    for r in records:
        phase = getattr(getattr(r, "phase", None), "name", str(getattr(r, "phase", "?"))).lower()
        backward = phase == "backward"
        op = "qkv" if (r.mode == 0) != backward else "out"
        if r.route == "fused" and r.plan is not None:
            geom = geoms.get(op)
            what = f"fused, {r.plan.describe(geom) if geom is not None else hex(r.plan.word)}"
        else:
            reason = getattr(r.reason, "label", r.reason)
            what = f"nccl ({reason})"
        out[f"{op} {phase}: {what}"] += 1
    return dict(sorted(out.items()))


# ---------------------------------------------------------------------------------------------- gains (pure)


def step_op_seconds(counts: dict[str, int], units: dict[str, dict[str, float | None]]) -> float | None:
    """Op seconds one step spends in the all-to-all, from isolated per-call times and the step's calls.

    ``counts``: ``op/phase`` -> calls in one step, as the probe counted them (phases ``fwd`` no-grad,
    ``fwd_grad``, ``recompute``, ``bwd``). ``units``: op -> ``{"nograd", "grad", "fwdbwd"}`` seconds per
    call. A backward is only measured together with its forward (``fwdbwd``: the forward saves the plan
    the backward runs), so each ``fwd_grad``/``bwd`` pair is charged ``fwdbwd``, every other grad-tracked
    forward (the checkpoint recompute) ``grad``, and a no-grad call ``nograd``. None when a needed time
    is missing or a backward has no forward.
    """
    total = 0.0
    for op in sorted({label.split("/")[0] for label in counts}):
        n = {ph: counts.get(f"{op}/{ph}", 0) for ph in ("fwd", "fwd_grad", "recompute", "bwd")}
        if n["bwd"] > n["fwd_grad"]:
            return None
        need = {"nograd": n["fwd"], "grad": n["recompute"] + n["fwd_grad"] - n["bwd"], "fwdbwd": n["bwd"]}
        for kind, calls in need.items():
            if calls:
                seconds = units.get(op, {}).get(kind)
                if seconds is None:
                    return None
                total += calls * seconds
    return total


def ideal_gain(share: float | None, op_fused_s: float | None, op_nccl_s: float | None) -> float | None:
    """share x (1 - fused op time / NCCL op time): the step gain if only the op's own time changed.

    None without a share, or with a negative one (the step without the op measured slower than with
    it: noise, and its product with a slower fused op would read as a positive ideal gain)."""
    if share is None or share < 0 or op_fused_s is None or not op_nccl_s or op_nccl_s <= 0:
        return None
    return share * (1.0 - op_fused_s / op_nccl_s)


def measured_gain(t_fused_s: float | None, t_nccl_s: float | None) -> float | None:
    """1 - t_fused / t_nccl of the step medians (positive: the fused route's step is faster)."""
    if t_fused_s is None or not t_nccl_s or t_nccl_s <= 0:
        return None
    return 1.0 - t_fused_s / t_nccl_s


def memory_use(peak_fused_gib: float | None, peak_nccl_gib: float | None, window_bytes: int,
                 window_in_peak: bool) -> dict | None:
    """The fused row's memory footprint and the NCCL row's plus the window (the target compares the two:
    ``check_results.py``).

    ``max_memory_allocated`` only sees torch's caching allocator. The native transport's window comes
    from ``ncclMemAlloc``, outside it: then the fused route's footprint is its peak plus the window, and
    ``fused peak + window <= NCCL peak + window`` leaves no extra room for torch allocations.
    """
    if peak_fused_gib is None or peak_nccl_gib is None:
        return None
    window_gib = window_bytes / 2**30
    fused_total = peak_fused_gib + (0.0 if window_in_peak else window_gib)
    limit = peak_nccl_gib + window_gib
    return {"fused_peak_gib": peak_fused_gib, "nccl_peak_gib": peak_nccl_gib, "window_bytes": window_bytes,
            "window_in_peak": window_in_peak, "fused_total_gib": fused_total, "limit_gib": limit}


def spread(times: Sequence[float]) -> float | None:
    """(max - min) / median of a row's trials."""
    med = stats.median(times)
    return (max(times) - min(times)) / med if times and med else None


def reason_candidates(row: dict, nccl: dict) -> list[str]:
    """What the run measured that can explain a measured gain below the ideal, with the numbers.

    Step time = op time in the step + the rest. So the step's saving (t_nccl - t_fused) is the op's
    in-step saving minus how much the rest of the step grew on the fused route. The ideal assumes the op
    saves in the step what it saves in isolation and that the share is the op's whole in-step time.
    """
    out: list[str] = []
    ms = 1e3
    t_f, t_n = row.get("median_s"), nccl.get("median_s")
    in_f = (row.get("in_step") or {}).get("op_device_s")
    in_n = (nccl.get("in_step") or {}).get("op_device_s")
    iso_f, iso_n = row.get("op_step_s"), nccl.get("op_step_s")
    share = row.get("share")
    if row.get("route_ran") != "fused":
        calls = row.get("helper_calls") or {}
        out.append(f"not every call ran fused ({row.get('route_ran')}): declines {calls.get('declines')}; "
                   f"plans {row.get('plans')}")
    if None not in (in_f, iso_f, in_n, iso_n):
        smaller = (in_n - in_f) < (iso_n - iso_f)
        out.append(f"op inside the step vs isolated: fused {in_f * ms:.2f} vs {iso_f * ms:.2f} ms "
                   f"({(in_f - iso_f) * ms:+.2f}), NCCL {in_n * ms:.2f} vs {iso_n * ms:.2f} ms "
                   f"({(in_n - iso_n) * ms:+.2f}); in-step op saving {(in_n - in_f) * ms:.2f} ms vs isolated "
                   f"{(iso_n - iso_f) * ms:.2f} ms"
                   + (" (smaller in the step: the fused op runs slower beside the step's other work, or waits"
                      " there)" if smaller else ""))
    if None not in (t_f, t_n, in_f, in_n):
        rest = (t_f - in_f) - (t_n - in_n)
        out.append(f"rest of the step (step - op in step): {rest * ms:+.2f} ms on the fused route"
                   + (" (extra sync, lost overlap or allocator work outside the op calls)" if rest > 0 else ""))
    if None not in (share, t_n, in_n):
        implied = share * t_n
        out.append(f"share-implied NCCL op time {implied * ms:.2f} ms vs its in-step time {in_n * ms:.2f} ms"
                   + (" (lower: part of the NCCL op already overlaps other work, so the ideal overstates the"
                      " gain)" if implied < in_n else ""))
    h_f = (row.get("in_step") or {}).get("op_host_s")
    h_n = (nccl.get("in_step") or {}).get("op_host_s")
    if h_f is not None and h_n is not None:
        out.append(f"host time inside the op calls (vote, plan, launches): fused {h_f * ms:.2f} ms vs NCCL "
                   f"{h_n * ms:.2f} ms per step")
    if row.get("alloc_retries_total"):
        out.append(f"allocator retries on the fused route: {row['alloc_retries_total']}")
    s_f, s_n, gain = spread(row.get("trial_s") or []), spread(nccl.get("trial_s") or []), row.get("measured_gain")
    if s_f is not None and s_n is not None and gain is not None:
        noisy = max(s_f, s_n) >= abs(gain)
        out.append(f"trial spread (max-min)/median: fused {s_f * 100:.2f}%, NCCL {s_n * 100:.2f}% vs measured gain "
                   f"{gain * 100:.2f}%{' (noise as large as the gain: more trials needed)' if noisy else ''}")
    return out


# ---------------------------------------------------------------------------------------------- procedure


class Variant:
    """One timed configuration: the NCCL route, the local stand-in, or auto with one LONG_TRAINING value."""

    def __init__(self, route: str, long_training: str, infer: bool) -> None:
        self.route, self.long_training, self.infer = route, long_training, infer

    @property
    def key(self) -> str:
        return f"auto[{self.long_training}]" if self.route == "auto" else self.route

    @property
    def kinds(self) -> tuple[str, ...]:
        return ("infer", "train") if self.infer else ("train",)

    def apply(self, dispatch: Dispatch) -> None:
        """Select the route, LONG_TRAINING and the op. Every rank does the same at the same point, so the
        op's settings re-agreement (a changed agreed variable) is collective as it must be."""
        process.set_route("off" if self.route == "local" else self.route)
        os.environ[LONG_VAR] = self.long_training
        dispatch.fn = local_a2a if self.route == "local" else dispatch.public_op


def parse_tokens(text: str) -> list[int]:
    out = []
    for item in text.split(","):
        item = item.strip().lower()
        out.append(int(item[:-1]) * 1024 if item.endswith("k") else int(item))
    return out


def parse_long_training(text: str | None, current: str) -> list[str]:
    values = [v.strip() for v in text.split(",")] if text else [current]
    for v in values:
        if v not in ("auto", "chunked"):
            raise SystemExit(f"--long-training {text!r}: each value must be 'auto' or 'chunked'")
    return list(dict.fromkeys(values))


class Bench:
    """One run: the model, the variants, and the per-token procedure (see the module docstring)."""

    def __init__(self, args, rank: int, world: int, device: torch.device, helper, runner: Runner,
                 variants: list[Variant], notes: list[str], dispatch: Dispatch) -> None:
        self.args, self.rank, self.world, self.device = args, rank, world, device
        self.helper, self.runner, self.variants, self.notes = helper, runner, variants, notes
        self.probe, self.dispatch = runner.probe, dispatch
        self.dtype = DTYPES[args.dtype]
        self.saved: dict[str, torch.Tensor] = {}

    def geoms(self, n_tok: int) -> dict[str, object]:
        from fastvideo.distributed.ulysses.policy import Geometry

        p, h, d = self.world, self.args.heads, self.args.hidden // self.args.heads
        return {"qkv": Geometry.from_input((3, n_tok // p, h, d), 0, p, self.dtype),
                "out": Geometry.from_input((1, n_tok, h // p, d), 1, p, self.dtype)}

    def step_fn(self, kind: str, x: torch.Tensor) -> Callable[[], object]:
        return (lambda: self.runner.infer(x)) if kind == "infer" else (lambda: self.runner.train(x))

    # -------------------------------------------------------------------------------------- trials

    def trials(self, n_tok: int, x: torch.Tensor, timed_variants: list[Variant]) -> tuple[dict, dict, dict]:
        """Rotated trials. Returns results[(key, kind)], helper counts and history records per (key, kind)."""
        results = {(v.key, kind): {"times": [], "retries": [], "peak": [], "peak_reserved": []}
                   for v in timed_variants for kind in v.kinds}
        ran: dict = {}
        records: dict = {}
        cuda = self.device.type == "cuda"
        try:
            for trial in range(self.args.repeat):
                for v in rotated(timed_variants, trial):
                    v.apply(self.dispatch)
                    for kind in v.kinds:
                        watch = self.helper is not None and v.route == "auto"
                        before = self.helper.stats() if watch else None
                        mark = history_mark(self.helper) if watch else -1
                        if cuda:
                            torch.cuda.reset_peak_memory_stats(self.device)
                        r0 = alloc_retries(self.device)
                        # Host-to-completion from a line-up, rank-max; the result is dropped at once (an inference
                        # output kept alive would sit in the next step's peak memory).
                        seconds = timing.host_latencies(self.step_fn(kind, x), self.device, 1, 0)[0]
                        r1 = alloc_retries(self.device)
                        res = results[(v.key, kind)]
                        res["times"].append(seconds)
                        res["retries"].append(int(timing.rank_max([r1 - r0])[0]) if r0 is not None else None)
                        if cuda:
                            peaks = timing.rank_max([torch.cuda.max_memory_allocated(self.device) / 2**30,
                                                     torch.cuda.max_memory_reserved(self.device) / 2**30])
                            res["peak"].append(peaks[0])
                            res["peak_reserved"].append(peaks[1])
                        if watch:
                            add_calls(ran, (v.key, kind), before, self.helper.stats())
                            records.setdefault((v.key, kind), []).extend(records_since(self.helper, mark))
        finally:
            self.dispatch.fn = self.dispatch.public_op
        return results, ran, records

    # -------------------------------------------------------------------------------------- check pass

    def check_pass(self, x: torch.Tensor, variants: list[Variant]) -> tuple[dict, dict, dict, float]:
        """Untimed: per variant one inference and one training step with the probe on (in-step op times),
        whose outputs and gradients are compared; plus a second NCCL step for the gradient threshold.
        Returns (outputs, grads, in_step[(key, kind)], calibration)."""
        outputs, grads, in_step = {}, {}, {}
        calib = 0.0
        for v in variants:
            v.apply(self.dispatch)
            self.probe.active = True
            try:
                if v.infer:
                    outputs[v.key] = self.runner.infer(x)
                    timing.synchronize(self.device)
                    in_step[(v.key, "infer")] = self.in_step_summary(self.probe.collect())
                grads[v.key] = self.runner.train(x, capture=True)
                timing.synchronize(self.device)
                in_step[(v.key, "train")] = self.in_step_summary(self.probe.collect())
            finally:
                self.probe.active = False
            if v.route == "off":
                # Two NCCL-route steps' gradients: rounding differences between identical runs.
                calib = max_abs_diff(grads[v.key], self.runner.train(x, capture=True))
        return outputs, grads, in_step, calib

    def in_step_summary(self, calls: dict[str, dict]) -> dict:
        """Rank-max per ``op/phase`` label, and the rank-max of each rank's total (not the sum of maxima)."""
        labels = sorted(calls)
        device = [calls[k]["device_s"] for k in labels]
        host = [calls[k]["host_s"] for k in labels]
        device_s = timing.rank_max([*device, sum(device)])
        host_s = timing.rank_max([*host, sum(host)])
        per = {k: {"calls": calls[k]["calls"], "device_s": d, "host_s": h} for k, d, h in zip(labels, device_s, host_s)}
        return {"op_device_s": device_s[-1], "op_host_s": host_s[-1], "calls": per,
                "counts": {k: calls[k]["calls"] for k in labels},
                "timer": "cuda events" if self.device.type == "cuda" else "perf_counter (CPU)"}

    # -------------------------------------------------------------------------------------- op level

    def op_level(self, n_tok: int, variants: list[Variant]) -> dict:
        """The step's own all-to-all calls in isolation, every variant side by side (rotated rounds)."""
        p, h, d = self.world, self.args.heads, self.args.hidden // self.args.heads
        shapes = {"qkv": ((3, n_tok // p, h, d), 2, 1), "out": ((1, n_tok, h // p, d), 1, 2)}
        gen = torch.Generator(device=self.device).manual_seed(self.args.seed + 7 + self.rank)
        tensors = {}
        for op, (shape, scatter, gather) in shapes.items():
            # Drawn in the compute dtype directly: an fp32 draw of the 250k packed QKV would be 10.7 GB.
            x = torch.randn(shape, generator=gen, device=self.device, dtype=self.dtype)
            out_shape = (shape[0], shape[1] * p, shape[2] // p, d) if scatter == 2 else \
                (shape[0], shape[1] // p, shape[2] * p, d)
            gy = torch.randn(out_shape, generator=gen, device=self.device, dtype=self.dtype)
            tensors[op] = (x, x.detach().clone().requires_grad_(True), gy, scatter, gather)

        public_op = self.dispatch.public_op  # the op level times the public op itself, whatever the variant

        def fn(op: str, kind: str) -> Callable[[], object]:
            x, xg, gy, scatter, gather = tensors[op]
            if kind == "nograd":
                def call() -> object:
                    with torch.no_grad():
                        return public_op(x, scatter, gather)
            elif kind == "grad":
                def call() -> object:
                    return public_op(xg, scatter, gather)
            else:
                def call() -> object:
                    return torch.autograd.grad(public_op(xg, scatter, gather), xg, gy)
            return call

        samples: dict[tuple[str, str, str], list[float]] = {}
        records: dict[str, list] = {}
        for rnd in range(self.args.repeat):
            for v in rotated(variants, rnd):
                v.apply(self.dispatch)
                mark = history_mark(self.helper) if v.route == "auto" else -1
                for op in OPS:
                    for kind in (("nograd",) if v.infer else ()) + ("grad", "fwdbwd"):
                        lat = timing.host_latencies(fn(op, kind), self.device, self.args.iters, self.args.warmup)
                        samples.setdefault((v.key, op, kind), []).extend(lat)
                if v.route == "auto":
                    records.setdefault(v.key, []).extend(records_since(self.helper, mark))
        tensors.clear()  # free the operands before the next token count
        units: dict[str, dict[str, dict[str, float | None]]] = {}
        for (key, op, kind), lat in samples.items():
            units.setdefault(key, {}).setdefault(op, {})[kind] = stats.median(lat)
        plane_bytes = n_tok // p * self.args.hidden * self.dtype.itemsize
        operand = {"qkv": 3 * plane_bytes, "out": plane_bytes}
        gbps = {key: {op: stats.bandwidth_gbps(operand[op], p, u.get("nograd") or u.get("grad"))
                      for op, u in per.items()} for key, per in units.items()}
        geoms = self.geoms(n_tok)
        return {"tokens": n_tok, "units_s": units, "gbps": gbps, "operand_bytes": operand,
                "iters": self.args.iters * self.args.repeat, "timing": "timing.host_latencies, rank-max, median",
                "plans": {key: describe_calls(recs, geoms) for key, recs in records.items()}}

    # -------------------------------------------------------------------------------------- one token count

    def run_tokens(self, n_tok: int) -> tuple[list[dict], dict, dict]:
        args, world, device, helper = self.args, self.world, self.device, self.helper
        gen = torch.Generator(device=device).manual_seed(args.seed + self.rank)
        x = torch.randn(1, n_tok // world, args.hidden, generator=gen, device=device)
        variants = self.variants
        self.runner.offload_now = offload_for(args, n_tok)
        self.runner.steps.clear()
        # Warm-up (compiles flex_attention, builds the helper's plans, fills the caching allocator) for the
        # NCCL route and the first auto variant; further LONG_TRAINING variants run the same kernels.
        for v in variants:
            if v.infer:
                v.apply(self.dispatch)
                for kind in v.kinds:
                    self.step_fn(kind, x)()
        share_on = world > 1 and not args.skip_share
        local = [Variant("local", variants[0].long_training, infer=True)] if share_on else []
        results, ran, records = self.trials(n_tok, x, variants[:1] + local + variants[1:])
        outputs, grads, in_step, calib = self.check_pass(x, variants)
        threshold = args.grad_factor * calib
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the op-level operands get fresh blocks, not the step's fragments
        ops = self.op_level(n_tok, variants)

        share: dict = {"tokens": n_tok, "steps_run": dict(self.runner.steps), "offload": self.runner.offload_now}
        if share_on:
            for kind in ("infer", "train"):
                nccl_s = stats.median(results[("off", kind)]["times"])
                local_s = stats.median(results[("local", kind)]["times"])
                share[kind] = {"nccl_s": nccl_s, "local_s": local_s, "share": 1 - local_s / nccl_s,
                               "local_trial_s": results[("local", kind)]["times"]}
        elif world == 1:
            share["note"] = "SP1: the op returns its input, so the all-to-all's share is 0"
        else:
            share["note"] = "--skip-share"

        geoms = self.geoms(n_tok)
        # The registered window exists only where construction succeeded.
        window = int(helper.window_bytes) if helper is not None and helper.fused_available else 0
        # ncclMemAlloc: the native transport's window is outside torch's caching allocator (CUDA);
        # GlooPlanTransport's is a torch tensor (CPU, where there are no peak stats anyway).
        window_in_peak = device.type != "cuda"
        rows: list[dict] = []
        by_kind: dict[str, dict] = {}
        for v in variants:
            for kind in v.kinds:
                res = results[(v.key, kind)]
                info = ran.get((v.key, kind))
                if world == 1:
                    ran_text = "identity (SP1)"
                elif v.route == "off" or info is None:
                    ran_text = "nccl"
                else:
                    ran_text = "fused" if info["fused"] == info["calls"] else "nccl" if not info["fused"] else "mixed"
                retries = [r for r in res["retries"] if r is not None]
                steps = in_step[(v.key, kind)]
                row = {"tokens": n_tok, "route": v.route, "kind": kind, "long_training": v.long_training,
                       "offload": self.runner.offload_now,
                       "route_ran": ran_text, "helper_calls": info,
                       "plans": describe_calls(records.get((v.key, kind), []), geoms),
                       "median_s": stats.median(res["times"]), "trial_s": res["times"],
                       "alloc_retries": res["retries"], "alloc_retries_total": sum(retries) if retries else None,
                       "peak_mem_gib": max(res["peak"]) if res["peak"] else None,
                       "peak_reserved_gib": max(res["peak_reserved"]) if res["peak_reserved"] else None,
                       "share": share.get(kind, {}).get("share"), "in_step": steps,
                       "op_units_s": ops["units_s"].get(v.key),
                       "op_step_s": step_op_seconds(steps["counts"], ops["units_s"].get(v.key) or {})}
                if kind == "infer":
                    row["wrong"] = timing.rank_sum(oracle.count_bitwise_diff(outputs[v.key], outputs["off"]))
                    row["wrong_oracle"] = "inference output vs the NCCL route's (bitwise), summed over ranks"
                else:
                    diff = max_abs_diff(grads[v.key], grads["off"])
                    row.update(grad_max_abs_diff=diff, grad_threshold=threshold, grad_calibration=calib,
                               grad_ok=diff <= threshold, wrong=beyond(grads[v.key], grads["off"], threshold),
                               wrong_oracle="gradients vs the NCCL route's step: elements beyond the calibrated "
                                            "threshold, summed over ranks")
                if v.route == "off":
                    by_kind[kind] = row
                else:
                    self.add_gains(row, by_kind[kind], window, window_in_peak)
                rows.append(row)
            if args.save:
                if v.key in outputs:
                    self.saved[f"{n_tok}/{v.key}/out"] = outputs[v.key].detach().float().cpu().contiguous()
                for (name, _), g in zip(self.runner.params, grads[v.key]):
                    self.saved[f"{n_tok}/{v.key}/grad/{name}"] = g.contiguous()
        del x, outputs, grads
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return rows, share, ops

    def add_gains(self, row: dict, nccl: dict, window: int, window_in_peak: bool) -> None:
        row["op_speedup"] = (nccl["op_step_s"] / row["op_step_s"]
                             if row.get("op_step_s") and nccl.get("op_step_s") else None)
        row["ideal_gain"] = ideal_gain(row["share"], row["op_step_s"], nccl["op_step_s"])
        row["measured_gain"] = measured_gain(row["median_s"], nccl["median_s"])
        row["gain_fraction"] = (row["measured_gain"] / row["ideal_gain"]  # only where there is a gain to reach
                                if row["ideal_gain"] and row["ideal_gain"] > 0 and row["measured_gain"] is not None
                                else None)
        row["window_bytes"] = window
        row["memory"] = memory_use(row["peak_mem_gib"], nccl["peak_mem_gib"], window, window_in_peak)
        # Kept for every row; check_results.py prints them where the gain misses its target.
        row["reason_candidates"] = reason_candidates(row, nccl)


def restrict_engine(table: tuple, engine: str) -> tuple:
    """``table`` as it is (``engine == "table"``) or only its rows of one engine (``sm`` / ``ce``)."""
    return tuple(table) if engine == "table" else tuple(row for row in table if row.engine == engine)


def offload_for(args, n_tok: int) -> bool:
    return bool(args.offload_activations) and n_tok > args.offload_above


def default_tokens(args) -> list[int]:
    if args.tokens:
        return parse_tokens(args.tokens)
    return [32768, 65536, 131072] + ([250000] if args.offload_activations else [])

