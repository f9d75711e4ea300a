"""The floor: how fast the fabric moves an all-to-all's bytes with no relayout, measured in the same run.

Each reference moves ``operand / P`` bytes from every rank to every peer, every direction at once:

* ``p2p``: the standard bidirectional peer copy, as CUDA's ``p2pBandwidthLatencyTest`` measures it: a
  device-to-device copy between every ordered pair of the ranks' GPUs at once, each direction on its own stream
  (torch's cross-device ``copy_``: ``cudaMemcpyAsync`` with peer access, the copy engines). One process drives
  every GPU (rank 0; it needs every rank's GPU visible, as on a single host), the other ranks wait. The streams
  are held behind a sleep kernel until every copy is queued, so the time is the copies', not their launch.
* ``ce``: ``fvk_fabric_copy`` with the copy engines into the peers' registered windows (barrier, copies,
  barrier: what a collective transfer pays), through the native transport.
* ``sm``: the same with SM stores (``SM_CTAS`` CTAs).
* ``nccl``: NCCL send/recv of the same bytes (``batch_isend_irecv``), for comparison; not a floor candidate.

The floor is the fastest candidate measured (``floor_ms``, ``floor_ref``). Rates are GB/s per direction (bytes
each way / time). As a case (``python -m benchmarks.run floor``) it prints one row per geometry, for the bytes
each rank sends each peer at the run's SP size (at SP2: half of one rank's operand each way). With fewer than 2
GPUs it skips; on CPU it is a dry run of the same copies between host buffers (rows marked ``dry_run``).
"""

from __future__ import annotations

import argparse
from typing import ClassVar

import torch
import torch.distributed as dist

from benchmarks.harness import lineup, oracle, product, report, stats, timing
from benchmarks.harness.case import Case, Context
from benchmarks.harness.cli import divisible, input_shape

SM_CTAS = 264  # two CTAs per SM on 132-SM H200/H100: the SM engine's flat stores
CANDIDATES = ("p2p", "ce", "sm")
REFS = (*CANDIDATES, "nccl")
P2P_ORACLE = "each destination buffer vs its source (bitwise), every ordered pair"


def _sleep_hold(pairs: int) -> bool:
    """Hold the current stream behind a sleep kernel long enough to queue ``pairs`` copies (torch's private
    ``_sleep``; False where this torch lacks it)."""
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is None:
        return False
    sleep(1_000_000 + 400_000 * pairs)  # ~0.5 ms + ~0.2 ms per copy at H200 clocks: longer than queuing them
    return True


def peer_copy(nbytes: int, devices: list[torch.device], iters: int, warmup: int, seed: int = 0,
              pairs: list[tuple[int, int]] | None = None) -> dict:
    """Every ordered pair of ``devices`` (or ``pairs``: (source, destination) indices) copies ``nbytes`` at once,
    each on its own stream; per sample the time from a start event (after the hold) to the last copy's end, on the
    first device. Local: this process drives every device. On CPU (all devices ``cpu``) the same copies run one
    after the other (a dry run). Blocks the host.

    Returns ``{"seconds": [...], "wrong": n, "held": bool, "pairs": n}``."""
    n = len(devices)
    cuda = devices[0].type == "cuda"
    src = [oracle.make_input((nbytes,), torch.uint8, d, seed + i) for i, d in enumerate(devices)]
    if pairs is None:
        pairs = [(i, j) for i in range(n) for j in range(n) if i != j]
    dst = {(i, j): torch.empty(nbytes, dtype=torch.uint8, device=devices[j]) for i, j in pairs}
    held = False
    seconds = []
    if cuda:
        streams = {(i, j): (torch.cuda.Stream(devices[i]), torch.cuda.Stream(devices[j])) for i, j in pairs}
        clock = torch.cuda.Stream(devices[0])

        def exchange() -> float:
            nonlocal held
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(clock):
                held = _sleep_hold(len(pairs))
                start.record(clock)
            done = []
            for (i, j), (s_src, s_dst) in streams.items():
                s_src.wait_event(start)
                # The copy runs on the source device's current stream and is fenced against the destination's
                # current stream: a stream pair of its own per direction keeps the directions independent.
                with torch.cuda.stream(s_src), torch.cuda.stream(s_dst):
                    dst[(i, j)].copy_(src[i], non_blocking=True)
                event = torch.cuda.Event()
                event.record(s_src)
                done.append(event)
            for event in done:
                clock.wait_event(event)
            end.record(clock)
            end.synchronize()
            return start.elapsed_time(end) / 1e3
    else:
        import time

        def exchange() -> float:
            t0 = time.perf_counter()
            for i, j in pairs:
                dst[(i, j)].copy_(src[i])
            return time.perf_counter() - t0

    for _ in range(warmup):
        exchange()
    for _ in range(iters):
        seconds.append(exchange())
    wrong = sum(oracle.count_bitwise_diff(dst[(i, j)], src[i]) for i, j in pairs)
    return {"seconds": seconds, "wrong": wrong, "held": held, "pairs": len(pairs)}


