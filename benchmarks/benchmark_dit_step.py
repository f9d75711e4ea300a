"""Full DiT step benchmark: sequence-parallel (Ulysses) blocks under FSDP2, NCCL route vs fused route.

Launch (one process per GPU; the SP group and the FSDP mesh both span all ranks):

    torchrun --standalone --nproc_per_node=2 benchmarks/benchmark_dit_step.py --json dit.json --plot dit.png
    torchrun --standalone --nproc_per_node=2 benchmarks/benchmark_dit_step.py --offload-activations   # adds 250k
    torchrun --standalone --nproc_per_node=2 benchmarks/benchmark_dit_step.py --attention sparse --tokens 32k,128k \\
        --long-training auto,chunked                                                                 # issue 14
    torchrun --standalone --nproc_per_node=1 benchmarks/benchmark_dit_step.py --tokens 32k --blocks 2  # SP1
    torchrun --standalone --nproc_per_node=2 benchmarks/benchmark_dit_step.py --device cpu --hidden 64 --heads 4 \\
        --blocks 2 --tokens 256                                                                      # CPU smoke
    python benchmarks/benchmark_dit_step.py --estimate --tokens 32k,128k --attention sparse --blocks 2 \\
        --long-training auto,chunked                                # wall-time estimate of that run, no GPU
    python benchmarks/benchmark_dit_step.py --plot-from a.json b.json --plot dit.png   # plot saved runs

The model: ``--blocks`` DiT blocks (LayerNorm -> QKV -> Ulysses all-to-all (packed QKV, mode 0) ->
attention on the local heads -> all-to-all back (mode 1) -> proj, residual; LayerNorm -> 4x GELU MLP,
residual), hidden 7168 = 56 heads x 128 by default. Every block and the root are ``fully_shard``-ed
(FSDP2) over the same ranks, with explicit forward/backward prefetch of the neighbouring block; fp32
master weights, bf16 compute (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``); full
activation checkpointing of every block; AdamW resident on the device with LR = weight decay = 0 so
the weights stay bit-identical across routes and trials. ``--offload-activations`` saves the
checkpointed block inputs to pinned host memory (``torch.autograd.graph.save_on_cpu``); with
``--offload-above N`` only for token counts above N, so one run holds 128k without and 250k with it.

Attention: ``dense`` uses flash-attn when installed (bf16, CUDA), SDPA otherwise; ``sparse`` is
``flex_attention`` with a block mask keeping every 10th 128-token key block for each query block (90%
block sparsity); on CPU ``sparse`` falls back to dense with a note.

Variants: the NCCL route (``off``) and, for every ``--long-training`` value (comma list, default the
environment's), the ``auto`` route with ``FASTVIDEO_ULYSSES_A2A_LONG_TRAINING`` set to it. Inference
(no-grad) operands ignore LONG_TRAINING, so only the first value gets inference rows.

Per ``--tokens`` value (global sequence; ``Nk`` = N x 1024):

1. Warm-up: one inference forward and one training step on the NCCL route and on the first auto
   variant (compiles flex_attention, builds the plans; further LONG_TRAINING variants run the same
   kernels).
2. ``--trials`` (>= 3) rotated trials: trial t runs [off, local, auto[lt]...] rotated by t; each does a
   no-grad inference forward and a full training step (forward, backward, clip_grad_norm_, optimizer
   step), timed as rank-max host wall time (barrier, perf_counter, device sync). ``local`` is the step
   with the op replaced by a communication-free slice + repeat of the same shape (one read and one write
   of the operand, like the permutes): share = 1 - t_local / t_nccl (medians), the all-to-all's share
   of the step on the NCCL route. Allocator retries (``num_alloc_retries`` deltas) and peak memory
   (``max_memory_allocated``, reset per trial) per trial, rank-max.
3. Check pass (untimed), one inference forward and one training step per variant, with the probe on:
   CUDA events around every all-to-all call inside the model (forward, checkpoint recompute, and
   backward through pre/post hooks on the op's autograd node) give the in-step op time per route and
   count the step's calls (the timed trials stay uninstrumented). The outputs and gradients compared
   are this pass's (inference bit-identical to the NCCL route; gradients within ``--grad-factor`` x
   the max abs diff of two NCCL-route steps).
4. Op level, same run, on the step's own shapes: the exact calls the step makes, packed QKV
   ``[3, S/P, H, D]`` mode 0 and the attention output ``[1, S, H/P, D]`` mode 1, in the compute dtype,
   no-grad, grad-tracked forward, and forward + backward, NCCL route and each auto variant side by side
   (rotated rounds), host-to-completion medians (``common.host_latencies``). Weighted by the calls the
   probe counted in the step (``step_op_seconds``: a forward + backward pair at the fwd+bwd time, a
   recompute at the grad-forward time, a no-grad call at the no-grad time): op seconds per step.

Per auto row: ideal gain = share x (1 - op_fused / op_nccl); measured gain = 1 - t_fused / t_nccl
(step medians); the row meets the 85% target when measured >= 0.85 x ideal; otherwise the reason
candidates measured in the run are printed (op in the step vs isolated, the rest of the step, the
share against the NCCL op's in-step time, host time in the calls, declines, retries, trial spread).
Memory: the fused row's peak (+ the window where the window lives outside torch's allocator, as the
native transport's ``ncclMemAlloc`` window does) must not exceed the NCCL row's peak + the window.
Verdicts (PASS / FAIL / NOT MEASURED with the reason), one line per issue-14 target, end the output
and are in the JSON. The process exits 1 when a correctness check fails (``failures``); performance
targets are verdicts, not exit codes.

Columns: ``tokens``, ``route``, ``long`` (``FASTVIDEO_ULYSSES_A2A_LONG_TRAINING``; the NCCL route ignores
it), ``kind`` (infer/train), ``ran`` (fused/nccl/mixed from the helper's counts over the timed trials;
plans per row from its history), ``median s``, ``min s``/``max s`` over trials, ``retries``, ``peak
GiB``, ``wrong`` (inference), ``grad diff``/``thresh``/``ok`` (training); then the gain table (see
``docs/benchmarks.md``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

import common  # first: puts the FastVideo tree under test on sys.path
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from fastvideo.distributed.communication_op import sequence_model_parallel_all_to_all_4D
from fastvideo.distributed.parallel_state import get_sp_group
from fastvideo.layers.attention import attention as dense_attention
from fastvideo.layers.attention import attention_backend

SPARSE_BLOCK = 128
SPARSE_KEEP_EVERY = 10  # keep 1 key block in 10: 90% block sparsity
LONG_VAR = "FASTVIDEO_ULYSSES_A2A_LONG_TRAINING"

# Issue 14's targets.
GAIN_FRACTION = 0.85  # measured step gain >= 85% of the ideal gain, every auto row
TARGET_TOKENS = 131072  # the 128k sparse rows
TARGET_TRAIN_GAIN = 0.03  # fused >= 3% faster per training step at 128k sparse
TARGET_INFER_GAIN = 0.05  # fused >= 5% faster per inference step at 128k sparse
OPS = ("qkv", "out")  # the step's two all-to-alls: packed QKV (mode 0) and the attention output (mode 1)


# ---------------------------------------------------------------------------------------------- the all-to-all


def local_a2a(x: torch.Tensor, scatter_dim: int = 2, gather_dim: int = 1) -> torch.Tensor:
    """Communication-free stand-in with the op's output shape and about its memory traffic."""
    p = get_sp_group().world_size
    if p == 1:
        return x
    if (scatter_dim, gather_dim) == (2, 1):
        return x[:, :, : x.shape[2] // p].repeat(1, p, 1, 1)
    return x[:, : x.shape[1] // p].repeat(1, 1, p, 1)


A2A = {"fn": sequence_model_parallel_all_to_all_4D}  # swapped for ``local_a2a`` in the ``local`` variant


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

    def call(self, x: torch.Tensor, scatter_dim: int, gather_dim: int, name: str) -> torch.Tensor:
        grad = torch.is_grad_enabled() and x.requires_grad
        phase = "recompute" if self.in_backward else ("fwd_grad" if grad else "fwd")
        h0 = time.perf_counter()
        m0 = self._mark()
        y = A2A["fn"](x, scatter_dim, gather_dim)
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


PROBE: Probe | None = None  # set in main()


def a2a(x: torch.Tensor, scatter_dim: int, gather_dim: int, name: str) -> torch.Tensor:
    if PROBE is not None and PROBE.active:
        return PROBE.call(x, scatter_dim, gather_dim, name)
    return A2A["fn"](x, scatter_dim, gather_dim)


# ---------------------------------------------------------------------------------------------- attention


def _sparse_mask_mod(b, h, q_idx, kv_idx):
    return (q_idx // SPARSE_BLOCK - kv_idx // SPARSE_BLOCK) % SPARSE_KEEP_EVERY == 0


class SparseAttention:
    """flex_attention with a fixed 90%-sparse block mask (CUDA; built once per sequence length)."""

    def __init__(self, device: torch.device) -> None:
        from torch.nn.attention.flex_attention import flex_attention

        self.device = device
        self.fn = torch.compile(flex_attention, dynamic=False)
        self.masks: dict[int, object] = {}

    def mask(self, s: int):
        if s not in self.masks:
            from torch.nn.attention.flex_attention import BlockMask

            n = -(-s // SPARSE_BLOCK)
            q = torch.arange(n, device=self.device)
            # Key blocks j with (i - j) % 10 == 0 for query block i: the diagonal plus every 10th block.
            first = q % SPARSE_KEEP_EVERY
            count = (n - 1 - first) // SPARSE_KEEP_EVERY + 1
            # kv_indices is [q blocks, kv blocks]: the first count[i] entries of row i are used.
            idx = first[:, None] + SPARSE_KEEP_EVERY * torch.arange(n, device=self.device)[None, :]
            idx = torch.where(idx < n, idx, torch.zeros_like(idx)).to(torch.int32)
            # Listed as full blocks (the kernel applies no mask_mod inside them); mask_mod states the same
            # pattern element-wise for paths that evaluate it (eager flex_attention, to_dense).
            self.masks[s] = BlockMask.from_kv_blocks(
                torch.zeros_like(count, dtype=torch.int32)[None, None], idx[None, None],
                full_kv_num_blocks=count.to(torch.int32)[None, None], full_kv_indices=idx[None, None],
                BLOCK_SIZE=SPARSE_BLOCK, mask_mod=_sparse_mask_mod, seq_lengths=(s, s))
        return self.masks[s]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = self.fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=self.mask(q.shape[1]))
        return out.transpose(1, 2)


# ---------------------------------------------------------------------------------------------- the model


class DiTBlock(nn.Module):
    """One sequence-parallel DiT block on this rank's ``[B, S/P, hidden]`` shard."""

    def __init__(self, hidden: int, heads: int, attn, checkpointing: bool) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.norm1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.norm2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)
        self.attn = attn
        self.checkpointing = checkpointing

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, hidden = x.shape
        qkv = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, self.head_dim)
        # Packed Q, K, V planes. contiguous(): with B = 1 the reshape is a strided view, which the fused
        # route declines (NON_CONTIGUOUS) while the NCCL route copies it silently.
        qkv = qkv.permute(2, 0, 1, 3, 4).reshape(3 * b, s, self.heads, self.head_dim).contiguous()
        qkv = a2a(qkv, 2, 1, "qkv")  # [3B, S, H/P, D]
        q, k, v = qkv.split(b, dim=0)
        out = a2a(self.attn(q, k, v).contiguous(), 1, 2, "out")  # [B, S/P, H, D]
        x = x + self.proj(out.reshape(b, s, hidden))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x)), approximate="tanh"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointing and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)


