"""The main job: a sequence-parallel DiT attention block, forward and backward, against its reference.

Launched by ``scripts/run_demo.sh`` (the README's first command) as
``torchrun --standalone --nproc_per_node=N -m fastvideo.entrypoints.sp_attention_demo``. With 2+
GPUs it runs over NCCL (bf16), otherwise over gloo on CPU (float32) on an embedded default
geometry. For each route (``FASTVIDEO_ULYSSES_A2A=off`` and ``auto``) every rank runs the SP block
on its shard and compares the output, the input gradient and the (all-reduced) weight gradients
with the same block run on the whole sequence on one device. Rank 0 prints one table row per
route and check; the exit code is non-zero if any check fails.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

from fastvideo import envs
from fastvideo.distributed import parallel_state
from fastvideo.layers.attention import SPSelfAttention, attention_backend

# Embedded default geometry: small enough for 2 CPU ranks in seconds, every dim divisible by 2..8.
DEFAULTS = {"batch": 2, "seq": 1680, "hidden": 256, "heads": 8}
# Relative max error allowed against the single-device reference: rounding only (reduction order).
TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-10, torch.bfloat16: 3e-2}


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() / max(b.double().abs().max().item(), 1e-30)


def run_route(route: str, args, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """One route: SP block vs reference. Collective. Returns rows (rank 0's view)."""
    sp = parallel_state.get_sp_group()
    p, r = sp.world_size, sp.rank_in_group
    torch.manual_seed(1234)  # same weights and input on every rank
    block = SPSelfAttention(args.hidden, args.heads, dtype=dtype, device=device)
    x = torch.randn(args.batch, args.seq, args.hidden, dtype=dtype, device=device)
    shard = args.seq // p
    x_local = x[:, r * shard : (r + 1) * shard].detach().clone().requires_grad_()
    x_ref = x.detach().clone().requires_grad_()

    with envs.override(FASTVIDEO_ULYSSES_A2A=route):
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier(group=sp.cpu_group)
        start = time.perf_counter()
        y_local = block(x_local)
        y_local.float().square().sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed_ms = (time.perf_counter() - start) * 1e3
        taken = "nccl"
        if route == "auto":
            from fastvideo.distributed.ulysses.helper import get_default_helper

            helper = get_default_helper()
            last = [rec for rec in helper.history][-4:]
            routes = sorted({rec.route for rec in last})
            reasons = sorted({rec.reason.label for rec in last if rec.reason is not None})
            taken = "+".join(routes) + (f" ({', '.join(reasons)})" if reasons else "")
    sp_grads = {n: prm.grad.detach().clone() for n, prm in block.named_parameters()}
    for g in sp_grads.values():
        dist.all_reduce(g, group=sp.device_group)  # each rank's weight grad covers its shard only
    block.zero_grad()
    y_ref = block.forward_reference(x_ref)
    y_ref.float().square().sum().backward()

    checks = {
        "output": (y_local, y_ref[:, r * shard : (r + 1) * shard]),
        "grad input": (x_local.grad, x_ref.grad[:, r * shard : (r + 1) * shard]),
        "grad weights": (
            torch.cat([g.flatten() for g in sp_grads.values()]),
            torch.cat([prm.grad.flatten() for prm in block.parameters()]),
        ),
    }
    errs = torch.tensor([_rel_err(a, b) for a, b in checks.values()], dtype=torch.float64)
    dist.all_reduce(errs, op=dist.ReduceOp.MAX, group=sp.cpu_group)
    t = torch.tensor([elapsed_ms], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=sp.cpu_group)
    shapes = (
        f"x[{args.batch},{shard},{args.hidden}] qkv[{3 * args.batch},{shard},{args.heads},{args.hidden // args.heads}]"
    )
    return [
        {
            "route": f"{route}->{taken}",
            "check": name,
            "shapes": shapes,
            "ms": t.item(),
            "err": err,
            "ok": err <= TOLERANCE[dtype],
        }
        for name, err in zip(checks, errs.tolist())
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for key, value in DEFAULTS.items():
        parser.add_argument(f"--{key}", type=int, default=value)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    args = parser.parse_args(argv)

    world = int(os.environ.get("WORLD_SIZE", "1"))
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.device_count() >= max(world, 2))
    if use_cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device, dtype, backend = torch.device("cuda", local), torch.bfloat16, "nccl"
    else:
        device, dtype, backend = torch.device("cpu"), torch.float32, "gloo"
    timeout = datetime.timedelta(seconds=120)
    dist.init_process_group(backend, timeout=timeout)
    world, rank = dist.get_world_size(), dist.get_rank()
    for name, dim in (("seq", args.seq), ("heads", args.heads)):
        if dim % world:
            if rank == 0:
                print(f"error: --{name}={dim} must be divisible by the SP size {world}", file=sys.stderr)
            dist.destroy_process_group()
            return 2
    parallel_state.initialize_sequence_parallel(world, timeout=timeout)
    rows: list[dict] = []
    try:
        for route in ("off", "auto"):
            rows += run_route(route, args, device, dtype)
    finally:
        parallel_state.destroy_sequence_parallel()
    ok = all(row["ok"] for row in rows)
    if rank == 0:
        print(
            f"SP attention block: {world} ranks over {backend} on {device.type}, {dtype}, "
            f"attention {attention_backend(torch.empty(1, dtype=dtype, device=device))}, tolerance {TOLERANCE[dtype]:g}"
        )
        print(f"{'route':34s} {'check':13s} {'shapes (per rank)':36s} {'time ms':>9s} {'max rel err':>12s}  result")
        for row in rows:
            print(
                f"{row['route']:34s} {row['check']:13s} {row['shapes']:36s} {row['ms']:9.1f} {row['err']:12.3e}  "
                f"{'OK' if row['ok'] else 'FAIL'}"
            )
        print("OK" if ok else "FAIL")
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