def p2p_reference(nbytes_per_peer: int, device: torch.device, iters: int, warmup: int, *,
                  dry_run: bool = False) -> dict:
    """The ``p2p`` reference for the run's ranks: rank 0 copies between every rank's GPU (``cuda:0..P-1``; at SP1
    between ``cuda:0`` and ``cuda:1``) while the others wait. Collective over the SP group. Returns the reference,
    or ``{"skipped": why}`` (fewer than 2 GPUs visible; on CPU unless ``dry_run``)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    need = max(world, 2)
    why = None
    if device.type != "cuda" and not dry_run:
        why = "needs CUDA GPUs"
    elif device.type == "cuda" and torch.cuda.device_count() < need:
        why = f"needs {need} GPUs visible in one process ({torch.cuda.device_count()} visible)"
    why = next((w for w in timing.gather(why) if w), None)  # every rank takes the same branch
    if why is None and device.type == "cuda" and world > 1 and not lineup.same_host():
        why = "ranks on more than one host"
    if why is not None:
        return {"skipped": why}
    measured: dict | None = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        devices = [torch.device("cuda", i) if device.type == "cuda" else torch.device("cpu") for i in range(need)]
        try:
            measured = peer_copy(nbytes_per_peer, devices, iters, warmup)
        except torch.cuda.OutOfMemoryError as exc:
            measured = {"skipped": f"out of memory for {nbytes_per_peer} B per pair: {exc}"}
    result = timing.gather(measured)[0]  # rank 0's measurement; the other ranks wait here while it runs
    if "skipped" not in result:
        seconds = result.pop("seconds")
        t = stats.median(seconds)
        result.update(ms=t * 1e3, gbps=stats.rate_gbps(nbytes_per_peer, t), bytes=nbytes_per_peer,
                      spread=stats.summarize(seconds), dry_run=device.type != "cuda")
    return result


def fabric_reference(helper, nbytes_per_peer: int, device: torch.device, iters: int, warmup: int) -> dict:
    """The ``ce`` and ``sm`` references through ``fvk_fabric_copy``. A push larger than the window's share
    ((P + 1) x bytes <= window) is timed at the largest size that fits and scaled linearly
    (``measured_bytes``). Collective. Returns ``{"ce": ref, "sm": ref}``, each possibly ``{"skipped": why}``."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    why = None
    if world < 2:
        why = "SP1: no peer"
    elif device.type != "cuda":
        why = "needs the native transport (CUDA)"
    elif not product.can_fabric_copy(helper):
        why = "the native transport is not constructed, or its library lacks fvk_fabric_copy"
    if why is None:
        measured = min(nbytes_per_peer, helper.window_bytes // (world + 1)) // 16 * 16
        if measured < 16:
            why = "fewer than 16 bytes per peer fit the window"
    if why is not None:
        return {"ce": {"skipped": why}, "sm": {"skipped": why}}
    scale = nbytes_per_peer / measured
    out = {}
    for engine, label in ((0, "ce"), (1, "sm")):
        t = stats.median(timing.device_times(
            lambda engine=engine: product.fabric_copy(helper, measured, engine=engine, ctas=SM_CTAS), device, iters,
            warmup)) * scale
        out[label] = {"ms": t * 1e3, "gbps": stats.rate_gbps(nbytes_per_peer, t), "bytes": nbytes_per_peer,
                      "measured_bytes": measured}
    return out


def nccl_reference(nbytes_per_peer: int, device: torch.device, iters: int, warmup: int) -> dict:
    """Every rank sends ``nbytes_per_peer`` to each peer and receives as much, at once, through NCCL send/recv
    (gloo on CPU). Collective."""
    from fastvideo.distributed.parallel_state import get_sp_group

    sp = get_sp_group()
    p, me = sp.world_size, sp.rank_in_group
    if p < 2 or nbytes_per_peer == 0:
        return {"skipped": "SP1: no peer"}
    send = torch.ones(p, nbytes_per_peer, dtype=torch.uint8, device=device)
    recv = torch.empty_like(send)

    def exchange() -> None:
        ops = []
        for q in range(p):
            if q != me:
                ops.append(dist.P2POp(dist.isend, send[q], sp.ranks[q], group=sp.device_group))
                ops.append(dist.P2POp(dist.irecv, recv[q], sp.ranks[q], group=sp.device_group))
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    t = stats.median(timing.device_times(exchange, device, iters, warmup))
    return {"ms": t * 1e3, "gbps": stats.rate_gbps(nbytes_per_peer, t), "bytes": nbytes_per_peer}


def measure(helper, nbytes_per_peer: int, device: torch.device, iters: int, warmup: int,
            candidates: tuple[str, ...] = CANDIDATES, *, dry_run: bool = False) -> dict:
    """Every reference for ``nbytes_per_peer`` and the floor: ``{"refs": {name: ref}, "floor_ms", "floor_ref"}``
    (``floor_ms`` None where no candidate ran). Collective."""
    refs: dict[str, dict] = {}
    if "p2p" in candidates:
        refs["p2p"] = p2p_reference(nbytes_per_peer, device, iters, warmup, dry_run=dry_run)
    if {"ce", "sm"} & set(candidates):
        fabric = fabric_reference(helper, nbytes_per_peer, device, iters, warmup)
        refs.update({k: v for k, v in fabric.items() if k in candidates})
    refs["nccl"] = nccl_reference(nbytes_per_peer, device, iters, warmup)
    timed = {k: v["ms"] for k, v in refs.items() if k in candidates and "ms" in v}
    best = min(timed, key=timed.get) if timed else None
    return {"refs": refs, "floor_ms": timed.get(best), "floor_ref": best}


def ref_gbps(refs: dict, name: str) -> float | None:
    return (refs.get(name) or {}).get("gbps")


class FloorCase(Case):
    name = "floor"
    summary = "the fabric's floor per geometry: bidirectional peer copy, copy-engine push, SM-store push"
    key = ("geometry",)
    metric = "floor_ms"
    defaults: ClassVar[dict] = {"iters": 20, "warmup": 3}
    quick: ClassVar[dict] = {"iters": 3, "warmup": 1}
    columns = (
        report.Column("geometry", "geometry", width=12),
        report.Column("bytes_each_way", "MB each way", fmt=".1f", scale=1e-6),
        report.Column("p2p_gbps", "p2p GB/s", fmt=".1f", get=lambda r: ref_gbps(r["refs"], "p2p")),
        report.Column("ce_gbps", "ce GB/s", fmt=".1f", get=lambda r: ref_gbps(r["refs"], "ce")),
        report.Column("sm_gbps", "sm GB/s", fmt=".1f", get=lambda r: ref_gbps(r["refs"], "sm")),
        report.Column("nccl_gbps", "nccl GB/s", fmt=".1f", get=lambda r: ref_gbps(r["refs"], "nccl")),
        report.Column("floor_ms", "floor ms"),
        report.Column("floor_ref", "floor"),
    )

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--mib", help="comma list of bytes per peer in MiB (instead of geometries)")
        parser.add_argument("--at-sp", type=int, default=0,
                            help="the SP size whose byte counts to move (default: the run's, at least 2)")
        parser.add_argument("--refs", default=",".join(CANDIDATES),
                            help=f"floor candidates ({', '.join(CANDIDATES)}); nccl send/recv is always measured")

    def details(self, row: dict) -> list[str]:
        return [f"{name}: {ref['skipped']}" for name, ref in row["refs"].items() if "skipped" in ref]

    def run(self, ctx: Context) -> None:
        args = ctx.args
        candidates = tuple(c.strip() for c in args.refs.split(",") if c.strip())
        unknown = set(candidates) - set(CANDIDATES)
        if unknown:
            raise SystemExit(f"--refs: {sorted(unknown)} not among {', '.join(CANDIDATES)}")
        at_sp = args.at_sp or max(ctx.world, 2)
        dry_run = ctx.device.type != "cuda"
        if dry_run:
            ctx.note("CPU: a dry run of the peer copies between host buffers (timings mean nothing)")
        elif torch.cuda.device_count() < 2:
            ctx.note(f"{torch.cuda.device_count()} GPU visible: the p2p reference needs 2")
        # The ce and sm references run through the native transport of the op's helper (collective to build).
        helper = product.default_helper(ctx.device) if ctx.world > 1 and not dry_run else None
        sizes: list[tuple[str, int]]
        if args.mib:
            sizes = [(f"{m} MiB", int(m) << 20) for m in args.mib.split(",")]
        else:
            sizes = []
            for name, shape in ctx.geometries():
                why = divisible(shape, at_sp)
                if why:
                    ctx.skip(why, geometry=name, refs={})
                    continue
                b, s, h, d = input_shape(shape, 0, at_sp)
                sizes.append((name, b * s * h * d * ctx.dtype.itemsize // at_sp))
        ctx.header.update(at_sp=at_sp, floor_candidates=list(candidates), dry_run=dry_run,
                          floor_definition=__doc__.split("\n\n")[1].strip())
        ctx.progress.total = len(sizes)
        for name, nbytes in sizes:
            res = measure(helper, nbytes, ctx.device, args.iters, args.warmup, candidates, dry_run=dry_run)
            p2p = res["refs"].get("p2p", {})
            checked = "wrong" in p2p
            ctx.add_row({"geometry": name, "bytes_each_way": nbytes, "at_sp": at_sp, **res,
                         "wrong": int(p2p["wrong"]) if checked else None,
                         "wrong_oracle": P2P_ORACLE if checked else "none: no p2p copy ran",
                         **({} if checked else {"wrong_note": "the ce and sm pushes land in peers' windows, which "
                                                              "are not readable here: not compared"})})
            ctx.advance(name)
            if ctx.device.type == "cuda":
                torch.cuda.empty_cache()


CASE = FloorCase()
