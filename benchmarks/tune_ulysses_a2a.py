"""Sweep fused-route plans (CTA counts, chunk shapes) per geometry and print TUNED_TABLE rows to paste.

Launch on a multi-GPU host (one process per GPU; the SP group spans all ranks):

    torchrun --standalone --nproc_per_node=2 benchmarks/tune_ulysses_a2a.py --json tune.json
    torchrun --standalone --nproc_per_node=2 benchmarks/tune_ulysses_a2a.py --geometry h3-128k --ctas 72,132,144
    torchrun --standalone --nproc_per_node=2 benchmarks/tune_ulysses_a2a.py --device cpu --quick   # smoke only

It builds a ``UlyssesHelper`` (the native transport on CUDA; ``GlooPlanTransport`` on CPU, where the
timings mean nothing: gloo over loopback on a shared CPU says nothing about NVLink) and calls
``helper.transport.execute(x, geom, plan)`` directly with explicit ``Plan`` objects, bypassing the
vote and the policy. Every rank runs the same candidate list in the same order. Candidates per
geometry and mode: every ``--ctas`` value x (planes per chunk 1..B, whole planes) and x (one plane per
chunk, S_local split into ``--row-splits`` sub-plane chunks, plus the window-limited row count when a
plane exceeds the window); plans whose chunk does not fit the helper's window are skipped.

Each candidate's output is checked bit for bit against ``nccl_route`` on the same input (``wrong``,
summed over ranks); only exact candidates can win. Columns: ``ctas``, ``planes``/``rows`` per chunk,
``chunks``, ``xfer ms`` (CUDA events around ``execute``, rank-max median), ``GB/s`` (bytes moved per
rank / time, ``common.bandwidth_gbps``), ``vs nccl`` (time / the NCCL route's time, permutes
included, measured the same way), ``wrong``.

Engines (``--engines``): ``sm`` plans (the fused kernel, ``--ctas``) and ``ce`` plans (the copy engines,
``--ce-ctas`` for their on-device copies; their chunks fit half the window), both held to the same exactness.

Output: the best plan per geometry and mode, then one ``TunedRow(...)`` per table key (GPU model, SP
size, dtype, H, D): the (engine, CTAs, planes per chunk, row chunks) whose policy-derived plans
(``policy.choose_plan`` with only that row in the table: exactly what the helper would run) have the
lowest total time over the swept geometries and modes of that key. Sub-plane candidates cut S_local
into even row ranges (``policy.even_rows``), as the policy does with a row's ``row_chunks``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import textwrap

import common  # first: puts the FastVideo tree under test on sys.path
import torch
from benchmark_ulysses_a2a import DEFAULT_GEOMETRIES, add_device_and_geometry_args, make_input, parse_geometry

from fastvideo.distributed.communication_op import nccl_route
from fastvideo.distributed.parallel_state import get_sp_group
from fastvideo.distributed.ulysses.policy import (
    MAX_CTAS,
    Geometry,
    Plan,
    TunedRow,
    choose_plan,
    even_rows,
    normalize_gpu_name,
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_device_and_geometry_args(p)
    p.add_argument("--modes", default="0,1")
    p.add_argument("--ctas", default="36,72,108,132,144", help=f"comma list of CTA counts (<= {MAX_CTAS})")
    p.add_argument("--row-splits", default="2,4", help="sub-plane candidates: S_local split into this many chunks")
    p.add_argument("--engines", default="sm,ce",
                   help="plan engines: sm (the fused kernel), ce (copy engines; skipped if the build lacks it)")
    p.add_argument("--ce-ctas", default="132", help="CTA counts for the ce engine's on-device copies (comma list)")
    p.add_argument("--dtype", choices=sorted(common.DTYPES), default="bf16")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="smoke run: 3 iterations, 1 warm-up, CTAs 36,144")
    p.add_argument("--seed", type=int, default=4321)
    p.add_argument("--json")
    return p


def candidates(geom: Geometry, ctas: list[int], splits: list[int], window: int, engine: str = "sm") -> list[Plan]:
    plans: list[Plan] = []
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.iters, args.warmup, args.ctas = 3, 1, "36,144"
    rank, world, device = common.init_distributed(args.device)
    if world < 2:
        raise SystemExit("tune_ulysses_a2a.py needs an SP group of >= 2 ranks (torchrun --nproc_per_node=N, N >= 2)")
    from fastvideo.distributed.ulysses.helper import UlyssesHelper

    transport = None
    if device.type == "cpu":
        from fastvideo.distributed.ulysses.transport import GlooPlanTransport

        transport = GlooPlanTransport()
    helper = UlyssesHelper(transport=transport)
    if not helper.fused_available:
        raise SystemExit(f"fused route unavailable: {helper.stats()['construction']}: {helper.construction_detail}")
    dtype = common.DTYPES[args.dtype]
    ctas = [int(c) for c in args.ctas.split(",")]
    if any(not 1 <= c <= MAX_CTAS for c in ctas):
        raise SystemExit(f"--ctas {args.ctas}: every value must be in 1..{MAX_CTAS}")
    splits = [int(k) for k in args.row_splits.split(",") if k.strip()]
    ce_ctas = [int(c) for c in args.ce_ctas.split(",")]
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if "ce" in engines and "ce" not in helper.capability.entry_points:
        engines.remove("ce")
        if rank == 0:
            print("# the kernel build has no copy-engine entry point: sweeping sm only", flush=True)
    engine_ctas = {"sm": ctas, "ce": ce_ctas}
    modes = [int(m) for m in args.modes.split(",")]
    default = DEFAULT_GEOMETRIES if device.type == "cuda" else ("toy",)
    geometries = args.geometry or [parse_geometry(g) for g in default]
    header = common.env_header(device, world, helper, {
        "benchmark": "tune_ulysses_a2a", "dtype": args.dtype, "iters": args.iters, "window_bytes": helper.window_bytes,
        "transport": helper.stats()["transport"],
        "note": "CPU smoke run: GlooPlanTransport timings are meaningless" if device.type == "cpu" else "",
    })
    if rank == 0:
        common.print_header(header)
        print(f"{'geometry':>12} {'mode':>4} {'ctas':>5} {'planes':>6} {'rows':>8} {'chunks':>6} {'xfer ms':>9} "
              f"{'GB/s':>7} {'vs nccl':>7} {'wrong':>6}", flush=True)
    sp = get_sp_group()
    rows, best = [], []
    measured: dict[tuple, dict] = {}  # (geometry, mode, plan word) -> row
    for name, (b, s, h, d) in geometries:
        if h % world or s % world:
            if rank == 0:
                print(f"{name:>12} skipped: H={h} or S={s} not divisible by SP{world}")
            continue
        for mode in modes:
            shape = (b, s // world, h, d) if mode == 0 else (b, s, h // world, d)
            x = make_input(shape, dtype, device, args.seed + 1000 * rank + mode)
            geom = Geometry.from_input(x.shape, mode, world, dtype)
            ref = nccl_route(x, mode, sp.device_group)
            nccl_s = common.median(common.device_times(lambda x=x, mode=mode: nccl_route(x, mode, sp.device_group),
                                                       device, args.iters, args.warmup))
            group = []
            plans = [pl for e in engines for pl in candidates(geom, engine_ctas[e], splits, helper.window_bytes, e)]
            for plan in plans:
                out = helper.transport.execute(x, geom, plan)
                wrong = common.rank_sum(common.count_bitwise_diff(out, ref))
                del out
                t = common.median(common.device_times(lambda x=x, geom=geom, plan=plan: helper.transport.execute(
                    x, geom, plan), device, args.iters, args.warmup))
                row = {"geometry": name, "mode": mode, "engine": plan.engine, "ctas": plan.ctas,
                       "planes_per_chunk": plan.planes_per_chunk,
                       "rows_per_chunk": plan.rows_per_chunk, "chunks": plan.num_chunks(geom),
                       "plan": plan.describe(geom),
                       "transfer_ms": t * 1e3, "gbps": common.bandwidth_gbps(geom.operand_bytes, world, t),
                       "nccl_ms": nccl_s * 1e3, "vs_nccl": t / nccl_s, "wrong": wrong}
                rows.append(row)
                group.append(row)
                measured[(name, mode, plan.word)] = row
                if rank == 0:
                    print(f"{name:>12} {mode:>4} {plan.engine + str(plan.ctas):>5} {plan.planes_per_chunk:>6} "
                          f"{plan.rows_per_chunk:>8} "
                          f"{row['chunks']:>6} {row['transfer_ms']:9.3f} {row['gbps']:7.1f} {row['vs_nccl']:7.3f} "
                          f"{wrong:>6}", flush=True)
            exact = [r for r in group if r["wrong"] == 0]
            if exact:
                best.append(min(exact, key=lambda r: r["transfer_ms"]))
            del x, ref
            if device.type == "cuda":
                torch.cuda.empty_cache()

    # One TunedRow per table key: the (ctas, planes) whose policy-derived plans are fastest in total.
    gpu = normalize_gpu_name(helper.gpu_name)  # the table key the policy looks up ("H200"; "CPU" on CPU)
    keys: dict[tuple, list[tuple[str, int, Geometry]]] = {}
    for name, (b, s, h, d) in geometries:
        if h % world or s % world:
            continue
        for mode in modes:
            shape = (b, s // world, h, d) if mode == 0 else (b, s, h // world, d)
            geom = Geometry.from_input(shape, mode, world, dtype)
            keys.setdefault((world, dtype, geom.H, geom.D), []).append((name, mode, geom))
    commit = header["commit"][:12]
    date = datetime.date.today().isoformat()
    tuned_lines, tuned_data = [], []
    for (ws, dt, heads, head_dim), members in keys.items():
        scores = []
        shapes = [(planes, 1) for planes in range(1, max(g.B for _, _, g in members) + 1)]
        shapes += [(1, k) for k in splits if k > 1]
        for engine, c in [(e, c) for e in engines for c in engine_ctas[e]]:
            for planes, row_chunks in shapes:
                table = (TunedRow(gpu, ws, dt, heads, head_dim, ctas=c, planes_per_chunk=planes, row_chunks=row_chunks,
                                  source="sweep", engine=engine),)
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
        source = (f"benchmarks/tune_ulysses_a2a.py {date}, {ws}x {common.gpu_name(device)}, NCCL {header['nccl']}, "
                  f"torch {torch.__version__}, commit {commit}, geometries {'/'.join(names)} modes "
                  f"{'/'.join(str(m) for m in modes)}: {total:.3f} ms total")
        tuned_lines.append(tuned_row_text(gpu, ws, dt, heads, head_dim, c, planes, row_chunks, source, engine))
        tuned_data.append({"gpu": gpu, "world_size": ws, "dtype": str(dt).replace("torch.", ""), "heads": heads,
                           "head_dim": head_dim, "ctas": c, "planes_per_chunk": planes, "row_chunks": row_chunks,
                           "engine": engine, "source": source})
    if rank == 0:
        print("\n# best exact plan per geometry and mode:")
        for r in best:
            print(f"#   {r['geometry']:>10} mode {r['mode']}: {r['plan']}: {r['transfer_ms']:.3f} ms, "
                  f"{r['gbps']:.1f} GB/s, {r['vs_nccl']:.3f} x NCCL")
        if device.type == "cpu":
            print("# CPU smoke run: these timings are meaningless; do not paste these rows into TUNED_TABLE.")
        print("# paste into fastvideo/distributed/ulysses/policy.py TUNED_TABLE:")
        for line in tuned_lines:
            print(line)
        common.write_json(args.json, header, rows, best=best, tuned_rows=tuned_lines, tuned_rows_data=tuned_data)
    failed = any(r["wrong"] for r in rows)
    helper.destroy()
    common.shutdown()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