class DiT(nn.Module):
    def __init__(self, hidden: int, heads: int, blocks: int, attn, checkpointing: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(DiTBlock(hidden, heads, attn, checkpointing) for _ in range(blocks))
        self.norm = nn.LayerNorm(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


def build_model(args, device: torch.device, attn) -> DiT:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(args.seed)  # identical initial weights on every rank before sharding
    with torch.device(device):
        model = DiT(args.hidden, args.heads, args.blocks, attn, checkpointing=not args.no_checkpointing)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=common.DTYPES[args.dtype], reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    blocks = list(model.blocks)
    for i, block in enumerate(blocks):  # prefetch the neighbouring block's parameters
        if i + 1 < len(blocks):
            block.set_modules_to_forward_prefetch([blocks[i + 1]])
        if i > 0:
            block.set_modules_to_backward_prefetch([blocks[i - 1]])
    return model


# ---------------------------------------------------------------------------------------------- steps


class Runner:
    def __init__(self, args, model: DiT, device: torch.device, probe: Probe) -> None:
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


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Rank-max host wall time of ``fn``. Its result is dropped at once: an inference output kept alive
    would sit in the next step's peak memory."""
    common.barrier()
    common.synchronize(device)
    start = time.perf_counter()
    fn()
    common.synchronize(device)
    return common.rank_max([time.perf_counter() - start])[0]


def alloc_retries(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))


def max_abs_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    local = max((float((x - y).abs().max()) if x.numel() else 0.0 for x, y in zip(a, b)), default=0.0)
    return common.rank_max([local])[0]


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


def gain_check(measured: float | None, ideal: float | None,
               fraction: float = GAIN_FRACTION) -> tuple[bool | None, str]:
    """(ok, why): ok when measured >= fraction x ideal; None when it cannot be judged (nothing to gain)."""
    if measured is None or ideal is None:
        return None, "not measured (no share, a negative share, or no op time)"
    if ideal <= 0:
        return None, (f"ideal gain {ideal * 100:.2f}% <= 0: the fused op is not faster than the NCCL op on the "
                      "step's shapes (or the share is 0), so there is no gain to reach")
    ok = measured >= fraction * ideal
    return ok, (f"measured {measured * 100:.2f}% {'>=' if ok else '<'} {fraction:g} x ideal {ideal * 100:.2f}% "
                f"= {fraction * ideal * 100:.2f}% ({measured / ideal * 100:.0f}% of ideal)")


def memory_check(peak_fused_gib: float | None, peak_nccl_gib: float | None, window_bytes: int,
                 window_in_peak: bool) -> dict | None:
    """The fused row's memory against the NCCL row's plus the window.

    ``max_memory_allocated`` only sees torch's caching allocator. The native transport's window comes
    from ``ncclMemAlloc``, outside it: then the fused route's footprint is its peak plus the window, and
    the check ``fused peak + window <= NCCL peak + window`` leaves no extra room for torch allocations.
    """
    if peak_fused_gib is None or peak_nccl_gib is None:
        return None
    window_gib = window_bytes / 2**30
    fused_total = peak_fused_gib + (0.0 if window_in_peak else window_gib)
    limit = peak_nccl_gib + window_gib
    return {"fused_peak_gib": peak_fused_gib, "nccl_peak_gib": peak_nccl_gib, "window_bytes": window_bytes,
            "window_in_peak": window_in_peak, "fused_total_gib": fused_total, "limit_gib": limit,
            "ok": fused_total <= limit}


def spread(times: Sequence[float]) -> float | None:
    """(max - min) / median of a row's trials."""
    med = common.median(times)
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


# ---------------------------------------------------------------------------------------------- verdicts (pure)


def _every(rows: list[dict], field: str, what: str) -> tuple[str, str]:
    """PASS if ``row[field]`` is True in every row; FAIL naming the rows where it is False; NOT MEASURED
    naming the rows where it is None (FAIL wins)."""
    if not rows:
        return "NOT MEASURED", f"no rows for {what}"
    bad = [row_name(r) for r in rows if r.get(field) is False]
    unknown = [row_name(r) for r in rows if r.get(field) is None]
    if bad:
        also = f"; not measured in {', '.join(unknown)}" if unknown else ""
        return "FAIL", f"{what} fails in {', '.join(bad)}{also}"
    if unknown:
        return "NOT MEASURED", f"{what} not measured in {', '.join(unknown)}"
    return "PASS", f"{what} holds in every row ({len(rows)})"


def row_name(r: dict) -> str:
    long = f"[{r.get('long_training')}]" if r.get("route") == "auto" else ""
    return f"{r.get('tokens')} {r.get('route')}{long} {r.get('kind')}"


def verdicts(rows: list[dict], *, sparse: bool, timing_not_measured: str | None = None) -> list[dict]:
    """One verdict per issue-14 target (the 128k targets: one per LONG_TRAINING value that has a row).

    ``timing_not_measured``: why timings are no measurement here (a CPU run), or None on a GPU run.
    """
    auto = [r for r in rows if r.get("route") == "auto"]
    out: list[dict] = []

    def add(target: str, verdict: str, detail: str) -> None:
        out.append({"target": target, "verdict": verdict, "detail": detail})

    target = f"step gain >= {GAIN_FRACTION:g} x ideal gain, every auto row"
    if timing_not_measured:
        add(target, "NOT MEASURED", timing_not_measured)
    else:
        add(target, *_every(auto, "gain_ok", "measured >= 0.85 x ideal"))
    for kind, goal in (("train", TARGET_TRAIN_GAIN), ("infer", TARGET_INFER_GAIN)):
        step = "training" if kind == "train" else "inference"
        target = f"128k sparse: fused >= {goal * 100:g}% faster per {step} step"
        picked = [r for r in auto if r.get("tokens") == TARGET_TOKENS and r.get("kind") == kind]
        if timing_not_measured:
            add(target, "NOT MEASURED", timing_not_measured)
        elif not sparse:
            add(target, "NOT MEASURED", "dense attention in this run (the target is for --attention sparse)")
        elif not picked:
            add(target, "NOT MEASURED", f"no {TARGET_TOKENS}-token {kind} row in this run")
        for r in picked if sparse and not timing_not_measured else []:
            gain = r.get("measured_gain")
            name = f"{target} [long={r.get('long_training')}]"
            if gain is None:
                add(name, "NOT MEASURED", "no measured gain (NCCL row missing)")
            else:
                add(name, "PASS" if gain >= goal else "FAIL",
                    f"measured gain {gain * 100:.2f}% vs {goal * 100:g}% ({r.get('route_ran')})")
    target = "peak memory <= NCCL route's + window, every auto row"
    if timing_not_measured:
        add(target, "NOT MEASURED", timing_not_measured)
    else:
        add(target, *_every([dict(r, mem_ok=(r.get("memory") or {}).get("ok")) for r in auto], "mem_ok",
                            "fused peak (+ window outside torch) <= NCCL peak + window"))
    target = "0 allocator retries, every row"
    if timing_not_measured:
        add(target, "NOT MEASURED", timing_not_measured)
    else:
        add(target, *_every([dict(r, no_retries=None if r.get("alloc_retries_total") is None
                                  else r["alloc_retries_total"] == 0) for r in rows], "no_retries",
                            "0 num_alloc_retries"))
    add("inference bit-identical to the NCCL route",
        *_every([dict(r, identical=None if r.get("wrong") is None else r["wrong"] == 0)
                 for r in auto if r.get("kind") == "infer"], "identical", "0 differing elements"))
    add("gradients within the calibrated threshold",
        *_every([r for r in auto if r.get("kind") == "train"], "grad_ok", "max abs diff <= threshold"))
    return out


# ---------------------------------------------------------------------------------------------- run-time estimate


# Calibration: the SP1 32k dense step on one H200 (docs/results/2026-11-29-h200-one-gpu/dit_sp1.json):
# 4 blocks at hidden 7168 are 2.85e14 forward FLOPs (forward_flops) in 0.460 s; training 2.018 s.
EST_FLOPS_PER_S = 2.85e14 / 0.460
EST_TRAIN_OVER_INFER = 2.018 / 0.460  # forward + recompute + backward (2 forwards) + clip + AdamW
EST_SPARSE_ATTN_COST = 0.2  # assumption, not measured: 90% sparse = 10% of the FLOPs at half SDPA's rate
EST_OP_BYTES_PER_S = 2.69e9 / 10.856e-3  # DESIGN.md: NCCL route, packed QKV 128k (2.69 GB per rank)
EST_STARTUP_S = 40.0  # assumption: interpreter, process groups, model init, FSDP, helper construction
EST_COMPILE_S = 60.0  # assumption: flex_attention forward + backward compile per sequence length
EST_OFFLOAD = 1.1  # assumption: save_on_cpu copies of the checkpointed block inputs


def forward_flops(hidden: int, blocks: int, tokens: int, sparse: bool) -> float:
    """FLOPs of one forward of the whole model over ``tokens`` (all ranks together).

    Per token per block: QKV 3h^2 + proj h^2 + MLP 8h^2 multiply-adds = 24 h^2 FLOPs; attention (full,
    non-causal): QK^T and PV, 2 x 2 x S x h FLOPs per token.
    """
    linear = 24 * hidden * hidden * tokens * blocks
    attention = 4 * tokens * tokens * hidden * blocks
    return linear + attention * (EST_SPARSE_ATTN_COST if sparse else 1.0)


def steps_per_tokens(n_long: int, trials: int, local: bool) -> tuple[int, int]:
    """(inference forwards, training steps) that one token count runs (the procedure in the docstring):
    warm-up of the NCCL route and the first auto variant, trials x (variants + local), the check pass
    per variant, one calibration step."""
    infer_variants = 1 + (1 if n_long else 0)
    variants = 1 + n_long
    n_infer = infer_variants + trials * (infer_variants + int(local)) + infer_variants
    n_train = infer_variants + trials * (variants + int(local)) + variants + 1
    return n_infer, n_train


def estimate_seconds(*, hidden: int, heads: int, blocks: int, tokens: Sequence[int], world: int, sparse: bool,
                     n_long: int, trials: int, share: bool, offload: Callable[[int], bool], op_iters: int,
                     op_warmup: int, itemsize: int = 2) -> dict:
    """Wall-time estimate of one run (per token count and total), from the FLOP model above."""
    per: list[dict] = []
    for n_tok in tokens:
        infer_s = forward_flops(hidden, blocks, n_tok, sparse) / world / EST_FLOPS_PER_S
        train_s = infer_s * EST_TRAIN_OVER_INFER * (EST_OFFLOAD if offload(n_tok) else 1.0)
        n_infer, n_train = steps_per_tokens(n_long, trials, share and world > 1)
        # Op level: per round and variant, qkv (3 planes) and out (1 plane): nograd (infer variants),
        # grad and fwdbwd (2 calls) per (iters + warmup).
        plane = n_tok // world * hidden * itemsize
        call_s = 4 * plane / EST_OP_BYTES_PER_S
        op_s = trials * (op_iters + op_warmup) * call_s * ((1 + (1 if n_long else 0)) * 1 + (1 + n_long) * 3)
        seconds = n_infer * infer_s + n_train * train_s + op_s + (EST_COMPILE_S if sparse else 0.0)
        per.append({"tokens": n_tok, "infer_s": infer_s, "train_s": train_s, "infer_steps": n_infer,
                    "train_steps": n_train, "op_level_s": op_s, "seconds": seconds})
    return {"per_tokens": per, "startup_s": EST_STARTUP_S,
            "total_s": EST_STARTUP_S + sum(p["seconds"] for p in per)}


# ---------------------------------------------------------------------------------------------- plot


Point = tuple[int, float, float, float, bool]  # tokens, median s, min s, max s, activations offloaded


def plot_series(runs: Sequence[dict]) -> dict[str, dict[str, list[Point]]]:
    """kind -> series label -> [(tokens, median, min, max, offload)] from saved runs (``{"header", "rows"}``)."""
    out: dict[str, dict[str, list[Point]]] = {"infer": {}, "train": {}}
    for run in runs:
        header = run.get("header", {})
        attn = "sparse" if "flex" in str(header.get("attention", "")) else "dense"
        for r in run.get("rows", []):
            if r.get("kind") not in out or not r.get("trial_s"):
                continue
            route = "nccl" if r["route"] == "off" else f"fused long={r.get('long_training')}"
            # One line per route across token counts; offloaded points are marked in the JSON (offload).
            out[r["kind"]].setdefault(f"{attn}, {route}", []).append(
                (r["tokens"], r["median_s"], min(r["trial_s"]), max(r["trial_s"]), bool(r.get("offload"))))
    return {k: {label: sorted(points) for label, points in v.items()} for k, v in out.items()}


def write_plot(runs: Sequence[dict], path: str) -> dict:
    """Step time per route against tokens (inference and training panels); matplotlib where installed.

    Returns ``{"path": path or None, "skipped": reason or None}``: without matplotlib the plot is
    skipped with a note, never an error (the JSON holds every number the plot shows).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on the GPU hosts
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return {"path": None, "skipped": f"matplotlib not installed ({exc}); the JSON has the numbers"}
    series = plot_series(runs)
    # One colour per series in both panels (NCCL lines first).
    labels = sorted({label for per in series.values() for label in per}, key=lambda t: ("fused" in t, t))
    colour = {label: f"C{i % 10}" for i, label in enumerate(labels)}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, kind in zip(axes, ("infer", "train")):
        for label in (t for t in labels if t in series[kind]):
            points = series[kind][label]
            xs = [p[0] for p in points]
            ys = [p[1] for p in points]
            err = [[p[1] - p[2] for p in points], [p[3] - p[1] for p in points]]
            ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=label, color=colour[label])
            for p in points:
                if p[4]:
                    ax.annotate("offload", (p[0], p[1]), fontsize=6, textcoords="offset points", xytext=(3, -9))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens (global)")
        ax.set_ylabel("step time, median of trials (s)")
        ax.set_title("inference forward" if kind == "infer" else "training step")
        ax.grid(True, which="both", alpha=0.3)
        if series[kind]:
            ax.legend(fontsize=7)
    header = runs[0].get("header", {}) if runs else {}
    title = (f"DiT step, {header.get('gpu')} SP{header.get('sp_size')}, {header.get('blocks')} blocks, hidden "
             f"{header.get('hidden')}, commit {str(header.get('commit'))[:12]}")
    if str(header.get("device", "")).startswith("cpu"):
        title += " (CPU smoke: timings mean nothing)"
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return {"path": str(path), "skipped": None}


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

    def apply(self) -> None:
        """Select the route, LONG_TRAINING and the op. Every rank does the same at the same point, so the
        op's settings re-agreement (a changed agreed variable) is collective as it must be."""
        os.environ[LONG_VAR] = self.long_training
        common.set_route("off" if self.route == "local" else self.route)  # agrees both
        A2A["fn"] = local_a2a if self.route == "local" else sequence_model_parallel_all_to_all_4D


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
                 variants: list[Variant], notes: list[str]) -> None:
        self.args, self.rank, self.world, self.device = args, rank, world, device
        self.helper, self.runner, self.variants, self.notes = helper, runner, variants, notes
        self.probe = runner.probe
        self.dtype = common.DTYPES[args.dtype]
        self.failures: list[str] = []
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
            for trial in range(self.args.trials):
                k = trial % len(timed_variants)
                for v in timed_variants[k:] + timed_variants[:k]:
                    v.apply()
                    for kind in v.kinds:
                        watch = self.helper is not None and v.route == "auto"
                        before = self.helper.stats() if watch else None
                        mark = history_mark(self.helper) if watch else -1
                        if cuda:
                            torch.cuda.reset_peak_memory_stats(self.device)
                        r0 = alloc_retries(self.device)
                        seconds = timed(self.step_fn(kind, x), self.device)
                        r1 = alloc_retries(self.device)
                        res = results[(v.key, kind)]
                        res["times"].append(seconds)
                        res["retries"].append(int(common.rank_max([r1 - r0])[0]) if r0 is not None else None)
                        if cuda:
                            peaks = common.rank_max([torch.cuda.max_memory_allocated(self.device) / 2**30,
                                                     torch.cuda.max_memory_reserved(self.device) / 2**30])
                            res["peak"].append(peaks[0])
                            res["peak_reserved"].append(peaks[1])
                        if watch:
                            add_calls(ran, (v.key, kind), before, self.helper.stats())
                            records.setdefault((v.key, kind), []).extend(records_since(self.helper, mark))
        finally:
            A2A["fn"] = sequence_model_parallel_all_to_all_4D
        return results, ran, records

    # -------------------------------------------------------------------------------------- check pass

    def check_pass(self, x: torch.Tensor, variants: list[Variant]) -> tuple[dict, dict, dict, float]:
        """Untimed: per variant one inference and one training step with the probe on (in-step op times),
        whose outputs and gradients are compared; plus a second NCCL step for the gradient threshold.
        Returns (outputs, grads, in_step[(key, kind)], calibration)."""
        outputs, grads, in_step = {}, {}, {}
        calib = 0.0
        for v in variants:
            v.apply()
            self.probe.active = True
            try:
                if v.infer:
                    outputs[v.key] = self.runner.infer(x)
                    common.synchronize(self.device)
                    in_step[(v.key, "infer")] = self.in_step_summary(self.probe.collect())
                grads[v.key] = self.runner.train(x, capture=True)
                common.synchronize(self.device)
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
        device_s = common.rank_max([*device, sum(device)])
        host_s = common.rank_max([*host, sum(host)])
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

        def fn(op: str, kind: str) -> Callable[[], object]:
            x, xg, gy, scatter, gather = tensors[op]
            if kind == "nograd":
                def call() -> object:
                    with torch.no_grad():
                        return sequence_model_parallel_all_to_all_4D(x, scatter, gather)
            elif kind == "grad":
                def call() -> object:
                    return sequence_model_parallel_all_to_all_4D(xg, scatter, gather)
            else:
                def call() -> object:
                    return torch.autograd.grad(sequence_model_parallel_all_to_all_4D(xg, scatter, gather), xg, gy)
            return call

        samples: dict[tuple[str, str, str], list[float]] = {}
        records: dict[str, list] = {}
        for rnd in range(self.args.trials):
            k = rnd % len(variants)
            for v in variants[k:] + variants[:k]:
                v.apply()
                mark = history_mark(self.helper) if v.route == "auto" else -1
                for op in OPS:
                    for kind in (("nograd",) if v.infer else ()) + ("grad", "fwdbwd"):
                        lat = common.host_latencies(fn(op, kind), self.device, self.args.op_iters, self.args.op_warmup)
                        samples.setdefault((v.key, op, kind), []).extend(lat)
                if v.route == "auto":
                    records.setdefault(v.key, []).extend(records_since(self.helper, mark))
        tensors.clear()  # free the operands before the next token count
        units: dict[str, dict[str, dict[str, float | None]]] = {}
        for (key, op, kind), lat in samples.items():
            units.setdefault(key, {}).setdefault(op, {})[kind] = common.median(lat)
        plane_bytes = n_tok // p * self.args.hidden * self.dtype.itemsize
        operand = {"qkv": 3 * plane_bytes, "out": plane_bytes}
        gbps = {key: {op: common.bandwidth_gbps(operand[op], p, u.get("nograd") or u.get("grad"))
                      for op, u in per.items()} for key, per in units.items()}
        geoms = self.geoms(n_tok)
        return {"tokens": n_tok, "units_s": units, "gbps": gbps, "operand_bytes": operand,
                "iters": self.args.op_iters * self.args.trials, "timing": "common.host_latencies, rank-max, median",
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
                v.apply()
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
                nccl_s = common.median(results[("off", kind)]["times"])
                local_s = common.median(results[("local", kind)]["times"])
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
                       "median_s": common.median(res["times"]), "trial_s": res["times"],
                       "alloc_retries": res["retries"], "alloc_retries_total": sum(retries) if retries else None,
                       "peak_mem_gib": max(res["peak"]) if res["peak"] else None,
                       "peak_reserved_gib": max(res["peak_reserved"]) if res["peak_reserved"] else None,
                       "share": share.get(kind, {}).get("share"), "in_step": steps,
                       "op_units_s": ops["units_s"].get(v.key),
                       "op_step_s": step_op_seconds(steps["counts"], ops["units_s"].get(v.key) or {})}
                if kind == "infer":
                    row["wrong"] = common.rank_sum(common.count_bitwise_diff(outputs[v.key], outputs["off"]))
                    if row["wrong"]:
                        self.failures.append(f"{row_name(row)}: {row['wrong']} elements differ from NCCL")
                else:
                    diff = max_abs_diff(grads[v.key], grads["off"])
                    row.update(grad_max_abs_diff=diff, grad_threshold=threshold, grad_calibration=calib,
                               grad_ok=diff <= threshold)
                    if not row["grad_ok"]:
                        self.failures.append(f"{row_name(row)} gradients: max abs diff {diff:g} > {threshold:g}")
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
        row["gain_ok"], row["gain_check"] = gain_check(row["measured_gain"], row["ideal_gain"])
        row["window_bytes"] = window
        row["memory"] = memory_check(row["peak_mem_gib"], nccl["peak_mem_gib"], window, window_in_peak)
        # Kept for every row (the JSON); printed where the gain misses the target.
        row["reason_candidates"] = reason_candidates(row, nccl)


