"""The transport benchmark: the all-to-all's routes side by side, rotated in one run, host-to-completion.

Rows: every geometry x ``--modes`` x ``--routes``. Per (geometry, mode) every route is timed in ``--repeat``
rounds whose order rotates by one each round (``timing.rotated``), ``--iters`` iterations per route and round
after ``--warmup`` calls, all from the same line-up with the same host-to-completion definition. Routes:

* ``nccl``: the public op under ``FASTVIDEO_ULYSSES_A2A=off`` (permute + all_to_all_single + permute; the oracle);
* ``fused``: the public op under ``auto``: the vote on every call, the fused route with the policy's plan where
  every rank agrees (on CPU the helper runs on ``GlooPlanTransport``: the whole pipeline over gloo);
* ``fast-ulysses``, ``fast-ulysses-out``: the peer library (``benchmarks.cases.peer``), where installed;
* ``upstream-0.2.1``: upstream FastVideo 0.2.1's own fused route on its ``fastvideo-kernel`` 0.3.5 extension
  (``benchmarks.cases.upstream_peer``), where built (``FASTVIDEO_UPSTREAM_PEER``).

Per row: median / p10 / p90 / min / max of the slowest rank's time per iteration, the same iterations from the
last rank's entry (``aligned_*``) and the entry skew; what ran (the helper's history: route, plan, declines);
the vote's median; the transfer alone (CUDA events around ``all_to_all_single`` of the send layout, or around
the transport's ``execute`` with the plan the helper ran); GB/s; the floor measured in the same run
(``benchmarks.cases.floor``: the best of the peer copy, the copy-engine and the SM-store pushes) and the
transfer's fraction of it; for fused rows the decomposition (chunks, barrier pair, copy-out, host overhead =
host-to-completion - the transfer's device time); ``wrong`` against ``nccl_route`` on the same input.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch
import torch.distributed as dist

from benchmarks.cases import floor, peer, upstream_peer
from benchmarks.harness import oracle, process, product, report, stats, timing
from benchmarks.harness.case import Case, Context
from benchmarks.harness.cli import DTYPES, MODE_DIMS, divisible, input_shape, parse_modes
from benchmarks.harness.timing import Samples

ROUTES = ("nccl", "fused", *peer.ROUTES, *upstream_peer.ROUTES)
ALIASES = {"off": "nccl", "auto": "fused", "peer": ",".join(peer.ROUTES), "upstream": ",".join(upstream_peer.ROUTES)}
ORACLE = "nccl_route on the same input (bitwise), summed over ranks"


def parse_routes(text: str) -> list[str]:
    routes = []
    for item in text.split(","):
        item = ALIASES.get(item.strip(), item.strip())
        for r in item.split(","):
            if r not in ROUTES:
                raise SystemExit(f"--routes: {r!r} is not one of {', '.join(ROUTES)} (or off, auto, peer, upstream)")
            if r not in routes:
                routes.append(r)
    return routes


def load_tuned_rows(path: str) -> tuple:
    """The ``TunedRow`` objects a ``tune`` JSON chose (its ``tuned_rows_data``)."""
    from fastvideo.distributed.ulysses.policy import TunedRow

    data = json.loads(Path(path).read_text())
    rows = data.get("tuned_rows_data")
    if not rows:
        raise SystemExit(f"--tuned-from {path}: no tuned_rows_data (a tune_ulysses_a2a.py JSON)")
    return tuple(TunedRow(r["gpu"], r["world_size"], DTYPES[r["dtype"]], r["heads"], r["head_dim"],
                          ctas=r["ctas"], planes_per_chunk=r["planes_per_chunk"], row_chunks=r["row_chunks"],
                          engine=r.get("engine", "sm"), source=r["source"]) for r in rows)


def summarize_history(helper, since_seq: int) -> dict:
    """What the helper's history says ran since ``since_seq``: routes, plans, decline reasons."""
    records = [r for r in helper.history if r.seq >= since_seq]
    routes = collections.Counter(r.route for r in records)
    plans = sorted({(r.plan.word, r.plan) for r in records if r.plan is not None}, key=lambda t: t[0])
    reasons = collections.Counter(r.reason.label for r in records if r.reason is not None)
    ran = "fused" if set(routes) == {"fused"} else "nccl" if set(routes) == {"nccl"} else "mixed" if routes else "none"
    return {"route_ran": ran, "calls": dict(routes), "plans": [p for _, p in plans], "declines": dict(reasons)}


