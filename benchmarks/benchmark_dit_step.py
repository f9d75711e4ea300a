"""Full DiT step benchmark: sequence-parallel (Ulysses) blocks under FSDP2, NCCL route vs fused route.

Launch (one process per GPU; the SP group and the FSDP mesh both span all ranks):

    torchrun --standalone --nproc_per_node=2 benchmarks/benchmark_dit_step.py --json dit.json
    torchrun --standalone --nproc_per_node=2 benchmarks/benchmark_dit_step.py --offload-activations   # adds 250k
    torchrun --standalone --nproc_per_node=2 benchmarks/benchmark_dit_step.py --attention sparse --tokens 128k
    torchrun --standalone --nproc_per_node=1 benchmarks/benchmark_dit_step.py --tokens 32k --blocks 2  # SP1
    torchrun --standalone --nproc_per_node=2 benchmarks/benchmark_dit_step.py --device cpu --hidden 64 --heads 4 \\
        --blocks 2 --tokens 256                                                                      # CPU smoke

The model: ``--blocks`` DiT blocks (LayerNorm -> QKV -> Ulysses all-to-all (packed QKV, mode 0) ->
attention on the local heads -> all-to-all back (mode 1) -> proj, residual; LayerNorm -> 4x GELU MLP,
residual), hidden 7168 = 56 heads x 128 by default. Every block and the root are ``fully_shard``-ed
(FSDP2) over the same ranks, with explicit forward/backward prefetch of the neighbouring block; fp32
master weights, bf16 compute (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``); full
activation checkpointing of every block; AdamW resident on the device with LR = weight decay = 0 so
the weights stay bit-identical across routes and trials. ``--offload-activations`` saves the
checkpointed block inputs to pinned host memory (``torch.autograd.graph.save_on_cpu``).

Attention: ``dense`` uses flash-attn when installed (bf16, CUDA), SDPA otherwise; ``sparse`` is
``flex_attention`` with a block mask keeping every 10th 128-token key block for each query block (90%
block sparsity); on CPU ``sparse`` falls back to dense with a note.

Measurements, per ``--tokens`` value (global sequence; ``Nk`` = N x 1024):

* First, the all-to-all's share of the step on the NCCL route: the same step with the op replaced by
  a local, communication-free reshape of the same shape (slice + repeat: one read and one write of
  the operand, like the permutes), share = 1 - t_local / t_nccl, for inference and training.
* Then ``--trials`` (>= 3) rotated trials: trial t runs the routes in order rotated by t; each route
  runs a no-grad inference forward and a full training step (forward, backward, clip_grad_norm_,
  optimizer step). Each is timed as rank-max host wall time (barrier, perf_counter, device sync);
  rows report the median (and every trial), and ``torch.cuda.memory_stats()['num_alloc_retries']``
  deltas per trial (rank-max; ``-`` on CPU).
* Correctness in the same run (one more untimed inference and training step per route after the
  trials, so copying gradients to the host is never timed): the fused route's inference output must
  be bit-identical to the NCCL route's (``wrong`` = differing elements, summed over ranks).
  Gradients (local FSDP shards, before clipping) are compared by max abs difference against a
  threshold calibrated from two repeated NCCL-route steps: threshold = ``--grad-factor`` x (max abs
  diff between the two NCCL runs); when the NCCL route is deterministic that is 0 and gradients must
  match exactly.

Columns: ``tokens``, ``route``, ``kind`` (infer/train), ``ran`` (fused/nccl calls of the helper during
the route's timed trials; ``-`` for off), ``long`` (``FASTVIDEO_ULYSSES_A2A_LONG_TRAINING``),
``median s``, ``min s``/``max s`` over trials, ``retries`` (alloc-retry deltas summed over trials),
``peak GiB`` (``torch.cuda.max_memory_allocated`` over the trials, rank-max), ``wrong`` (inference),
``grad diff``/``thresh``/``ok`` (training). The process exits 1 when any
check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
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


# ---------------------------------------------------------------------------------------------- the all-to-all


def local_a2a(x: torch.Tensor, scatter_dim: int = 2, gather_dim: int = 1) -> torch.Tensor:
    """Communication-free stand-in with the op's output shape and about its memory traffic."""
    p = get_sp_group().world_size
    if p == 1:
        return x
    if (scatter_dim, gather_dim) == (2, 1):
        return x[:, :, : x.shape[2] // p].repeat(1, p, 1, 1)
    return x[:, : x.shape[1] // p].repeat(1, 1, p, 1)


A2A = {"fn": sequence_model_parallel_all_to_all_4D}  # swapped for ``local_a2a`` when measuring the share


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
        qkv = A2A["fn"](qkv, 2, 1)  # [3B, S, H/P, D]
        q, k, v = qkv.split(b, dim=0)
        out = A2A["fn"](self.attn(q, k, v).contiguous(), 1, 2)  # [B, S/P, H, D]
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
    def __init__(self, args, model: DiT, device: torch.device) -> None:
        self.args, self.model, self.device = args, model, device
        # LR and weight decay 0: the step runs in full, and the weights stay bit-identical.
        self.opt = torch.optim.AdamW(model.parameters(), lr=0.0, weight_decay=0.0)
        self.params = [(n, p) for n, p in model.named_parameters()]

    def offload(self):
        if self.args.offload_activations:
            return torch.autograd.graph.save_on_cpu(pin_memory=self.device.type == "cuda")
        return contextlib.nullcontext()

    def infer(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.model(x)

    def train(self, x: torch.Tensor, capture: bool = False) -> list[torch.Tensor] | None:
        self.opt.zero_grad(set_to_none=True)
        with self.offload():
            out = self.model(x)
        out.float().pow(2).mean().backward()
        grads = None
        if capture:
            grads = [p.grad.to_local().detach().float().cpu() for _, p in self.params]
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.args.clip)
        self.opt.step()
        return grads


def timed(fn, device: torch.device) -> tuple[float, object]:
    common.barrier()
    common.synchronize(device)
    start = time.perf_counter()
    result = fn()
    common.synchronize(device)
    return common.rank_max([time.perf_counter() - start])[0], result


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


def parse_tokens(text: str) -> list[int]:
    out = []
    for item in text.split(","):
        item = item.strip().lower()
        out.append(int(item[:-1]) * 1024 if item.endswith("k") else int(item))
    return out


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
    p.add_argument("--routes", default="off,auto")
    p.add_argument("--trials", type=int, default=3, help="rotated trials per route (>= 3 for a median)")
    p.add_argument("--attention", choices=("dense", "sparse"), default="dense")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16", help="compute dtype (masters are fp32)")
    p.add_argument("--offload-activations", action="store_true")
    p.add_argument("--no-checkpointing", action="store_true", help="disable full activation checkpointing")
    p.add_argument("--long-training", choices=("auto", "chunked"), default=None,
                   help="sets FASTVIDEO_ULYSSES_A2A_LONG_TRAINING (default: leave the environment's value)")
    p.add_argument("--grad-factor", type=float, default=4.0,
                   help="gradient threshold = factor x max abs diff of two repeated NCCL-route steps")
    p.add_argument("--clip", type=float, default=1.0, help="clip_grad_norm_ max norm")
    p.add_argument("--skip-share", action="store_true", help="skip the all-to-all share measurement")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json")
    p.add_argument("--save", help="directory: per-rank safetensors of inference outputs and gradients")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.long_training:
        os.environ["FASTVIDEO_ULYSSES_A2A_LONG_TRAINING"] = args.long_training
    rank, world, device = common.init_distributed(args.device)
    if args.hidden % args.heads or args.heads % world:
        raise SystemExit(f"--hidden {args.hidden} / --heads {args.heads}: heads must divide hidden and SP{world} "
                         "must divide heads")
    routes = [r.strip() for r in args.routes.split(",")]
    tokens = parse_tokens(args.tokens) if args.tokens else [32768, 65536, 131072] + (
        [250000] if args.offload_activations else [])
    notes = []
    attn = dense_attention
    if args.attention == "sparse":
        if device.type == "cuda":
            attn = SparseAttention(device)
        else:
            notes.append("--attention sparse needs CUDA (flex_attention kernels): dense attention used instead")
    probe = torch.empty(1, 1, 1, 1, device=device, dtype=common.DTYPES[args.dtype])
    backend = "flex_attention (90% block-sparse)" if attn is not dense_attention else attention_backend(probe)

    helper = None
    if "auto" in routes and world > 1:
        try:
            if device.type == "cpu":
                helper = common.install_cpu_transport_helper()
                notes.append("CPU: GlooPlanTransport injected for the auto route (timings mean nothing)")
            else:
                from fastvideo.distributed.ulysses.helper import get_default_helper

                helper = get_default_helper()
        except Exception as exc:  # noqa: BLE001 - reported; auto rows are dropped
            notes.append(f"auto route dropped: helper construction failed: {type(exc).__name__}: {exc}")
            routes = [r for r in routes if r != "auto"]

    model = build_model(args, device, attn)
    runner = Runner(args, model, device)
    n_params = sum(p.numel() for p in model.parameters())
    from fastvideo import envs

    long_training = envs.get("FASTVIDEO_ULYSSES_A2A_LONG_TRAINING")
    header = common.env_header(device, world, helper, {
        "benchmark": "dit_step", "hidden": args.hidden, "heads": args.heads, "blocks": args.blocks,
        "params": n_params, "attention": backend, "dtype": args.dtype, "offload_activations": args.offload_activations,
        "checkpointing": not args.no_checkpointing, "trials": args.trials, "long_training": long_training,
        "notes": notes, "helper": helper.stats() if helper is not None else None,
        "a2a_share_method": "1 - t(op replaced by a local slice+repeat of the same shape) / t(NCCL route)",
        "grad_threshold_rule": f"{args.grad_factor} x max abs diff of two repeated NCCL-route steps",
    })
    if rank == 0:
        common.print_header(header)
    rows, shares, failures = [], [], []
    saved: dict[str, torch.Tensor] = {}
    for n_tok in tokens:
        if n_tok % world:
            notes.append(f"tokens {n_tok} skipped: not divisible by SP{world}")
            continue
        gen = torch.Generator(device=device).manual_seed(args.seed + rank)
        x = torch.randn(1, n_tok // world, args.hidden, generator=gen, device=device)

        # Warm-up every route (and compile flex_attention) before anything is timed.
        for route in routes:
            common.set_route(route)
            runner.infer(x)
            runner.train(x)

        # The all-to-all's share of the step on the NCCL route.
        common.set_route("off")
        share = {"tokens": n_tok}
        if not args.skip_share and world > 1:
            for kind, fn in (("infer", lambda x=x: runner.infer(x)), ("train", lambda x=x: runner.train(x))):
                t_nccl, t_local = [], []
                for _ in range(args.trials):
                    t_nccl.append(timed(fn, device)[0])
                    A2A["fn"] = local_a2a
                    try:
                        t_local.append(timed(fn, device)[0])
                    finally:
                        A2A["fn"] = sequence_model_parallel_all_to_all_4D
                nccl_s, local_s = statistics.median(t_nccl), statistics.median(t_local)
                share[kind] = {"nccl_s": nccl_s, "local_s": local_s, "share": 1 - local_s / nccl_s}
            shares.append(share)
            if rank == 0:
                print(f"# a2a share at {n_tok} tokens (NCCL route): inference {share['infer']['share'] * 100:.1f}% "
                      f"({share['infer']['nccl_s']:.4f} s vs {share['infer']['local_s']:.4f} s local), training "
                      f"{share['train']['share'] * 100:.1f}% ({share['train']['nccl_s']:.4f} s vs "
                      f"{share['train']['local_s']:.4f} s local)", flush=True)
        elif world == 1:
            share["note"] = "SP1: the op returns its input, so the all-to-all's share is 0"
            shares.append(share)

        # Gradient threshold from two repeated NCCL-route steps.
        ref_grads = runner.train(x, capture=True)
        calib = max_abs_diff(ref_grads, runner.train(x, capture=True))
        threshold = args.grad_factor * calib
        ref_out = runner.infer(x)

        # Rotated trials.
        results = {(route, kind): {"times": [], "retries": [], "peak": []}
                   for route in routes for kind in ("infer", "train")}
        outputs, grads, ran = {}, {}, {}
        for trial in range(args.trials):
            order = routes[trial % len(routes):] + routes[: trial % len(routes)]
            for route in order:
                common.set_route(route)
                for kind in ("infer", "train"):
                    before = helper.stats() if helper is not None and route == "auto" else None
                    if device.type == "cuda":
                        torch.cuda.reset_peak_memory_stats(device)
                    r0 = alloc_retries(device)
                    if kind == "infer":
                        def fn(x=x):
                            return runner.infer(x)
                    else:
                        def fn(x=x):
                            return runner.train(x)
                    seconds, _ = timed(fn, device)
                    r1 = alloc_retries(device)
                    if device.type == "cuda":
                        peak = common.rank_max([torch.cuda.max_memory_allocated(device) / 2**30])[0]
                        results[(route, kind)]["peak"].append(peak)
                    results[(route, kind)]["times"].append(seconds)
                    results[(route, kind)]["retries"].append(
                        int(common.rank_max([r1 - r0])[0]) if r0 is not None else None)
                    if before is not None:
                        add_calls(ran, (route, kind), before, helper.stats())
        # The outputs and gradients compared: one more (untimed) inference and step per route, so
        # copying gradients to the host never lands in a timed trial. LR 0: same weights as every trial.
        for route in routes:
            common.set_route(route)
            outputs[route] = runner.infer(x)
            grads[route] = runner.train(x, capture=True)
        for route in routes:
            for kind in ("infer", "train"):
                info = ran.get((route, kind))
                if route == "off" or info is None:
                    ran_text = "nccl" if world > 1 else "identity (SP1)"
                else:
                    ran_text = "fused" if info["fused"] == info["calls"] else "nccl" if not info["fused"] else "mixed"
                res = results[(route, kind)]
                retries = [r for r in res["retries"] if r is not None]
                row = {"tokens": n_tok, "route": route, "kind": kind, "long_training": long_training,
                       "route_ran": ran_text, "helper_calls": info, "median_s": statistics.median(res["times"]),
                       "trial_s": res["times"], "alloc_retries": res["retries"],
                       "alloc_retries_total": sum(retries) if retries else None,
                       "peak_mem_gib": max(res["peak"]) if res["peak"] else None}
                if kind == "infer":
                    row["wrong"] = common.rank_sum(common.count_bitwise_diff(outputs[route], ref_out))
                    if row["wrong"]:
                        failures.append(f"{n_tok} {route} inference: {row['wrong']} elements differ from NCCL")
                else:
                    diff = max_abs_diff(grads[route], ref_grads)
                    row.update(grad_max_abs_diff=diff, grad_threshold=threshold, grad_calibration=calib,
                               grad_ok=diff <= threshold)
                    if not row["grad_ok"]:
                        failures.append(f"{n_tok} {route} gradients: max abs diff {diff:g} > threshold {threshold:g}")
                rows.append(row)
            if args.save:
                saved[f"{n_tok}/{route}/out"] = outputs[route].detach().float().cpu().contiguous()
                for (name, _), g in zip(runner.params, grads[route]):
                    saved[f"{n_tok}/{route}/grad/{name}"] = g.contiguous()
        del x, outputs, grads, ref_grads, ref_out
        if device.type == "cuda":
            torch.cuda.empty_cache()

    if args.save:
        from safetensors.torch import save_file

        Path(args.save).mkdir(parents=True, exist_ok=True)
        save_file(saved, str(Path(args.save) / f"dit_rank{rank}.safetensors"))
    header["notes"] = notes
    if helper is not None:
        header["helper_after"] = helper.stats()
    if rank == 0:
        for note in notes:
            print(f"# note: {note}")
        print_table(rows)
        for failure in failures:
            print(f"# FAILED: {failure}")
        common.write_json(args.json, header, rows, a2a_share=shares, failures=failures)
    common.set_route("off")
    common.shutdown()
    return 1 if failures else 0


def print_table(rows: list[dict]) -> None:
    print(f"{'tokens':>7} {'route':>5} {'kind':>5} {'ran':>8} {'long':>7} {'median s':>9} {'min s':>8} {'max s':>8} "
          f"{'retries':>7} {'peak GiB':>8} {'wrong':>6} {'grad diff':>10} {'thresh':>10} {'ok':>3}")
    for r in rows:
        retries = "-" if r["alloc_retries_total"] is None else str(r["alloc_retries_total"])
        peak = "-" if r["peak_mem_gib"] is None else f"{r['peak_mem_gib']:.1f}"
        wrong = str(r["wrong"]) if "wrong" in r else "-"
        diff = f"{r['grad_max_abs_diff']:10.3g}" if "grad_max_abs_diff" in r else f"{'-':>10}"
        thresh = f"{r['grad_threshold']:10.3g}" if "grad_threshold" in r else f"{'-':>10}"
        ok = ("yes" if r["grad_ok"] else "NO") if "grad_ok" in r else ("yes" if r.get("wrong") == 0 else "NO")
        print(f"{r['tokens']:>7} {r['route']:>5} {r['kind']:>5} {r['route_ran'][:8]:>8} {r['long_training']:>7} "
              f"{r['median_s']:9.4f} {min(r['trial_s']):8.4f} {max(r['trial_s']):8.4f} {retries:>7} {peak:>8} "
              f"{wrong:>6} {diff} {thresh} {ok:>3}")


if __name__ == "__main__":
    sys.exit(main())