# ---------------------------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--heads", type=int, default=56)
    p.add_argument("--blocks", type=int, default=4, help="DiT blocks (4 at hidden 7168: ~2.5B params)")
    p.add_argument("--tokens", help="comma list of global sequence lengths, Nk = N x 1024 "
                                    "(default 32k,64k,128k; plus 250000 with --offload-activations)")
    p.add_argument("--routes", default="off,auto", help="'off,auto' (default) or 'off' (the NCCL route alone)")
    p.add_argument("--trials", type=int, default=3, help="rotated trials per variant (>= 3 for a median)")
    p.add_argument("--attention", choices=("dense", "sparse"), default="dense")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16", help="compute dtype (masters are fp32)")
    p.add_argument("--offload-activations", action="store_true")
    p.add_argument("--offload-above", type=int, default=0, metavar="TOKENS",
                   help="with --offload-activations, offload only token counts above this (one run can then "
                        "hold 128k without and 250k with offload)")
    p.add_argument("--no-checkpointing", action="store_true", help="disable full activation checkpointing")
    p.add_argument("--long-training", help="comma list of FASTVIDEO_ULYSSES_A2A_LONG_TRAINING values (auto, "
                                           "chunked): one auto variant each (default: the environment's value)")
    p.add_argument("--engine", choices=("table", "sm", "ce"), default="table",
                   help="fused-route plans from TUNED_TABLE as it is (default), or from its rows of one engine only "
                        "(sm: the fused kernel; ce: copy engines): to compare the engines inside the step")
    p.add_argument("--grad-factor", type=float, default=4.0,
                   help="gradient threshold = factor x max abs diff of two repeated NCCL-route steps")
    p.add_argument("--clip", type=float, default=1.0, help="clip_grad_norm_ max norm")
    p.add_argument("--skip-share", action="store_true", help="skip the all-to-all share (no ideal gain then)")
    p.add_argument("--op-iters", type=int, default=10, help="op-level iterations per round (x --trials rounds)")
    p.add_argument("--op-warmup", type=int, default=2, help="op-level warm-up calls per round")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json", help="write the JSON here (rewritten after every token count)")
    p.add_argument("--plot", help="PNG of step time per route against tokens (skipped without matplotlib)")
    p.add_argument("--plot-from", nargs="+", metavar="JSON", help="no run: plot these saved runs into --plot")
    p.add_argument("--estimate", action="store_true", help="no run: print the wall-time estimate of this run")
    p.add_argument("--estimate-world", type=int, default=2, help="SP size for --estimate")
    p.add_argument("--save", help="directory: per-rank safetensors of inference outputs and gradients")
    return p


