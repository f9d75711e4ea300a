"""The tuner: sweep fused-route plans per geometry, and print the ``TunedRow`` entries to paste.

It builds a ``UlyssesHelper`` (the native transport on CUDA; ``GlooPlanTransport`` on CPU, where the timings
mean nothing) and runs the transport's ``execute(x, geom, plan)`` with explicit plans, bypassing the vote and the
policy; every rank runs the same candidates in the same order. Candidates per geometry and mode, per engine
(``--engines``: ``sm`` the fused kernel with ``--ctas``, ``ce`` the copy engines with ``--ce-ctas``, whose chunks fit
half the window): planes per chunk 1..B, and one plane per chunk cut into ``--row-splits`` even row ranges (plus
the window-limited row count where a plane exceeds the window); a plan whose chunk does not fit is left out.

Every candidate's output is compared bit for bit with ``nccl_route`` (``wrong``); only exact candidates can win.
Then, per table key (GPU model, SP size, dtype, H, D), the (engine, CTAs, planes per chunk, row chunks) whose
policy-derived plans (``policy.choose_plan`` with that row alone: what the helper would run) have the lowest
total time over the swept geometries and modes, as ``TunedRow(...)`` text and as data (``tuned_rows_data``, which
``a2a --tuned-from`` reads).
"""

from __future__ import annotations

import argparse
import datetime
import json
import textwrap
from typing import ClassVar

import torch

from benchmarks.harness import oracle, product, report, stats, timing
from benchmarks.harness.case import Case, Context
from benchmarks.harness.cli import divisible, input_shape, parse_modes


