"""The SP attention block check: a sequence-parallel DiT attention block, forward and backward, against its reference.

Launched by ``scripts/run_sp_attention_check.sh`` (the correctness command beside the README's main job) as
``torchrun --standalone --nproc_per_node=N -m sp_recipes.sp_attention_demo`` (``examples/`` on ``PYTHONPATH``).
With 2+ GPUs it runs over NCCL (bf16), otherwise over gloo on CPU (float32) on an embedded default
geometry. For each route (``FASTVIDEO_ULYSSES_A2A=off`` and ``auto``) every rank runs the SP block
on its shard: ``--warmup`` untimed iterations first (under ``auto`` the first one builds the Ulysses
helper, collectively), then ``--iters`` timed ones. An iteration is one forward + backward of the
block (its four all-to-alls, attention and projections), timed from a barrier to the end of
backward (device synchronised) on the slowest rank. The last iteration's output, input gradient and
(all-reduced) weight gradients are compared with the same block run on the whole sequence on one
device. Rank 0 prints one table row per route (median and spread of the timed iterations, the max
relative error of each check); the exit code is non-zero if any check fails.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from fastvideo.attention.dense import attention_backend
from fastvideo.distributed import parallel_state
from sp_recipes.attention_block import SPSelfAttention

# Embedded default geometry: small enough for 2 CPU ranks in seconds, every dim divisible by 2..8.
DEFAULTS = {"batch": 2, "seq": 1680, "hidden": 256, "heads": 8}
# Relative max error allowed against the single-device reference: rounding only (reduction order).
TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-10, torch.bfloat16: 3e-2}
CHECKS = ("output", "grad input", "grad weights")


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() / max(b.double().abs().max().item(), 1e-30)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _route_taken(route: str, first_seq: int, world_size: int) -> str:
    """The route(s) the timed iterations' all-to-alls took, from the helper's call records."""
    if world_size == 1:
        return "identity (SP1)"  # the op returns its input: no route, no helper
    if route == "off":
        return "nccl"
    from fastvideo.distributed.ulysses.registry import get_default_helper

    records = [rec for rec in get_default_helper().history if rec.seq >= first_seq]
    routes = sorted({rec.route for rec in records})
    reasons = sorted({rec.reason.label for rec in records if rec.reason is not None})
    return "+".join(routes) + (f" ({', '.join(reasons)})" if reasons else "")


def run_route(route: str, args, device: torch.device, dtype: torch.dtype) -> dict:
    """One route: warm-up, timed iterations, then the last iteration against the reference. Collective."""
    sp = parallel_state.get_sp_group()
    p, r = sp.world_size, sp.rank_in_group
    torch.manual_seed(1234)  # same weights and input on every rank
    block = SPSelfAttention(args.hidden, args.heads, dtype=dtype, device=device)
    x = torch.randn(args.batch, args.seq, args.hidden, dtype=dtype, device=device)
    shard = args.seq // p
    x_local = x[:, r * shard : (r + 1) * shard].detach().clone().requires_grad_()

    def step() -> torch.Tensor:
        block.zero_grad(set_to_none=True)  # every iteration starts from no gradients
        x_local.grad = None
        y = block(x_local)
        y.float().square().sum().backward()
        return y

    times_ms: list[float] = []
    with parallel_state.override_ulysses_settings(FASTVIDEO_ULYSSES_A2A=route):
        for _ in range(args.warmup):
            step()
        first_seq = 0
        if route == "auto" and p > 1:
            from fastvideo.distributed.ulysses.registry import get_default_helper

            history = get_default_helper().history  # built by the warm-up (or by the first timed call)
            first_seq = history[-1].seq + 1 if history else 0
        for _ in range(args.iters):
            _sync(device)
            dist.barrier(group=sp.cpu_group)
            start = time.perf_counter()
            y_local = step()
            _sync(device)
            times_ms.append((time.perf_counter() - start) * 1e3)
        taken = _route_taken(route, first_seq, p)
    sp_grads = {n: prm.grad.detach().clone() for n, prm in block.named_parameters()}
    for g in sp_grads.values():
        dist.all_reduce(g, group=sp.device_group)  # each rank's weight grad covers its shard only
    block.zero_grad()
    x_ref = x.detach().clone().requires_grad_()
    y_ref = block.forward_reference(x_ref)
    y_ref.float().square().sum().backward()

    pairs = (
        (y_local, y_ref[:, r * shard : (r + 1) * shard]),
        (x_local.grad, x_ref.grad[:, r * shard : (r + 1) * shard]),
        (
            torch.cat([g.flatten() for g in sp_grads.values()]),
            torch.cat([prm.grad.flatten() for prm in block.parameters()]),
        ),
    )
    errs = torch.tensor([_rel_err(a, b) for a, b in pairs], dtype=torch.float64)
    dist.all_reduce(errs, op=dist.ReduceOp.MAX, group=sp.cpu_group)
    t = torch.tensor(times_ms, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=sp.cpu_group)  # an iteration lasts as long as its slowest rank
    return {
        "route": f"{route}->{taken}",
        "shapes": f"x[{args.batch},{shard},{args.hidden}] qkv[{3 * args.batch},{shard},{args.heads},"
        f"{args.hidden // args.heads}]",
        "median": statistics.median(t.tolist()),
        "min": t.min().item(),
        "max": t.max().item(),
        "errs": dict(zip(CHECKS, errs.tolist())),
        "ok": bool((errs <= TOLERANCE[dtype]).all()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for key, value in DEFAULTS.items():
        parser.add_argument(f"--{key}", type=int, default=value)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--warmup", type=int, default=3, help="untimed iterations per route first (>= 1)")
    parser.add_argument("--iters", type=int, default=10, help="timed iterations per route (>= 1)")
    args = parser.parse_args(argv)
    for name in ("warmup", "iters"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}={getattr(args, name)}: must be >= 1 (--warmup 1 builds the helper before timing)")

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
            rows.append(run_route(route, args, device, dtype))
    finally:
        parallel_state.destroy_sequence_parallel()
    ok = all(row["ok"] for row in rows)
    if rank == 0:
        print(
            f"SP attention block: {world} ranks over {backend} on {device.type}, {dtype}, "
            f"attention {attention_backend(torch.empty(1, dtype=dtype, device=device))}, tolerance {TOLERANCE[dtype]:g}"
        )
        print(
            f"time: forward + backward of the block (4 all-to-alls, attention, projections) on the slowest rank; "
            f"median and min-max of {args.iters} iterations after {args.warmup} untimed warm-up iteration(s) "
            "(under auto the first builds the helper)"
        )
        print(
            f"{'route':34s} {'shapes (per rank)':36s} {'median ms':>9s} {'min-max ms':>15s} "
            f"{'err output':>10s} {'err dx':>9s} {'err dW':>9s}  result"
        )
        for row in rows:
            spread = f"{row['min']:.1f}-{row['max']:.1f}"
            errs = row["errs"]
            print(
                f"{row['route']:34s} {row['shapes']:36s} {row['median']:9.1f} {spread:>15s} "
                f"{errs['output']:10.2e} {errs['grad input']:9.2e} {errs['grad weights']:9.2e}  "
                f"{'OK' if row['ok'] else 'FAIL'}"
            )
        print("OK" if ok else "FAIL")
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