def restrict_engine(table: tuple, engine: str) -> tuple:
    """``table`` as it is (``engine == "table"``) or only its rows of one engine (``sm`` / ``ce``)."""
    return tuple(table) if engine == "table" else tuple(row for row in table if row.engine == engine)


def offload_for(args, n_tok: int) -> bool:
    return bool(args.offload_activations) and n_tok > args.offload_above


def default_tokens(args) -> list[int]:
    if args.tokens:
        return parse_tokens(args.tokens)
    return [32768, 65536, 131072] + ([250000] if args.offload_activations else [])


def print_estimate(est: dict, args) -> None:
    print(f"# estimate: hidden {args.hidden}, {args.blocks} blocks, {args.attention}, SP{args.estimate_world}, "
          f"{args.trials} trials (H200 calibration: {EST_FLOPS_PER_S / 1e12:.0f} TFLOP/s effective, train = "
          f"{EST_TRAIN_OVER_INFER:.2f} x inference; sparse attention at {EST_SPARSE_ATTN_COST:g} of dense)")
    for p in est["per_tokens"]:
        print(f"#   {p['tokens']:>7} tokens: inference {p['infer_s']:.3f} s x {p['infer_steps']}, training "
              f"{p['train_s']:.3f} s x {p['train_steps']}, op level {p['op_level_s']:.1f} s -> {p['seconds']:.0f} s")
    print(f"#   startup {est['startup_s']:.0f} s; total {est['total_s']:.0f} s")


