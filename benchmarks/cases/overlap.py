"""The synchronous ``DistributedAttention`` against the pipelined one (``overlap_chunks=N``): exposed exchange time.

Per geometry (a preset's global sequence and heads; the attention's batch is the preset's planes / 3 where they
are a packed q/k/v, else 1), route and head-group count N (``--groups``; 1 is the synchronous layer), the block's
step (``--direction fwd``: a no-grad forward; ``fwd_bwd``: forward and backward) is timed twice: with the real
exchanges and with a communication-free stand-in that copies the output's bytes (the same pipeline, nothing
moved between ranks). ``exposed_ms`` = step - stand-in: the exchange time the compute stream still sees;
``hidden`` = 1 - exposed / the synchronous layer's exposed time on the same route. ``wrong``: the pipelined
layer's output against the synchronous layer's, bit for bit; ``grad_max_abs_diff`` (``fwd_bwd``) its input
gradients' largest difference.

Routes: ``off`` (the NCCL route, on the communication stream when pipelined) and ``auto`` (fused where every rank
agrees; ``--engine sm|ce`` plans from that engine's tuned rows only). At SP 1 nothing is exchanged: the rows are a
smoke test of the pipeline (capture, streams, exactness), no speed claim. On CPU a dry run over gloo.
"""

from __future__ import annotations

import argparse
from typing import ClassVar

import torch

from benchmarks.harness import oracle, process, product, report, timing
from benchmarks.harness.case import Case, Context

DIRECTIONS = ("fwd", "fwd_bwd")


class _Done:
    """A stand-in's handle: the output already there."""

    def __init__(self, out: torch.Tensor) -> None:
        self.out = out

    def wait(self) -> torch.Tensor:
        return self.out


def stand_in(x: torch.Tensor, scatter_dim: int, gather_dim: int, name: str, *, async_op: bool = False,
             seq_splits=None, head_splits=None, tag=None):
    """The exchange's output shape, filled by one copy of its bytes from ``x``: its memory traffic, no
    communication. Differentiable (autograd sees a copy)."""
    from fastvideo.distributed.all_to_all import Splits
    from fastvideo.distributed.communication_op import mode_for_dims, output_shape
    from fastvideo.distributed.parallel_state import get_sp_group

    sp = get_sp_group()
    if sp.world_size == 1:
        out = x
    else:
        mode = mode_for_dims(scatter_dim, gather_dim)
        splits = Splits(None if seq_splits is None else tuple(seq_splits),
                        None if head_splits is None else tuple(head_splits))
        shape = output_shape(x.shape, mode, sp.world_size, rank=sp.rank_in_group, splits=splits)
        n = 1
        for s in shape:
            n *= s
        flat = x.reshape(-1)
        if not flat.numel():  # a rank with none of this group's rows or heads: zeros, still on autograd's graph
            flat = torch.cat([flat, flat.new_zeros(1)])
        while flat.numel() < n:
            flat = torch.cat([flat, flat])
        out = flat[:n].view(shape).clone()
    return _Done(out) if async_op else out


def derive_group_rows(table: tuple, heads: list[int], groups: list[int]) -> tuple:
    """``table`` plus, for every layer head count in ``heads`` and group count in ``groups``, a copy of each of its
    rows keyed by the groups' head counts (where no row has that key already). Pure."""
    from dataclasses import replace

    from fastvideo.distributed.ulysses.overlap_plan import head_groups

    keys = {row.key for row in table}
    extra = []
    for h in heads:
        for n in groups:
            if n < 2 or n > h:
                continue
            for hg in sorted(set(head_groups(h, n))):
                for row in table:
                    if row.heads == h and (row.gpu, row.world_size, row.dtype, hg, row.head_dim) not in keys:
                        extra.append(replace(row, heads=hg, source=f"derived from the H={h} row for head groups "
                                                                   "(overlap case; not measured)"))
            keys |= {r.key for r in extra}
    return (*table, *extra)