@dataclass
class Contender:
    """One route in one (geometry, mode) cell."""

    route: str
    fn: Callable[[], torch.Tensor] | None = None
    activate: Callable[[], None] = lambda: None
    skipped: str | None = None
    samples: Samples = field(default_factory=Samples)
    mark: int = 0  # the helper's call count before the cell (fused)


class A2ACase(Case):
    name = "a2a"
    summary = "the all-to-all's routes side by side: host-to-completion, transfer, floor, decomposition, #wrong"
    key = ("geometry", "mode", "route")
    key_columns = 3
    defaults: ClassVar[dict] = {"iters": 25, "warmup": 5, "repeat": 4}
    quick: ClassVar[dict] = {"iters": 5, "warmup": 1, "repeat": 2}
    saves_outputs = True
    columns = (
        report.Column("geometry", "geometry", width=12),
        report.Column("mode", "mode"),
        report.Column("route", "route", width=16),
        report.Column("route_ran", "ran", width=9, get=lambda r: str(r.get("route_ran"))[:14]),
        report.Column("median_ms", "median"),
        report.Column("p10_ms", "p10"),
        report.Column("p90_ms", "p90"),
        report.Column("vote_us", "vote us", fmt=".1f"),
        report.Column("host_overhead_us", "host us", fmt=".1f"),
        report.Column("transfer_ms", "xfer ms"),
        report.Column("gbps", "GB/s", fmt=".1f"),
        report.Column("floor_fraction", "floor%", fmt=".1f", scale=100.0),
    )

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--modes", default="0,1", help="comma list: 0 = (2,1) before attention, 1 = (1,2) after")
        parser.add_argument("--routes", default=None,
                            help=f"comma list of {', '.join(ROUTES)} (off = nccl, auto = fused, peer = both "
                                 "fast-ulysses rows); a route named here that cannot run fails the run. Default: "
                                 "every route, those that cannot run here skipped with the reason")
        parser.add_argument("--floor", default=",".join(floor.CANDIDATES),
                            help="floor candidates measured per geometry (p2p, ce, sm; empty: none)")
        parser.add_argument("--overlap", action="store_true", help="GEMM-chain slowdown beside each route (CUDA)")
        parser.add_argument("--gemm-size", type=int, default=8192, help="--overlap: square bf16 GEMM size")
        parser.add_argument("--gemm-chain", type=int, default=20, help="--overlap: GEMMs in the chain")
        parser.add_argument("--require-fused", action="store_true",
                            help="fail unless every fused row at SP >= 2 ran the fused route on every call")
        parser.add_argument("--tuned-from", metavar="TUNE_JSON",
                            help="plan from the rows a tune JSON chose (tuned_rows_data) instead of TUNED_TABLE")
        parser.add_argument("--save-outputs", help="directory: each rank saves its outputs (rank{r}.safetensors)")
        parser.add_argument("--save-max-bytes", type=int, default=512 << 20,
                            help="--save-outputs: larger tensors keep only their SHA-256 (in the file's metadata)")

    # ------------------------------------------------------------------------------------------ table lines

    def details(self, r: dict) -> list[str]:
        out = []
        if r.get("aligned_median_ms") is not None and r.get("sp_size", 1) > 1:
            out.append(f"from the last rank's entry: median {r['aligned_median_ms']:.3f} ms, host "
                       f"{_f(r.get('host_overhead_aligned_us'), '.1f')} us; entry skew "
                       f"{_f(r.get('entry_skew_us'), '.1f')} us; min {_f(r.get('min_ms'), '.3f')} max "
                       f"{_f(r.get('max_ms'), '.3f')} ms over {r.get('n')}")
        if r.get("plan"):
            out.append(f"plan: {r['plan']}")
        if r.get("copy_out_ms") is not None and r.get("floor_ms"):
            model = r["floor_ms"] + r["chunks"] * r["barrier_pair_us"] / 1e3 + r["copy_out_ms"] / r["chunks"]
            out.append(f"parts: floor {r['floor_ms']:.3f} ms ({r.get('floor_ref')}), {r['chunks']} chunk(s) x "
                       f"barrier pair {r['barrier_pair_us']:.1f} us, copy-out {r['copy_out_ms']:.3f} ms alone; model "
                       f"{model:.3f} ms vs xfer {r['transfer_ms']:.3f} ms; host "
                       f"{r.get('host_overhead_us') or 0:.1f} us")
        if r.get("note"):
            out.append(f"note: {r['note']}")
        if r.get("gemm_slowdown") is not None:
            out.append(f"overlap: GEMM chain {r['gemm_chain_ms']:.3f} ms alone, {r['gemm_chain_beside_ms']:.3f} ms "
                       f"beside {r['overlap_calls']} calls: slowdown {r['gemm_slowdown'] * 100:.1f}%")
        elif r.get("overlap_note"):
            out.append(f"overlap: {r['overlap_note']}")
        return out

    def report(self, ctx: Context) -> list[str]:
        lines = super().report(ctx)
        floors = ctx.extra.get("floor") or {}
        for nbytes, res in floors.items():
            refs = "; ".join(f"{k} {v['gbps']:.1f} GB/s" if v.get("gbps") else f"{k} skipped ({v.get('skipped')})"
                             for k, v in res["refs"].items())
            best = f"{res['floor_ms']:.3f} ms ({res['floor_ref']})" if res["floor_ms"] else "none measured"
            lines.append(f"# floor at {int(nbytes) / 1e6:.1f} MB per peer: {best}; {refs}")
        return lines

    # ------------------------------------------------------------------------------------------ the run

    def run(self, ctx: Context) -> None:
        args = ctx.args
        modes = parse_modes(args.modes)
        named = args.routes is not None  # routes asked for by name must run; the default set may skip some
        routes = parse_routes(args.routes) if named else list(ROUTES)
        candidates = tuple(c.strip() for c in args.floor.split(",") if c.strip())
        if set(candidates) - set(floor.CANDIDATES):
            raise SystemExit(f"--floor: choose among {', '.join(floor.CANDIDATES)}")
        helper, helper_note, helper_why = None, None, ""
        if "fused" in routes and ctx.world > 1:
            try:
                helper = product.default_helper(ctx.device)
                if ctx.device.type != "cuda":
                    helper_note = "CPU: GlooPlanTransport injected (timings mean nothing)"
            except Exception as exc:  # noqa: BLE001 - reported; the op under auto would raise the same way
                helper_why = f"helper construction failed: {type(exc).__name__}: {exc}"
                helper_note = f"fused rows skipped: {helper_why}"
        tuned_from = None
        if args.tuned_from and helper is not None:
            tuned_from = load_tuned_rows(args.tuned_from)
            helper.tuned_table = tuned_from
        the_peer, peer_why = (None, "")
        if set(peer.ROUTES) & set(routes):
            the_peer, peer_why = peer.Peer.open()
        upstream, upstream_why, upstream_info = None, "", None
        if set(upstream_peer.ROUTES) & set(routes):
            upstream, upstream_why, upstream_info = upstream_peer.UpstreamPeer.open(ctx.device)
        geometries = ctx.geometries()
        state = {"helper": helper, "helper_why": helper_why, "peer": the_peer, "peer_why": peer_why,
                 "upstream": upstream, "upstream_why": upstream_why}
        # Agreed (a rank's reason where any rank has one), so that every rank runs, or stops on, the same routes.
        whys = timing.gather({r: self._route_why(r, ctx, state) for r in routes})
        state["unavailable"] = {}
        for route in routes:
            why = next((w[route] for w in whys if w[route]), None)
            if why:
                state["unavailable"][route] = why
        runnable = [r for r in routes if r not in state["unavailable"]]
        ctx.progress.total = len(geometries) * len(modes) * args.repeat * max(len(runnable), 1)
        ctx.header.update(
            routes=routes, modes=modes, floor_candidates=list(candidates),
            tuned_from={"path": args.tuned_from, "rows": [repr(r) for r in tuned_from]} if tuned_from else None,
            helper=helper.stats() if helper is not None else None, helper_note=helper_note,
            peer=the_peer.info() if the_peer is not None else {"skipped": peer_why} if peer_why else None,
            upstream_peer={**(upstream_info or {}), **({"skipped": upstream_why} if upstream_why else {})} or None,
            floor_definition="the fastest of " + ", ".join(candidates) + " moving operand/P bytes to every peer, "
                             "every direction at once, measured in this run (benchmarks/cases/floor.py)")
        state.update(floors={}, barrier={}, saved={}, candidates=candidates)
        try:  # the peers opened above are closed on every way out, a requested route that cannot run included
            for route, why in state["unavailable"].items():
                ctx.unavailable(f"--routes {route}", why, named=named)
            for name, shape in geometries:
                for mode in modes:
                    self.cell(ctx, state, routes, name, shape, mode)
                    if ctx.device.type == "cuda":
                        torch.cuda.empty_cache()  # the cell's operands are gone: keep big geometries from stacking
                ctx.checkpoint()
        finally:
            if the_peer is not None:
                the_peer.close()
            if upstream is not None:
                upstream.close()
        ctx.extra["floor"] = {str(k): v for k, v in state["floors"].items()}
        if args.save_outputs:
            save_outputs(args.save_outputs, ctx.rank, state["saved"])
        if helper is not None:
            ctx.header["helper_after"] = helper.stats()
        if args.require_fused:
            for r in ctx.rows:
                if r.get("route") == "fused" and r.get("sp_size", 1) > 1 and r.get("route_ran") != "fused":
                    ctx.fail(f"--require-fused: {r['geometry']} mode {r['mode']} ran {r.get('route_ran')} "
                             f"(declines {r.get('declines')}) {r.get('skipped') or r.get('note') or ''}".rstrip())

    def _route_why(self, route: str, ctx: Context, state: dict) -> str | None:
        """Why ``route`` cannot run in this run (None: it can)."""
        if route == "fused" and ctx.world > 1 and state["helper"] is None:
            return state["helper_why"] or "no helper"
        if route in peer.ROUTES and state["peer"] is None:
            return f"fast-ulysses: {state['peer_why']}"
        if route in upstream_peer.ROUTES and state["upstream"] is None:
            return f"upstream 0.2.1: {state['upstream_why']}"
        return None

    def cell(self, ctx: Context, state: dict, routes: list[str], name: str, shape: tuple, mode: int) -> None:
        """Every route for one geometry and mode: rotated rounds, then the per-route measurements."""
        from fastvideo.distributed.communication_op import nccl_route, sequence_model_parallel_all_to_all_4D
        from fastvideo.distributed.parallel_state import get_sp_group
        from fastvideo.distributed.ulysses.policy import Geometry

        args, device, p = ctx.args, ctx.device, ctx.world
        why = divisible(shape, p)
        if why:
            for route in routes:
                ctx.skip(why, geometry=name, mode=mode, route=route)
            return
        sp = get_sp_group()
        in_shape = input_shape(shape, mode, p)
        x = oracle.make_input(in_shape, ctx.dtype, device, args.seed + 1000 * ctx.rank + 7 * mode + sum(shape))
        geom = Geometry.from_input(x.shape, mode, p, ctx.dtype)
        ref = nccl_route(x, mode, sp.device_group) if p > 1 else x
        scatter, gather = MODE_DIMS[mode]
        helper, the_peer = state["helper"], state["peer"]

        def public_op() -> torch.Tensor:
            return sequence_model_parallel_all_to_all_4D(x, scatter_dim=scatter, gather_dim=gather)

        contenders = []
        for route in routes:
            c = Contender(route)
            c.skipped = state["unavailable"].get(route)
            if c.skipped is None:
                if route in ("nccl", "fused"):
                    c.fn = public_op
                    env_value = "off" if route == "nccl" else "auto"
                    c.activate = lambda env_value=env_value: process.set_route(env_value)
                    if route == "fused" and helper is not None:
                        c.mark = helper.stats()["calls"]
                elif route in upstream_peer.ROUTES:
                    c.fn, why = state["upstream"].contender(route, x, mode)
                    c.skipped = why or None
                else:
                    c.fn = the_peer.contender(route, x, mode)
            contenders.append(c)
        active = [c for c in contenders if c.skipped is None]
        for rnd in range(args.repeat):
            for c in timing.rotated(active, rnd):
                c.activate()
                c.samples.add(timing.host_timings(c.fn, device, args.iters, args.warmup))
                ctx.advance(f"{name} mode {mode} round {rnd + 1}/{args.repeat} {c.route}")
        key = x.numel() * x.element_size() // p if p > 1 else 0
        if key and key not in state["floors"] and state["candidates"]:
            state["floors"][key] = floor.measure(helper, key, device, args.iters, args.warmup, state["candidates"])
        for c in contenders:
            base = {"geometry": name, "shape_global": list(shape), "input_shape": list(in_shape), "mode": mode,
                    "route": c.route, "dtype": str(ctx.dtype).replace("torch.", ""), "sp_size": p}
            if c.skipped is not None:
                ctx.skip(c.skipped, **base)
                continue
            c.activate()
            ctx.add_row(self.row(ctx, state, c, base, x, ref, geom))
        process.set_route("off")

    def row(self, ctx: Context, state: dict, c: Contender, row: dict, x: torch.Tensor, ref: torch.Tensor,
            geom) -> dict:
        """The measurements of one contender after its timed rounds. Collective."""
        from fastvideo.distributed.parallel_state import get_sp_group

        args, device, p = ctx.args, ctx.device, ctx.world
        helper = state["helper"]
        sp = get_sp_group()
        operand_bytes = x.numel() * x.element_size()
        out = c.fn()
        timing.synchronize(device)
        wrong = timing.rank_sum(oracle.count_bitwise_diff(out, ref))
        row.update(operand_bytes_per_rank=operand_bytes, bytes_moved_per_rank=stats.bytes_moved_per_rank(
            operand_bytes, p), **stats.summarize(c.samples.rank_max))
        aligned = stats.summarize(c.samples.aligned)
        row.update(aligned_median_ms=aligned["median_ms"], aligned_p10_ms=aligned["p10_ms"],
                   aligned_p90_ms=aligned["p90_ms"],
                   entry_skew_us=(stats.median(c.samples.entry_skew) * 1e6 if c.samples.entry_skew else None))
        plan = None
        ours = c.route in ("nccl", "fused")
        if p == 1 and ours:
            row.update(route_ran="identity (SP1)", plans=[], declines={})
        elif c.route == "nccl":
            row.update(route_ran="nccl", plans=[], declines={})
        elif c.route == "fused":
            hist = summarize_history(helper, c.mark)
            plan = hist["plans"][-1] if hist["route_ran"] == "fused" else None
            row.update(route_ran=hist["route_ran"], calls=hist["calls"], declines=hist["declines"],
                       plans=[pl.describe(geom) for pl in hist["plans"]])
            if helper.fused_available and hist["route_ran"] != "fused":
                row["note"] = f"fused route constructed, but calls declined (policy or vote): {hist['declines']}"
            elif not helper.fused_available:
                row["note"] = f"helper declined at construction: {helper.stats()['construction']}"
        else:
            row.update(route_ran=c.route, plans=[], declines={})
        row["plan"] = row["plans"][-1] if row.get("plans") else None
        row["vote_us"] = 0.0
        if c.route == "fused" and helper is not None and p > 1:
            calls = helper.stats()["calls"] - c.mark
            recent = helper.vote_seconds(calls) if calls else []
            row["vote_us"] = timing.rank_max([statistics.median(recent) * 1e6 if recent else 0.0])[0]
        row["vote_share"] = (row["vote_us"] / 1e3 / row["median_ms"]) if row["median_ms"] else None

        # The transfer alone: the fused route's execute with the plan that ran (as exact as the voted call), the
        # NCCL route's all_to_all_single of the permuted send buffer; the peer exposes none.
        xfer = None
        if plan is not None:
            transport = product.transport(helper)
            row["transfer_what"] = "transport.execute"
            wrong += timing.rank_sum(oracle.count_bitwise_diff(transport.execute(x, geom, plan), ref))
            xfer = stats.median(timing.device_times(lambda: transport.execute(x, geom, plan), device, args.iters,
                                                    args.warmup))
        elif ours and p > 1:
            send = product.send_layout(x, row["mode"], p)
            recv = torch.empty_like(send)
            row["transfer_what"] = "all_to_all_single"
            xfer = stats.median(timing.device_times(
                lambda: dist.all_to_all_single(recv, send, group=sp.device_group), device, args.iters, args.warmup))
        else:
            row["transfer_what"] = None
        row["transfer_ms"] = xfer * 1e3 if xfer is not None else None
        row["gbps"] = stats.bandwidth_gbps(operand_bytes, p, xfer)
        row["gbps_latency"] = stats.bandwidth_gbps(operand_bytes, p, row["median_ms"] / 1e3 if row["median_ms"]
                                                   else None)

        # The floor of this operand size (measured once per size in this run).
        fl = state["floors"].get(operand_bytes // p if p > 1 else 0)
        row["floor_ms"] = fl["floor_ms"] if fl else None
        row["floor_ref"] = fl["floor_ref"] if fl else None
        row["floor_gbps"] = {k: v.get("gbps") for k, v in fl["refs"].items()} if fl else None
        row["nccl_p2p_ms"] = (fl["refs"].get("nccl") or {}).get("ms") if fl else None
        row["floor_fraction"] = (row["floor_ms"] / row["transfer_ms"]) if row["floor_ms"] and row["transfer_ms"] \
            else None
        row["latency_over_floor"] = (row["median_ms"] / row["floor_ms"]) if row["floor_ms"] and row["median_ms"] \
            else None
        if plan is not None:
            row.update(decomposition(helper, plan, geom, device, args, state["barrier"]))
        # Host overhead: host-to-completion minus the transfer's device time (vote, plan, launch, allocation), only
        # where the transfer timed is the whole op (the fused route's execute).
        row["host_overhead_us"] = ((row["median_ms"] - row["transfer_ms"]) * 1e3
                                   if plan is not None and row.get("median_ms") and row.get("transfer_ms") else None)
        row["host_overhead_aligned_us"] = ((row["aligned_median_ms"] - row["transfer_ms"]) * 1e3
                                           if row["host_overhead_us"] is not None and row.get("aligned_median_ms")
                                           else None)
        row["wrong"] = wrong
        row["wrong_oracle"] = ORACLE + (" (the op's output and the direct execute's)" if plan is not None else "")
        if args.overlap:
            row.update(overlap(args, c.fn, device, row["median_ms"]))
        if args.save_outputs:
            small = out.numel() * out.element_size() <= args.save_max_bytes
            state["saved"][f"{row['geometry']}/m{row['mode']}/{c.route}"] = (
                oracle.tensor_sha256(out), out.detach().cpu() if small else None)
        return row


def _f(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def decomposition(helper, plan, geom, device: torch.device, args, cache: dict) -> dict:
    """Parts of a fused call, each timed alone in this run (CUDA events, rank-max medians): ``barrier_pair_us``
    (two LSA barriers around a 16-byte push: what each chunk adds), ``copy_out_ms`` (a device copy of the bytes
    that arrive from peers: the copy-out tail a plan must hide or pay), ``chunks``, ``engine``. Collective."""
    out: dict = {"chunks": plan.num_chunks(geom), "engine": plan.engine}
    if device.type != "cuda" or not product.can_fabric_copy(helper):
        return out
    if "barrier_pair_us" not in cache:
        cache["barrier_pair_us"] = stats.median(timing.device_times(
            lambda: product.fabric_copy(helper, 16, engine=0, ctas=floor.SM_CTAS), device, args.iters,
            args.warmup)) * 1e6
    arriving = geom.operand_bytes * (geom.world_size - 1) // geom.world_size
    src = torch.empty(arriving, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_s = stats.median(timing.device_times(lambda: dst.copy_(src), device, args.iters, args.warmup))
    out.update(barrier_pair_us=cache["barrier_pair_us"], copy_out_ms=copy_s * 1e3)
    return out


def overlap(args, op: Callable[[], object], device: torch.device, op_ms: float | None) -> dict:
    """Slowdown of a bf16 GEMM chain on a side stream caused by back-to-back calls of ``op`` (CUDA only)."""
    from benchmarks.harness import lineup

    if device.type != "cuda":
        return {"gemm_slowdown": None, "overlap_note": "skipped: --overlap needs CUDA"}
    n = args.gemm_size
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    bmat = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    side = torch.cuda.Stream(device)

    def chain_ms(with_op: bool, calls: int) -> float:
        lineup.barrier()
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(side):
            start.record(side)
            for _ in range(args.gemm_chain):
                torch.mm(a, bmat)
            end.record(side)
        if with_op:
            for _ in range(calls):
                op()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end)

    chain_ms(False, 0)
    alone = timing.rank_max([statistics.median(chain_ms(False, 0) for _ in range(5))])[0]
    calls = max(1, math.ceil(alone / op_ms)) if op_ms else 1
    chain_ms(True, calls)
    beside = timing.rank_max([statistics.median(chain_ms(True, calls) for _ in range(5))])[0]
    return {"gemm_chain_ms": alone, "gemm_chain_beside_ms": beside, "overlap_calls": calls,
            "gemm_slowdown": beside / alone - 1.0}


def save_outputs(directory: str, rank: int, saved: dict[str, tuple[str, torch.Tensor | None]]) -> None:
    """``rank{r}.safetensors``: the kept outputs (CPU copies up to --save-max-bytes); metadata: every SHA-256."""
    from safetensors.torch import save_file

    Path(directory).mkdir(parents=True, exist_ok=True)
    meta = {k: sha for k, (sha, _) in saved.items()}
    kept = {k: t.contiguous() for k, (_, t) in saved.items() if t is not None}
    save_file(kept, str(Path(directory) / f"rank{rank}.safetensors"), metadata=meta)


CASE = A2ACase()