def main(argv: list[str] | None = None) -> int:
    global PROBE
    args = build_parser().parse_args(argv)
    if args.plot_from:
        if not args.plot:
            raise SystemExit("--plot-from needs --plot PATH")
        result = write_plot([json.loads(Path(p).read_text()) for p in args.plot_from], args.plot)
        print(f"# plot: {result['path'] or 'skipped: ' + str(result['skipped'])}")
        return 0
    tokens = default_tokens(args)
    from fastvideo import envs

    longs = parse_long_training(args.long_training, envs.get(LONG_VAR))
    routes = [r.strip() for r in args.routes.split(",")]
    t_main = time.perf_counter()

    def estimate(world: int) -> dict:
        return estimate_seconds(hidden=args.hidden, heads=args.heads, blocks=args.blocks, tokens=tokens, world=world,
                                sparse=args.attention == "sparse", n_long=len(longs) if "auto" in routes else 0,
                                trials=args.trials, share=not args.skip_share,
                                offload=lambda n: offload_for(args, n), op_iters=args.op_iters,
                                op_warmup=args.op_warmup)

    if args.estimate:
        print_estimate(estimate(args.estimate_world), args)
        return 0
    if args.trials < 3:
        raise SystemExit("--trials must be >= 3 (a median of fewer is no measurement)")
    rank, world, device = common.init_distributed(args.device)
    if args.hidden % args.heads or args.heads % world:
        raise SystemExit(f"--hidden {args.hidden} / --heads {args.heads}: heads must divide hidden and SP{world} "
                         "must divide heads")
    notes: list[str] = []
    attn = dense_attention
    if args.attention == "sparse":
        if device.type == "cuda":
            attn = SparseAttention(device)
        else:
            notes.append("--attention sparse needs CUDA (flex_attention kernels): dense attention used instead")
    probe_t = torch.empty(1, 1, 1, 1, device=device, dtype=common.DTYPES[args.dtype])
    backend = "flex_attention (90% block-sparse)" if attn is not dense_attention else attention_backend(probe_t)

    helper = None
    if "auto" in routes and world > 1:
        try:
            if device.type == "cpu":
                helper = common.install_cpu_transport_helper()
                notes.append("CPU: GlooPlanTransport injected for the auto route (timings mean nothing)")
            else:
                from fastvideo.distributed.ulysses.registry import get_default_helper

                helper = get_default_helper()
            if args.engine != "table":
                helper.tuned_table = restrict_engine(helper.tuned_table, args.engine)
                notes.append(f"--engine {args.engine}: the helper plans from TUNED_TABLE's {args.engine} rows only")
        except Exception as exc:  # noqa: BLE001 - reported; auto rows are dropped
            notes.append(f"auto route dropped: helper construction failed: {type(exc).__name__}: {exc}")
            routes = [r for r in routes if r != "auto"]
    variants = [Variant("off", longs[0], infer=True)]
    if "auto" in routes:
        variants += [Variant("auto", lt, infer=i == 0) for i, lt in enumerate(longs)]
    if len(longs) > 1 and "auto" in routes:
        notes.append(f"inference rows only for long={longs[0]}: no-grad operands ignore LONG_TRAINING")

    PROBE = Probe(device)
    model = build_model(args, device, attn)
    runner = Runner(args, model, device, PROBE)
    n_params = sum(p.numel() for p in model.parameters())
    timing_note = ("CPU run over gloo: timings and memory are not measurements" if device.type != "cuda" else None)
    header = common.env_header(device, world, helper, {
        "benchmark": "dit_step", "hidden": args.hidden, "heads": args.heads, "blocks": args.blocks,
        "params": n_params, "attention": backend, "dtype": args.dtype, "offload_activations": args.offload_activations,
        "offload_above": args.offload_above, "engine": args.engine,
        "checkpointing": not args.no_checkpointing, "trials": args.trials, "long_training": longs,
        "op_iters": args.op_iters, "notes": notes, "helper": helper.stats() if helper is not None else None,
        "window_bytes": getattr(helper, "window_bytes", None),
        "a2a_share_method": "1 - t(op replaced by a local slice+repeat of the same shape) / t(NCCL route), "
                            "both in the same rotated trials",
        "ideal_gain_rule": "share x (1 - op_fused / op_nccl), op = isolated per-call medians x the step's calls",
        "measured_gain_rule": "1 - t_fused / t_nccl (step medians)",
        "gain_target": f"measured >= {GAIN_FRACTION} x ideal",
        "memory_rule": "fused peak (+ window when outside torch's allocator) <= NCCL peak + window",
        "grad_threshold_rule": f"{args.grad_factor} x max abs diff of two repeated NCCL-route steps",
        # The estimate beside the wall time (wall_s, at the end) calibrates the next run's planning.
        "estimate_s": round(estimate(world)["total_s"], 1) if device.type == "cuda" else None,
    })
    if rank == 0:
        common.print_header(header)
    bench = Bench(args, rank, world, device, helper, runner, variants, notes)
    rows: list[dict] = []
    shares: list[dict] = []
    op_levels: list[dict] = []
    sparse = attn is not dense_attention

    def dump(final: bool) -> list[dict]:
        found = verdicts(rows, sparse=sparse, timing_not_measured=timing_note)
        if rank == 0:
            header["notes"] = notes
            header["complete"] = final
            header["wall_s"] = round(time.perf_counter() - t_main, 1)
            common.write_json(args.json, header, rows, a2a_share=shares, op_level=op_levels, verdicts=found,
                              failures=bench.failures, plot=plot_info)
        return found

    plot_info: dict = {"path": None, "skipped": "not requested" if not args.plot else "run not finished"}
    for n_tok in tokens:
        if n_tok % world:
            notes.append(f"tokens {n_tok} skipped: not divisible by SP{world}")
            continue
        new_rows, share, ops = bench.run_tokens(n_tok)
        rows += new_rows
        shares.append(share)
        op_levels.append(ops)
        if rank == 0:
            print_share(share)
            print_op_level(ops)
        dump(final=False)  # a run stopped by a time limit still leaves every finished token count

    if args.save:
        from safetensors.torch import save_file

        Path(args.save).mkdir(parents=True, exist_ok=True)
        save_file(bench.saved, str(Path(args.save) / f"dit_rank{rank}.safetensors"))
    if helper is not None:
        header["helper_after"] = helper.stats()
    if rank == 0:
        if args.plot:
            plot_info = write_plot([{"header": header, "rows": rows}], args.plot)
        for note in notes:
            print(f"# note: {note}")
        print_table(rows)
        print_gain_table(rows)
        print_details(rows)
        for failure in bench.failures:
            print(f"# FAILED: {failure}")
        print(f"# plot: {plot_info['path'] or 'skipped: ' + str(plot_info['skipped'])}")
    found = dump(final=True)
    if rank == 0:
        for v in found:
            print(f"# verdict: {v['verdict']:<12} {v['target']}: {v['detail']}")
    common.set_route("off")
    common.shutdown()
    return 1 if bench.failures else 0