def candidates(geom, ctas: list[int], splits: list[int], window: int, engine: str = "sm") -> list:
    """The plans swept for ``geom`` (module docstring), each fitting ``window``. Pure."""
    from fastvideo.distributed.ulysses.policy import Plan, even_rows

    plans = []
    usable = window // 2 if engine == "ce" else window  # a ce plan double-buffers its chunks
    # Even row ranges, as the policy cuts them (policy.even_rows): k pieces, or as few as the window allows.
    rows_options = sorted({even_rows(geom.S, -(-geom.S // k)) for k in splits if 1 < k <= geom.S}, reverse=True)
    if geom.plane_bytes > usable and usable // geom.row_bytes >= 1:
        rows_options.append(even_rows(geom.S, usable // geom.row_bytes))
    for c in ctas:
        for planes in range(1, geom.B + 1):
            plans.append(Plan(c, planes, geom.S, tuned=True, engine=engine))
        for rows in rows_options:
            if rows < geom.S:
                plans.append(Plan(c, 1, rows, tuned=True, engine=engine))
    seen, out = set(), []
    for plan in plans:
        if plan.word not in seen and plan.window_bytes(geom) <= window:
            seen.add(plan.word)
            out.append(plan)
    return out


def tuned_row_text(gpu: str, ws: int, dt: torch.dtype, heads: int, head_dim: int, ctas: int, planes: int,
                   row_chunks: int, source: str, engine: str = "sm") -> str:
    """A ``TunedRow(...)`` entry formatted to paste into ``TUNED_TABLE`` (ruff-clean at line length 120)."""
    parts = textwrap.wrap(source, 88, drop_whitespace=False, break_on_hyphens=False)
    assert "".join(parts) == source
    pad = " " * 21
    text = "\n".join((pad if i else "") + json.dumps(part) for i, part in enumerate(parts))
    engine_arg = f", engine={json.dumps(engine)}" if engine != "sm" else ""
    return (f"    TunedRow({json.dumps(gpu)}, {ws}, {dt}, {heads}, {head_dim}, ctas={ctas}, "
            f"planes_per_chunk={planes},\n             row_chunks={row_chunks}{engine_arg}, source=({text})),")


class TuneCase(Case):
    name = "tune"
    summary = "sweep fused-route plans (CTAs, chunking, engine) per geometry; TunedRow entries to paste"
    key = ("geometry", "mode", "plan")
    key_columns = 2
    metric = "transfer_ms"
    defaults: ClassVar[dict] = {"iters": 20, "warmup": 5}
    quick: ClassVar[dict] = {"iters": 3, "warmup": 1}
    columns = (
        report.Column("geometry", "geometry", width=12),
        report.Column("mode", "mode"),
        report.Column("engine_ctas", "ctas", get=lambda r: f"{r['engine']}{r['ctas']}"),
        report.Column("planes_per_chunk", "planes"),
        report.Column("rows_per_chunk", "rows"),
        report.Column("chunks", "chunks"),
        report.Column("transfer_ms", "xfer ms"),
        report.Column("gbps", "GB/s", fmt=".1f"),
        report.Column("vs_nccl", "vs nccl"),
    )

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        from fastvideo.distributed.ulysses.policy import MAX_CTAS

        parser.add_argument("--modes", default="0,1")
        parser.add_argument("--ctas", default="36,72,108,132,144", help=f"sm CTA counts (comma list, <= {MAX_CTAS})")
        parser.add_argument("--row-splits", default="2,4", help="sub-plane candidates: S_local cut into this many")
        parser.add_argument("--engines", default=None,
                            help="sm (the fused kernel), ce (copy engines); default: both, ce skipped with a note "
                                 "where the build lacks it; an engine named here that cannot run fails the run")
        parser.add_argument("--ce-ctas", default="132", help="CTA counts of the ce engine's on-device copies")
        parser.set_defaults(seed=4321)

    def run(self, ctx: Context) -> None:
        from fastvideo.distributed.communication_op import nccl_route
        from fastvideo.distributed.parallel_state import get_sp_group
        from fastvideo.distributed.ulysses.helper import UlyssesHelper
        from fastvideo.distributed.ulysses.policy import MAX_CTAS, Geometry, TunedRow, choose_plan

        args, device, world, dtype = ctx.args, ctx.device, ctx.world, ctx.dtype
        if args.quick:
            args.ctas = "36,144"
        if world < 2:
            raise SystemExit("tune needs an SP group of >= 2 ranks (--nproc 2, or torchrun --nproc_per_node=N)")
        transport = None
        if device.type == "cpu":
            GlooPlanTransport = product.plan_transport()

            transport = GlooPlanTransport()
        helper = UlyssesHelper(transport=transport)
        try:
            if not helper.fused_available:
                raise SystemExit(f"fused route unavailable: {helper.stats()['construction']}: "
                                 f"{helper.stats()['construction_detail']}")
            ctas = [int(c) for c in args.ctas.split(",")]
            if any(not 1 <= c <= MAX_CTAS for c in ctas):
                raise SystemExit(f"--ctas {args.ctas}: every value must be in 1..{MAX_CTAS}")
            splits = [int(k) for k in args.row_splits.split(",") if k.strip()]
            engines = [e.strip() for e in (args.engines or "sm,ce").split(",") if e.strip()]
            if "ce" in engines and "ce" not in product.entry_points(helper):
                ctx.unavailable("--engines ce", "the kernel build has no copy-engine entry point",
                                named=args.engines is not None)
                engines.remove("ce")
            engine_ctas = {"sm": ctas, "ce": [int(c) for c in args.ce_ctas.split(",")]}
            modes = parse_modes(args.modes)
            geometries = ctx.geometries()
            ctx.header.update(window_bytes=helper.window_bytes, transport=helper.stats()["transport"],
                              note="CPU: GlooPlanTransport timings are meaningless" if device.type == "cpu" else "")
            sp = get_sp_group()
            execute = product.transport(helper).execute
            best, measured = [], {}
            ctx.progress.total = len(geometries) * len(modes)
            for name, shape in geometries:
                why = divisible(shape, world)
                if why:
                    ctx.skip(why, geometry=name, mode=None)
                    continue
                for mode in modes:
                    x = oracle.make_input(input_shape(shape, mode, world), dtype, device,
                                          args.seed + 1000 * ctx.rank + mode)
                    geom = Geometry.from_input(x.shape, mode, world, dtype)
                    ref = nccl_route(x, mode, sp.device_group)
                    nccl_s = stats.median(timing.device_times(
                        lambda x=x, mode=mode: nccl_route(x, mode, sp.device_group), device, args.iters, args.warmup))
                    group = []
                    for plan in [pl for e in engines for pl in candidates(geom, engine_ctas[e], splits,
                                                                         helper.window_bytes, e)]:
                        wrong = timing.rank_sum(oracle.count_bitwise_diff(execute(x, geom, plan), ref))
                        t = stats.median(timing.device_times(lambda x=x, geom=geom, plan=plan: execute(x, geom, plan),
                                                             device, args.iters, args.warmup))
                        row = ctx.add_row({
                            "geometry": name, "mode": mode, "engine": plan.engine, "ctas": plan.ctas,
                            "planes_per_chunk": plan.planes_per_chunk, "rows_per_chunk": plan.rows_per_chunk,
                            "chunks": plan.num_chunks(geom), "plan": plan.describe(geom), "transfer_ms": t * 1e3,
                            "gbps": stats.bandwidth_gbps(geom.operand_bytes, world, t), "nccl_ms": nccl_s * 1e3,
                            "vs_nccl": t / nccl_s, "wrong": wrong,
                            "wrong_oracle": "nccl_route on the same input (bitwise), summed over ranks"})
                        group.append(row)
                        measured[(name, mode, plan.word)] = row
                    exact = [r for r in group if r["wrong"] == 0]
                    if exact:
                        best.append(min(exact, key=lambda r: r["transfer_ms"]))
                    del x, ref
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                    ctx.advance(f"{name} mode {mode}")
            # One TunedRow per table key: the (engine, ctas, planes, row chunks) whose policy plans are fastest.
            gpu = product.gpu_key(helper)
            keys: dict[tuple, list] = {}
            for name, shape in geometries:
                if divisible(shape, world):
                    continue
                for mode in modes:
                    geom = Geometry.from_input(input_shape(shape, mode, world), mode, world, dtype)
                    keys.setdefault((world, dtype, geom.H, geom.D), []).append((name, mode, geom))
            commit, date = ctx.header["commit"][:12], datetime.date.today().isoformat()
            lines, data = [], []
            for (ws, dt, heads, head_dim), members in keys.items():
                scores = []
                shapes = [(planes, 1) for planes in range(1, max(g.B for _, _, g in members) + 1)]
                shapes += [(1, k) for k in splits if k > 1]
                for engine, c in [(e, c) for e in engines for c in engine_ctas[e]]:
                    for planes, row_chunks in shapes:
                        table = (TunedRow(gpu, ws, dt, heads, head_dim, ctas=c, planes_per_chunk=planes,
                                          row_chunks=row_chunks, source="sweep", engine=engine),)
                        total, complete = 0.0, True
                        for name, mode, geom in members:
                            choice = choose_plan(geom, gpu=gpu, window_bytes=helper.window_bytes, table=table)
                            row = measured.get((name, mode, choice.plan.word)) if choice.plan is not None else None
                            if row is None or row["wrong"]:
                                complete = False
                                break
                            total += row["transfer_ms"]
                        if complete:
                            scores.append((total, engine, c, planes, row_chunks))
                if not scores:
                    continue
                total, engine, c, planes, row_chunks = min(scores)
                names = sorted({n for n, _, _ in members})
                source = (f"benchmarks/tune_ulysses_a2a.py {date}, {ws}x {ctx.header['gpu']}, NCCL "
                          f"{ctx.header['nccl']}, torch {torch.__version__}, commit {commit}, geometries "
                          f"{'/'.join(names)} modes {'/'.join(str(m) for m in modes)}: {total:.3f} ms total")
                lines.append(tuned_row_text(gpu, ws, dt, heads, head_dim, c, planes, row_chunks, source, engine))
                data.append({"gpu": gpu, "world_size": ws, "dtype": str(dt).replace("torch.", ""), "heads": heads,
                             "head_dim": head_dim, "ctas": c, "planes_per_chunk": planes, "row_chunks": row_chunks,
                             "engine": engine, "source": source})
            ctx.extra.update(best=best, tuned_rows=lines, tuned_rows_data=data)
        finally:
            helper.destroy()

    def report(self, ctx: Context) -> list[str]:
        lines = [*super().report(ctx), "", "# best exact plan per geometry and mode:"]
        for r in ctx.extra.get("best", []):
            lines.append(f"#   {r['geometry']:>10} mode {r['mode']}: {r['plan']}: {r['transfer_ms']:.3f} ms, "
                         f"{r['gbps']:.1f} GB/s, {r['vs_nccl']:.3f} x NCCL")
        if ctx.device.type == "cpu":
            lines.append("# CPU smoke run: these timings are meaningless; do not paste these rows into TUNED_TABLE.")
        lines.append("# paste into fastvideo/distributed/ulysses/policy.py TUNED_TABLE:")
        return lines + list(ctx.extra.get("tuned_rows", []))


CASE = TuneCase()