class OverlapCase(Case):
    name = "overlap"
    summary = "synchronous vs head-group pipelined DistributedAttention: step and exposed exchange time"
    key = ("geometry", "route", "direction", "groups")
    metric = "step_ms"
    defaults: ClassVar[dict] = {"iters": 10, "warmup": 3}
    quick: ClassVar[dict] = {"iters": 2, "warmup": 1}
    columns = (
        report.Column("geometry", "geometry", width=10),
        report.Column("route", "route", width=6),
        report.Column("direction", "dir", width=7),
        report.Column("groups", "N", fmt="d"),
        report.Column("step_ms", "step ms"),
        report.Column("stand_in_ms", "stand-in ms"),
        report.Column("exposed_ms", "exposed ms"),
        report.Column("hidden", "hidden %", fmt=".1f", scale=100),
    )

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        g = parser.add_argument_group("overlap")
        g.add_argument("--groups", default="1,2,4,8", help="comma list of head-group counts (1: the synchronous "
                       "layer, always run first; counts above the heads are skipped)")
        g.add_argument("--direction", default="fwd,fwd_bwd", help=f"comma list of {', '.join(DIRECTIONS)}")
        g.add_argument("--routes", default=None,
                       help="comma list of off, auto (default: both; at SP 1 the first alone, with a note); at SP 1 "
                            "a second route named here fails the run: nothing is exchanged, one route stands for all")
        g.add_argument("--engine", choices=("table", "sm", "ce"), default="table",
                       help="auto route: plan from TUNED_TABLE as it is, or from its rows of one engine")
        g.add_argument("--group-rows", choices=("none", "derive"), default="none",
                       help="derive: give each head group's exchanges (H/N heads) the tuned rows of the layer's full "
                            "head count (a measurement aid: TUNED_TABLE has rows for whole layers only, so groups "
                            "otherwise plan the original SM kind); none: the table as it is")

    def run(self, ctx: Context) -> None:
        args, device, world = ctx.args, ctx.device, ctx.world
        groups = sorted({int(v) for v in args.groups.split(",")} | {1})
        directions = [d.strip() for d in args.direction.split(",")]
        routes = [r.strip() for r in (args.routes or "off,auto").split(",")]
        for d in directions:
            if d not in DIRECTIONS:
                raise SystemExit(f"--direction {d!r}: choose from {', '.join(DIRECTIONS)}")
        if world == 1:
            ctx.note("SP 1: nothing is exchanged; the rows smoke-test the pipeline (no speed claim)")
            for route in routes[1:]:
                ctx.unavailable(f"--routes {route}", f"SP 1 exchanges nothing: the {routes[0]} rows stand for every "
                                "route", named=args.routes is not None)
            routes = routes[:1]
        if device.type != "cuda":
            ctx.note("CPU: a dry run over gloo (timings mean nothing)")
        if "auto" in routes and world > 1:
            helper = product.default_helper(device)
            if args.engine != "table":
                from benchmarks.dit.runner import restrict_engine

                helper.tuned_table = restrict_engine(helper.tuned_table, args.engine)
                ctx.note(f"--engine {args.engine}: the helper plans from TUNED_TABLE's {args.engine} rows only")
            if args.group_rows == "derive":
                heads_seen = sorted({g[1][2] for g in ctx.geometries()})
                helper.tuned_table = derive_group_rows(helper.tuned_table, heads_seen, groups)
                ctx.note("--group-rows derive: head groups plan from their layer's tuned rows (derived, not measured)")
        ctx.header.update(groups=groups, directions=directions, routes=routes, engine=args.engine,
                          group_rows=args.group_rows)
        for label, (planes, seq, heads, head_dim) in ctx.geometries():
            b = planes // 3 if planes % 3 == 0 else 1
            if seq % world:
                ctx.skip(f"SP{world} does not divide the sequence {seq}", geometry=label)
                continue
            shape = (b, seq // world, heads, head_dim)
            q, k, v = (oracle.make_input(shape, ctx.dtype, device, args.seed + i + 7 * ctx.rank) for i in range(3))
            for route in routes:
                if world > 1:
                    process.set_route(route)
                for direction in directions:
                    self._rows(ctx, label, route, direction, groups, q, k, v, heads, head_dim)

    def _rows(self, ctx: Context, label: str, route: str, direction: str, groups: list[int], q, k, v, heads: int,
              head_dim: int) -> None:
        from fastvideo.attention.layer import DistributedAttention
        from fastvideo.distributed.communication_op import sequence_model_parallel_all_to_all_4D

        def public(x, sd, gd, name, **kw):
            return sequence_model_parallel_all_to_all_4D(x, sd, gd, **kw)

        args, device = ctx.args, ctx.device
        grad = direction == "fwd_bwd"
        ins = [t.detach().requires_grad_(grad) for t in (q, k, v)]
        gy = oracle.make_input(q.shape, q.dtype, device, args.seed + 99)
        reference = None
        sync_exposed = None
        for n in groups:
            key = {"geometry": label, "route": route, "direction": direction, "groups": n}
            if n > heads:
                ctx.skip(f"{n} groups > {heads} heads", **key)
                continue
            layers = {which: DistributedAttention(heads, head_dim, overlap_chunks=0 if n == 1 else n, prefix="ovl",
                                                  all_to_all=fn) for which, fn in (("real", public),
                                                                                    ("stand_in", stand_in))}
            for layer in layers.values():
                layer.deterministic = True  # flash-attn's deterministic backward, where it runs

            def step(layer, ins=ins):
                if not grad:
                    with torch.no_grad():
                        return [layer(*ins)[0]]
                out = layer(*ins)[0]
                return [out, *torch.autograd.grad(out, ins, gy)]

            results = step(layers["real"])
            timing.synchronize(device)
            if reference is None:
                reference = results
            wrong = oracle.count_bitwise_diff(results[0], reference[0])
            grad_diff = max((float((a.float() - b_.float()).abs().max()) for a, b_ in
                             zip(results[1:], reference[1:], strict=True)), default=None)
            times = {which: timing.device_times(lambda layer=layer: step(layer), device, args.iters, args.warmup)
                     for which, layer in layers.items()}
            step_ms = 1e3 * sorted(times["real"])[len(times["real"]) // 2]
            stand_ms = 1e3 * sorted(times["stand_in"])[len(times["stand_in"]) // 2]
            exposed = step_ms - stand_ms
            if n == 1:
                sync_exposed = exposed
            hidden = (1 - exposed / sync_exposed) if sync_exposed and sync_exposed > 0 and ctx.world > 1 else None
            ctx.add_row({**key, "heads": heads, "shape": list(q.shape), "step_ms": step_ms, "stand_in_ms": stand_ms,
                         "exposed_ms": exposed, "hidden": hidden, "grad_max_abs_diff": grad_diff, "wrong": wrong,
                         "wrong_oracle": "the synchronous layer's output on the same route, bit for bit (input "
                         "gradients: grad_max_abs_diff, the attention backward's own reduction order may differ)"})
            ctx.advance(f"{label} {route} {direction} N={n}")


CASE = OverlapCase()