# ---------------------------------------------------------------------------------------------- printing


def _f(value, fmt: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, fmt)


def print_share(share: dict) -> None:
    if "infer" not in share:
        print(f"# a2a share at {share['tokens']} tokens: {share.get('note')}", flush=True)
        return
    i, t = share["infer"], share["train"]
    print(f"# a2a share at {share['tokens']} tokens (NCCL route): inference {i['share'] * 100:.1f}% "
          f"({i['nccl_s']:.4f} s vs {i['local_s']:.4f} s local), training {t['share'] * 100:.1f}% "
          f"({t['nccl_s']:.4f} s vs {t['local_s']:.4f} s local)", flush=True)


def print_op_level(ops: dict) -> None:
    parts = []
    for key, per in ops["units_s"].items():
        cells = " ".join(f"{op} " + "/".join(_f(per[op].get(k), ".3f", 1e3) for k in ("nograd", "grad", "fwdbwd"))
                         for op in OPS if op in per)
        parts.append(f"{key}: {cells}")
    print(f"# op level at {ops['tokens']} tokens, ms per call (no-grad/grad fwd/fwd+bwd), the step's shapes: "
          + "; ".join(parts), flush=True)


def print_table(rows: list[dict]) -> None:
    print(f"{'tokens':>7} {'route':>5} {'long':>7} {'kind':>5} {'ran':>8} {'median s':>9} {'min s':>8} {'max s':>8} "
          f"{'retries':>7} {'peak GiB':>8} {'wrong':>6} {'grad diff':>10} {'thresh':>10} {'ok':>3}")
    for r in rows:
        retries = "-" if r["alloc_retries_total"] is None else str(r["alloc_retries_total"])
        wrong = str(r["wrong"]) if "wrong" in r else "-"
        diff = f"{r['grad_max_abs_diff']:10.3g}" if "grad_max_abs_diff" in r else f"{'-':>10}"
        thresh = f"{r['grad_threshold']:10.3g}" if "grad_threshold" in r else f"{'-':>10}"
        ok = ("yes" if r["grad_ok"] else "NO") if "grad_ok" in r else ("yes" if r.get("wrong") == 0 else "NO")
        print(f"{r['tokens']:>7} {r['route']:>5} {r['long_training']:>7} {r['kind']:>5} {r['route_ran'][:8]:>8} "
              f"{r['median_s']:9.4f} {min(r['trial_s']):8.4f} {max(r['trial_s']):8.4f} {retries:>7} "
              f"{_f(r['peak_mem_gib'], '.1f'):>8} {wrong:>6} {diff} {thresh} {ok:>3}")


def print_gain_table(rows: list[dict]) -> None:
    """Auto rows against the NCCL row of the same tokens and kind."""
    nccl = {(r["tokens"], r["kind"]): r for r in rows if r["route"] == "off"}
    auto = [r for r in rows if r["route"] == "auto"]
    if not auto:
        return
    print(f"\n{'tokens':>7} {'long':>7} {'kind':>5} {'share%':>6} {'opN ms':>8} {'opF ms':>8} {'op x':>5} "
          f"{'ideal%':>6} {'meas%':>6} {'%ideal':>6} {'85%':>4} {'inN ms':>8} {'inF ms':>8} {'mem':>4}")
    for r in auto:
        n = nccl.get((r["tokens"], r["kind"]), {})
        ok = {True: "yes", False: "NO", None: "-"}
        mem = r.get("memory") or {}
        print(f"{r['tokens']:>7} {r['long_training']:>7} {r['kind']:>5} {_f(r.get('share'), '6.1f', 100)} "
              f"{_f(n.get('op_step_s'), '8.2f', 1e3)} {_f(r.get('op_step_s'), '8.2f', 1e3)} "
              f"{_f(r.get('op_speedup'), '5.2f')} {_f(r.get('ideal_gain'), '6.2f', 100)} "
              f"{_f(r.get('measured_gain'), '6.2f', 100)} {_f(r.get('gain_fraction'), '6.0f', 100)} "
              f"{ok[r.get('gain_ok')]:>4} {_f((n.get('in_step') or {}).get('op_device_s'), '8.2f', 1e3)} "
              f"{_f((r.get('in_step') or {}).get('op_device_s'), '8.2f', 1e3)} {ok[mem.get('ok')]:>4}")


def print_details(rows: list[dict]) -> None:
    for r in rows:
        if r["route"] != "auto":
            continue
        for text, calls in (r.get("plans") or {}).items():
            print(f"#   plans {row_name(r)}: {text} x{calls}")
        mem = r.get("memory")
        if mem:
            where = "inside" if mem["window_in_peak"] else "outside torch's allocator, added"
            print(f"#   memory {row_name(r)}: fused peak {mem['fused_peak_gib']:.2f} GiB, window "
                  f"{mem['window_bytes']} B ({where}) -> {mem['fused_total_gib']:.2f} GiB "
                  f"{'<=' if mem['ok'] else '>'} NCCL peak {mem['nccl_peak_gib']:.2f} + window = "
                  f"{mem['limit_gib']:.2f} GiB")
        if r.get("gain_ok") is False:
            print(f"#   gain below target, {row_name(r)}: {r['gain_check']}; reason candidates:")
            for text in r.get("reason_candidates", []):
                print(f"#     - {text}")
        elif r.get("gain_check"):
            print(f"#   gain {row_name(r)}: {r['gain_check']}")


if __name__ == "__main__":
    sys.exit(main())
