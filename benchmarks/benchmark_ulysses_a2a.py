"""Ulysses all-to-all benchmark: NCCL route vs fused route, host-to-completion, with exactness per row.

Launch (one process per GPU; the SP group spans all ranks):

    torchrun --standalone --nproc_per_node=2 benchmarks/benchmark_ulysses_a2a.py --json a2a.json
    torchrun --standalone --nproc_per_node=2 benchmarks/benchmark_ulysses_a2a.py --geometry h3-250k --overlap
    torchrun --standalone --nproc_per_node=1 benchmarks/benchmark_ulysses_a2a.py          # SP1: routes degenerate
    torchrun --standalone --nproc_per_node=2 benchmarks/benchmark_ulysses_a2a.py --device cpu --geometry toy --quick
    python benchmarks/benchmark_ulysses_a2a.py --compare-revs /tmp/rev_a /tmp/rev_b --nproc 2 -- --geometry h3-32k

Rows: every ``--geometry`` x ``--modes`` x ``--routes``. Route ``off`` is ``FASTVIDEO_ULYSSES_A2A=off``
(the NCCL baseline: permute + all_to_all_single + permute); ``auto`` votes on every call and takes the
fused route where every rank agrees (on CPU the helper is built on ``GlooPlanTransport`` so the whole
fused pipeline runs over gloo; its timings mean nothing). Columns:

* ``median/p10/p90 ms``: host-to-completion latency of the public op, vote included: ``perf_counter``
  around the call plus a device synchronize, ranks lined up by a barrier before each iteration, rank-max
  per iteration, over ``--iters`` (>= 50 by default) iterations after ``--warmup``.
* ``vote us``: median per-call vote time of the row (the helper's own vote timings; 0 for ``off``),
  ``vote %`` its share of the median latency.
* ``xfer ms``: the transfer alone, CUDA events around ``all_to_all_single`` of the send layout (``off``)
  or around ``helper.transport.execute`` with the plan the helper ran (``auto``); rank-max median.
* ``GB/s``: bytes moved per rank / xfer time (``common.bandwidth_gbps``; bytes moved per rank =
  operand bytes x (P-1)/P).
* ``fabric %``: the fabric's limit / xfer time. The limit (``fabric_reference``) moves the same bytes
  per rank to the same peers, all ranks and directions at once, as a flat push into the peers' windows
  (no relayout; barrier, copies, barrier), measured in the same run for each geometry with both engines:
  the copy engines (``fabric_ce_gbps``) and SM stores (``fabric_sm_gbps``); the better one is the limit
  (``fabric_engine`` says which). The JSON also carries NCCL send/recv of the same bytes
  (``nccl_p2p_ms``), which on 2x H200 is slower than the fabric (226 against 390 GB/s). (Before
  2026-11-29 the limit was a CUDA-IPC ``copy_`` that ran at ~31 GB/s on 2x H200: not the peer path.)
* ``host us``: host-to-completion median minus the transfer's device time (vote, plan, launch,
  allocation): ``host_overhead_us`` in the JSON.
* Line-up (``--lineup``, the header's ``lineup``): before each timed iteration (latency, transfer, fabric) the
  ranks meet at a same-host shared-memory spin barrier (``shm``: exit skew under a microsecond) where every
  rank is on one host and loads the kernel library, else at a gloo barrier, whose exit skew (median 39 us at
  SP2 on the 2-core CI VM) the first rank out pays inside the timed call. Each row also carries the same
  iterations timed from the last rank's entry (``aligned_median_ms``, ``host_overhead_aligned_us``: max end -
  max start on the host's one monotonic clock) and the entry skew the line-up left (``entry_skew_us``).
* ``wrong``: elements whose bits differ from the NCCL route's output for the same input (``nccl_route``
  computed in the same row), summed over ranks, for the op's output and (auto rows) the direct
  ``transport.execute`` output. The script exits 1 when any row has wrong > 0 (and,
  with ``--require-fused``, when an ``auto`` row at SP >= 2 did not run the fused route).
* ``ran``: what the helper's history says actually ran for the row (``fused`` / ``nccl`` / ``mixed``),
  with the plan and any decline reasons in the JSON (``route_ran``, ``plan``, ``declines``).

``--overlap`` (CUDA only) runs a bf16 GEMM chain on a side stream alone and then beside back-to-back
op calls of each route, and reports the chain's slowdown. ``--compare-revs DIR_A DIR_B`` runs this
script with identical benchmark arguments against two exported trees (``FASTVIDEO_BENCH_TREE``),
interleaved A/B/A/B, prints per-row latency ratios B/A, and compares the outputs each revision saved
(``--save-outputs``) bit for bit.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import common  # first: puts the FastVideo tree under test on sys.path
import torch
import torch.distributed as dist

from fastvideo.distributed.communication_op import (
    _send_layout,
    nccl_route,
    sequence_model_parallel_all_to_all_4D,
)
from fastvideo.distributed.parallel_state import get_sp_group
from fastvideo.distributed.ulysses.policy import Geometry

# (B, S_global, H, D); h3 presets are packed QKV (B = 3 planes).
PRESETS: dict[str, tuple[int, int, int, int]] = {
    "wan720p": (1, 75600, 40, 128),
    "h3-32k": (3, 32768, 56, 128),
    "h3-128k": (3, 131072, 56, 128),
    "h3-250k": (3, 250000, 56, 128),
    "toy": (3, 512, 8, 32),
}
DEFAULT_GEOMETRIES = ("wan720p", "h3-32k", "h3-128k", "h3-250k")
MODE_DIMS = {0: (2, 1), 1: (1, 2)}
COMPARE_ONLY = {"--compare-revs": 2, "--rounds": 1, "--nproc": 1, "--json": 1, "--save-outputs": 1,
                "--compare-out": 1, "--tree-libraries": 0}


def parse_geometry(text: str) -> tuple[str, tuple[int, int, int, int]]:
    if text in PRESETS:
        return text, PRESETS[text]
    try:
        b, s, h, d = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--geometry {text!r}: use a preset ({', '.join(PRESETS)}) or B,S_global,H,D") from None
    return f"{b}x{s}x{h}x{d}", (b, s, h, d)


def add_device_and_geometry_args(p: argparse.ArgumentParser) -> None:
    """``--device`` and ``--geometry``, shared with tune_ulysses_a2a.py."""
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--geometry", action="append", type=parse_geometry,
                   help=f"preset ({', '.join(PRESETS)}) or B,S_global,H,D; repeatable (default: "
                        f"{', '.join(DEFAULT_GEOMETRIES)}; 'toy' on CPU)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_device_and_geometry_args(p)
    p.add_argument("--modes", default="0,1", help="comma list of modes: 0 = (2,1) before attention, 1 = (1,2) after")
    p.add_argument("--routes", default="off,auto", help="comma list of FASTVIDEO_ULYSSES_A2A values")
    p.add_argument("--dtype", choices=sorted(common.DTYPES), default="bf16")
    p.add_argument("--iters", type=int, default=50, help="timed iterations per row (>= 50 for the latency stats)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--quick", action="store_true", help="smoke run: 5 iterations, 2 warm-up")
    p.add_argument("--overlap", action="store_true", help="GEMM-chain slowdown beside each route (CUDA only)")
    p.add_argument("--gemm-size", type=int, default=8192, help="--overlap: square bf16 GEMM size")
    p.add_argument("--gemm-chain", type=int, default=20, help="--overlap: GEMMs in the chain")
    p.add_argument("--require-fused", action="store_true",
                   help="exit 1 unless every auto row at SP >= 2 actually ran the fused route (helper history)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--lineup", choices=common.LINEUPS, default="auto",
                   help="how ranks are lined up before each timed iteration: a same-host shared-memory spin "
                        "barrier (shm; auto where every rank is on one host and loads the kernel library) or "
                        "a gloo barrier, whose exit skew the first rank out pays inside the timed call")
    p.add_argument("--tuned-from", metavar="TUNE_JSON",
                   help="replace the helper's TUNED_TABLE with the rows a tune_ulysses_a2a.py JSON chose "
                        "(tuned_rows_data): the policy then picks from those measured rows; the header records them")
    p.add_argument("--json", help="write the header and rows here (rank 0)")
    p.add_argument("--save-outputs",
                   help="directory: each rank saves its outputs with safetensors (rank{r}.safetensors)")
    p.add_argument("--save-max-bytes", type=int, default=512 << 20,
                   help="--save-outputs: tensors above this keep only their SHA-256 (in the file's metadata)")
    p.add_argument("--compare-revs", nargs=2, metavar=("DIR_A", "DIR_B"),
                   help="run the benchmark against two exported trees, A/B/A/B, and compare "
                        "(launch with plain python, not torchrun)")
    p.add_argument("--rounds", type=int, default=2, help="--compare-revs: A/B rounds")
    p.add_argument("--tree-libraries", action="store_true",
                   help="--compare-revs: each tree runs its own kernel loader (TREE/fastvideo-kernel first on "
                        "PYTHONPATH) and its own build (TREE/build/kernel/libfastvideo_ulysses_a2a.so, which must "
                        "exist): for revisions whose Python cannot drive the other's library ABI")
    p.add_argument("--nproc", type=int, default=2, help="--compare-revs: processes per run")
    p.add_argument("--compare-out", help="--compare-revs: where runs keep their JSON and outputs (default: a temp dir)")
    return p


# ---------------------------------------------------------------------------------------------- one row


def make_input(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, seed: int) -> torch.Tensor:
    """Deterministic input (the same bits for the same seed in every revision and route)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)


def nccl_p2p_reference(nbytes_per_peer: int, device: torch.device, iters: int, warmup: int) -> float | None:
    """Median seconds for every rank to send ``nbytes_per_peer`` to each peer and receive as much, at once,
    through NCCL send/recv (``batch_isend_irecv``). Kept for comparison: slower than the fabric (226 GB/s
    against 390 on 2x H200), so it is not the limit."""
    sp = get_sp_group()
    p, me = sp.world_size, sp.rank_in_group
    if p < 2 or nbytes_per_peer == 0:
        return None
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

    return common.median(common.device_times(exchange, device, iters, warmup))


FABRIC_SM_CTAS = 264  # two CTAs per SM on 132-SM H200/H100: the SM engine's flat stores


def _native_testing():
    """``tests.kernel.native_testing`` (its ``fabric_copy``), or None where the tree under test has none. The fabric
    copy runs only when the job's kernel library is the test library
    (``FASTVIDEO_KERNEL_LIBRARY=.../libfastvideo_ulysses_a2a_testing.so``); else it raises ``TestingUnavailable``
    alike on every rank, before anything is enqueued."""
    try:
        from tests.kernel import native_testing
    except ImportError:
        return None
    return native_testing


def fabric_reference(helper, nbytes_per_peer: int, device: torch.device, iters: int, warmup: int) -> dict | None:
    """The fabric's limit, measured in this run: the better of two flat pushes of ``nbytes_per_peer`` into
    every peer's window, all ranks and directions at once (``fvk_fabric_copy``): copy engines (one
    ``cudaMemcpyAsync`` per peer through the LSA-mapped pointers) and SM stores (``FABRIC_SM_CTAS`` CTAs).
    Each iteration is barrier, copies, barrier, as any collective transfer is. A push larger than the
    window's share ((P + 1) x bytes <= window) is timed at the largest size that fits and scaled linearly.

    Returns ``{"fabric_ms", "fabric_engine", "fabric_ce_gbps", "fabric_sm_gbps", "fabric_measured_bytes"}``
    or None without the native transport (CPU, SP1, an older kernel). Collective over the SP group.
    """
    sp = get_sp_group()
    p = sp.world_size
    transport = getattr(helper, "transport", None) if helper is not None else None
    testing = _native_testing()
    if p < 2 or nbytes_per_peer == 0 or device.type != "cuda" or transport is None or testing is None:
        return None
    if not helper.fused_available:
        return None
    window = helper.window_bytes
    measured = min(nbytes_per_peer, window // (p + 1)) // 16 * 16
    if measured < 16:  # an operand below 16 bytes per peer, or a tiny window: nothing to time
        return None
    scale = nbytes_per_peer / measured
    times = {}
    for engine, label in ((0, "ce"), (1, "sm")):
        try:
            t = common.median(common.device_times(lambda engine=engine: testing.fabric_copy(
                transport, measured, engine=engine, ctas=FABRIC_SM_CTAS), device, iters, warmup))
        except testing.TestingUnavailable as exc:
            print(f"fabric reference not measured: {exc}", flush=True)
            return None
        times[label] = t * scale
    best = min(times, key=times.get)
    moved = nbytes_per_peer * (p - 1)
    return {"fabric_ms": times[best] * 1e3, "fabric_engine": best,
            "fabric_ce_gbps": moved / times["ce"] / 1e9, "fabric_sm_gbps": moved / times["sm"] / 1e9,
            "fabric_measured_bytes": measured}


def decomposition(helper, plan, geom: Geometry, x: torch.Tensor, device: torch.device, args, cache: dict) -> dict:
    """Parts of a fused call, each timed alone in this run (CUDA events, rank-max medians), so the next step is
    chosen from data: ``barrier_pair_us`` (two LSA barriers around a 16-byte push: what each chunk adds),
    ``copy_out_ms`` (a device copy of the bytes that arrive from peers: the on-device work the plan must hide
    or pay), ``chunks``; and the model ``fabric + chunks x barrier pair + copy-out / chunks`` (the copy-out of
    the last chunk is the part no pipelining hides) beside the measured transfer."""
    transport = helper.transport
    out: dict = {"chunks": plan.num_chunks(geom), "engine": plan.engine}
    testing = _native_testing()
    if device.type != "cuda" or testing is None:
        return out
    if "barrier_pair_us" not in cache:
        try:
            cache["barrier_pair_us"] = common.median(common.device_times(
                lambda: testing.fabric_copy(transport, 16, engine=0), device, args.iters, args.warmup)) * 1e6
        except testing.TestingUnavailable as exc:
            print(f"decomposition not measured: {exc}", flush=True)
            return out
    arriving = geom.operand_bytes * (geom.world_size - 1) // geom.world_size
    src = torch.empty(arriving, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_s = common.median(common.device_times(lambda src=src, dst=dst: dst.copy_(src), device, args.iters,
                                               args.warmup))
    del src, dst
    out.update(barrier_pair_us=cache["barrier_pair_us"], copy_out_ms=copy_s * 1e3)
    return out


def vote_times_us(helper, n_calls: int) -> float | None:
    """Median vote time (us) of the last ``n_calls`` calls of ``helper``, rank-max; None without votes."""
    if helper is None or n_calls == 0:
        return None
    recent = helper.vote_seconds(n_calls)
    local = statistics.median(recent) * 1e6 if recent else (helper.stats().get("vote_us_median") or 0.0)
    return common.rank_max([local])[0]


def summarize_history(helper, since_seq: int) -> dict:
    """What the helper's history says ran since ``since_seq``: routes, plans, decline reasons."""
    records = [r for r in helper.history if r.seq >= since_seq]
    routes = collections.Counter(r.route for r in records)
    plans = sorted({(r.plan.word, r.plan) for r in records if r.plan is not None}, key=lambda t: t[0])
    reasons = collections.Counter(r.reason.label for r in records if r.reason is not None)
    ran = "fused" if set(routes) == {"fused"} else "nccl" if set(routes) == {"nccl"} else "mixed" if routes else "none"
    return {"route_ran": ran, "calls": dict(routes), "plans": [p for _, p in plans], "declines": dict(reasons)}


def run_row(args, name, shape_global, mode, route, helper, dtype, device, fabric_cache, saved) -> dict:
    sp = get_sp_group()
    p, rank = sp.world_size, sp.rank_in_group
    b, s, h, d = shape_global
    if h % p or s % p:
        return {"geometry": name, "mode": mode, "route": route, "skipped": f"H={h} or S={s} not divisible by SP{p}"}
    in_shape = (b, s // p, h, d) if mode == 0 else (b, s, h // p, d)
    seed = args.seed + 1000 * rank + 7 * mode + sum(shape_global)
    x = make_input(in_shape, dtype, device, seed)
    geom = Geometry.from_input(x.shape, mode, p, dtype)
    operand_bytes = x.numel() * x.element_size()
    ref = nccl_route(x, mode, sp.device_group) if p > 1 else x
    common.set_route(route)
    scatter, gather = MODE_DIMS[mode]

    def op() -> torch.Tensor:
        return sequence_model_parallel_all_to_all_4D(x, scatter_dim=scatter, gather_dim=gather)

    use_helper = route == "auto" and p > 1 and helper is not None
    mark = helper.stats()["calls"] if use_helper else 0
    timings = common.host_timings(op, device, args.iters, args.warmup)
    lat = timings["rank_max"]
    out = op()
    common.synchronize(device)
    wrong = common.rank_sum(common.count_bitwise_diff(out, ref))
    row: dict = {"geometry": name, "shape_global": list(shape_global), "input_shape": list(in_shape), "mode": mode,
                 "route": route, "dtype": str(dtype).replace("torch.", ""), "sp_size": p,
                 "operand_bytes_per_rank": operand_bytes,
                 "bytes_moved_per_rank": common.bytes_moved_per_rank(operand_bytes, p), **common.summarize(lat)}
    # The same iterations from the last rank's entry (same-host clock), and what the line-up left between entries.
    aligned = common.summarize(timings["aligned"])
    row.update(aligned_median_ms=aligned["median_ms"], aligned_p10_ms=aligned["p10_ms"],
               aligned_p90_ms=aligned["p90_ms"],
               entry_skew_us=(common.median(timings["entry_skew"]) or 0.0) * 1e6 if timings["entry_skew"] else None)

    # What actually ran.
    plan = None
    if p == 1:
        row.update(route_ran="identity (SP1)", plans=[], declines={})
    elif route == "off":
        row.update(route_ran="nccl", plans=[], declines={})
    else:
        hist = summarize_history(helper, mark)
        plan = hist["plans"][-1] if hist["route_ran"] == "fused" else None
        row.update(route_ran=hist["route_ran"], calls=hist["calls"], declines=hist["declines"],
                   plans=[pl.describe(geom) for pl in hist["plans"]])
        if helper.fused_available and hist["route_ran"] != "fused":
            row["note"] = f"fused route constructed, but the calls declined (policy or vote): {hist['declines']}"
        elif not helper.fused_available:
            row["note"] = f"helper declined at construction: {helper.stats()['construction']}"
    row["plan"] = row["plans"][-1] if row.get("plans") else None
    n_votes = (args.iters + args.warmup + 1) if use_helper and helper.construction_reason is None else 0
    row["vote_us"] = vote_times_us(helper, n_votes) if use_helper else 0.0
    if row["vote_us"] is None:
        row["vote_us"] = 0.0
    row["vote_share"] = (row["vote_us"] / 1e3 / row["median_ms"]) if row["median_ms"] else None

    # The transfer alone.
    if plan is not None:
        def transfer() -> object:
            return helper.transport.execute(x, geom, plan)
        row["transfer_what"] = "transport.execute"
        # The direct execute must be as exact as the voted call.
        wrong += common.rank_sum(common.count_bitwise_diff(transfer(), ref))
    else:
        send = _send_layout(x, mode, p)
        recv = torch.empty_like(send)

        def transfer() -> object:
            return dist.all_to_all_single(recv, send, group=sp.device_group)
        row["transfer_what"] = "all_to_all_single"
    xfer = common.median(common.device_times(transfer, device, args.iters, args.warmup))
    row["transfer_ms"] = xfer * 1e3 if xfer is not None else None
    row["gbps"] = common.bandwidth_gbps(operand_bytes, p, xfer)
    row["gbps_latency"] = common.bandwidth_gbps(operand_bytes, p, row["median_ms"] / 1e3 if row["median_ms"] else None)

    # The fabric's limit (the better of copy engines and SM stores into the peers' windows, all directions
    # at once), once per operand size; NCCL send/recv beside it for comparison.
    key = operand_bytes
    if key not in fabric_cache:
        per_peer = operand_bytes // p if p > 1 else 0
        fabric_cache[key] = (fabric_reference(helper, per_peer, device, args.iters, args.warmup),
                             nccl_p2p_reference(per_peer, device, args.iters, args.warmup))
    fab, p2p = fabric_cache[key]
    if fab:
        row.update(fab)
        row["fabric_reference"] = ("flat push into the peers' windows, all ranks at once; best engine: "
                                   f"{fab['fabric_engine']}")
    else:
        row.update(fabric_reference=None, fabric_ms=None)
    row["fabric_fraction"] = (row["fabric_ms"] / 1e3 / xfer) if row["fabric_ms"] and xfer else None
    row["nccl_p2p_ms"] = p2p * 1e3 if p2p else None
    if plan is not None:
        row.update(decomposition(helper, plan, geom, x, device, args, fabric_cache))
    # Host overhead: host-to-completion minus the device time of the transfer (vote, plan, launch).
    # Only where the transfer timed is the whole op (the fused route's execute): on the NCCL route it is
    # all_to_all_single without the permutes, and at SP1 the op returns its input.
    row["host_overhead_us"] = ((row["median_ms"] - row["transfer_ms"]) * 1e3
                               if plan is not None and row.get("median_ms") and row.get("transfer_ms") else None)
    # The same from the last rank's entry: the line-up's exit skew left out.
    row["host_overhead_aligned_us"] = ((row["aligned_median_ms"] - row["transfer_ms"]) * 1e3
                                       if row["host_overhead_us"] is not None and row.get("aligned_median_ms")
                                       else None)
    row["wrong"] = wrong

    if args.overlap:
        row.update(overlap(args, op, device, row["median_ms"]))
    if args.save_outputs:
        small = out.numel() * out.element_size() <= args.save_max_bytes
        saved[f"{name}/m{mode}/{route}"] = (common.tensor_sha256(out), out.detach().cpu() if small else None)
    return row


def overlap(args, op, device: torch.device, op_ms: float | None) -> dict:
    """Slowdown of a bf16 GEMM chain on a side stream caused by back-to-back calls of ``op`` (CUDA only)."""
    if device.type != "cuda":
        return {"gemm_slowdown": None, "overlap_note": "skipped: --overlap needs CUDA"}
    n = args.gemm_size
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    bmat = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    side = torch.cuda.Stream(device)

    def chain_ms(with_op: bool, calls: int) -> float:
        common.barrier()
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
    alone = common.rank_max([statistics.median(chain_ms(False, 0) for _ in range(5))])[0]
    calls = max(1, math.ceil(alone / op_ms)) if op_ms else 1
    chain_ms(True, calls)
    beside = common.rank_max([statistics.median(chain_ms(True, calls) for _ in range(5))])[0]
    return {"gemm_chain_ms": alone, "gemm_chain_beside_ms": beside, "overlap_calls": calls,
            "gemm_slowdown": beside / alone - 1.0}


# ---------------------------------------------------------------------------------------------- outputs


def save_outputs(directory: str, rank: int, saved: dict[str, tuple[str, torch.Tensor | None]]) -> None:
    """``rank{r}.safetensors``: the kept outputs (CPU copies up to --save-max-bytes); metadata: every SHA-256."""
    from safetensors.torch import save_file

    Path(directory).mkdir(parents=True, exist_ok=True)
    meta = {k: sha for k, (sha, _) in saved.items()}
    kept = {k: t.contiguous() for k, (_, t) in saved.items() if t is not None}
    save_file(kept, str(Path(directory) / f"rank{rank}.safetensors"), metadata=meta)


def compare_saved(dir_a: str | Path, dir_b: str | Path) -> list[dict]:
    """Bit-for-bit comparison of two ``--save-outputs`` directories, per rank file and tensor."""
    from safetensors import safe_open

    results = []
    for file_a in sorted(Path(dir_a).glob("rank*.safetensors")):
        file_b = Path(dir_b) / file_a.name
        if not file_b.exists():
            results.append({"file": file_a.name, "key": None, "identical": False, "note": "missing in B"})
            continue
        with safe_open(str(file_a), "pt") as fa, safe_open(str(file_b), "pt") as fb:
            meta_a, meta_b = fa.metadata() or {}, fb.metadata() or {}
            for key in sorted(set(meta_a) | set(meta_b)):
                entry = {"file": file_a.name, "key": key}
                if key not in meta_a or key not in meta_b:
                    entry.update(identical=False, note="present in one revision only")
                elif key in fa.keys() and key in fb.keys():
                    diff = common.count_bitwise_diff(fa.get_tensor(key), fb.get_tensor(key))
                    entry.update(identical=diff == 0, wrong=diff, how="tensor")
                else:
                    entry.update(identical=meta_a[key] == meta_b[key], how="sha256")
                results.append(entry)
    return results


# ---------------------------------------------------------------------------------------------- revisions


def child_argv(argv: list[str]) -> list[str]:
    """``argv`` without the options that only the --compare-revs parent uses (and a leading ``--``)."""
    out, skip = [], 0
    for token in argv:
        if skip:
            skip -= 1
            continue
        name = token.split("=", 1)[0]
        if name in COMPARE_ONLY:
            skip = 0 if "=" in token else COMPARE_ONLY[name]
            continue
        if token == "--":
            continue
        out.append(token)
    return out


def compare_revs(args, argv: list[str]) -> int:
    tree_a, tree_b = (Path(d).resolve() for d in args.compare_revs)
    for tree in (tree_a, tree_b):
        if not (tree / "fastvideo").is_dir():
            raise SystemExit(f"--compare-revs: {tree} has no fastvideo/ package (export a tree with git archive)")
    tree_env: dict[Path, dict[str, str]] = {tree_a: {}, tree_b: {}}
    if args.tree_libraries:
        for tree in (tree_a, tree_b):
            lib = tree / "build" / "kernel" / "libfastvideo_ulysses_a2a.so"
            if not lib.is_file():
                raise SystemExit(f"--tree-libraries: {lib} is missing; build it with "
                                 f"`cd {tree} && python3 fastvideo-kernel/build_lib.py --out build/kernel`")
            path = os.pathsep.join(p for p in (str(tree / "fastvideo-kernel"), os.environ.get("PYTHONPATH")) if p)
            tree_env[tree] = {"FASTVIDEO_KERNEL_LIBRARY": str(lib), "PYTHONPATH": path}
    work = Path(args.compare_out or tempfile.mkdtemp(prefix="a2a_revs_"))
    work.mkdir(parents=True, exist_ok=True)
    bench_args = child_argv(argv)
    print(f"# compare-revs: A={tree_a} B={tree_b} rounds={args.rounds} nproc={args.nproc} out={work}")
    print(f"# identical benchmark argv: {' '.join(bench_args)}")
    for label, tree in (("A", tree_a), ("B", tree_b)):
        if tree_env[tree]:
            print(f"# {label} runs its own loader and library: {tree_env[tree]['FASTVIDEO_KERNEL_LIBRARY']}")
    runs: dict[str, list[dict]] = {"A": [], "B": []}
    for rnd in range(args.rounds):
        for label, tree in (("A", tree_a), ("B", tree_b)):
            out_json = work / f"{label}{rnd}.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
                   str(Path(__file__).resolve()), *bench_args, "--json", str(out_json)]
            if rnd == 0:
                cmd += ["--save-outputs", str(work / f"{label}_outputs")]
            env = dict(os.environ, **{common.TREE_ENV: str(tree)}, **tree_env[tree])
            print(f"# round {rnd} {label}: {' '.join(cmd)}", flush=True)
            proc = subprocess.run(cmd, env=env, cwd=str(tree), capture_output=True, text=True)
            if proc.returncode not in (0, 1):  # 1 = ran, but some row had wrong > 0 (reported below)
                print(proc.stdout[-4000:], proc.stderr[-4000:], sep="\n")
                raise SystemExit(f"--compare-revs: run {label}{rnd} failed with exit code {proc.returncode}")
            runs[label].append(json.loads(out_json.read_text()))

    def medians(label: str) -> dict[tuple, float]:
        acc: dict[tuple, list[float]] = collections.defaultdict(list)
        for run in runs[label]:
            for row in run["rows"]:
                if row.get("median_ms"):
                    acc[(row["geometry"], row["mode"], row["route"])].append(row["median_ms"])
        return {k: statistics.median(v) for k, v in acc.items()}

    med_a, med_b = medians("A"), medians("B")
    print(f"# A commit {runs['A'][0]['header']['commit']}   B commit {runs['B'][0]['header']['commit']}")
    # Both revisions must be timed from the same line-up (a tree without the shared-memory vote lines up over
    # gloo, whose exit skew lands in every timed call): say so loudly where they differ.
    lineups = {label: sorted({(run["header"].get("lineup") or {}).get("kind", "unknown") for run in runs[label]})
               for label in runs}
    if lineups["A"] != lineups["B"]:
        print(f"# WARNING: the revisions lined up differently (A {lineups['A']}, B {lineups['B']}): the ratios "
              "carry the line-ups' skew difference; rerun with --lineup gloo for a like-for-like comparison")
    print(f"{'geometry':>12} {'mode':>4} {'route':>5} {'A ms':>9} {'B ms':>9} {'B/A':>7}")
    ratios = []
    for key in sorted(set(med_a) & set(med_b), key=str):
        ratio = med_b[key] / med_a[key]
        ratios.append({"geometry": key[0], "mode": key[1], "route": key[2], "a_median_ms": med_a[key],
                       "b_median_ms": med_b[key], "ratio_b_over_a": ratio})
        print(f"{key[0]:>12} {key[1]:>4} {key[2]:>5} {med_a[key]:9.3f} {med_b[key]:9.3f} {ratio:7.3f}")
    outputs = compare_saved(work / "A_outputs", work / "B_outputs")
    different = [o for o in outputs if not o["identical"]]
    print(f"# outputs compared bit for bit: {len(outputs)} tensors, {len(different)} differ")
    for o in different:
        print(f"#   differs: {o}")
    if args.json:
        common.write_json(args.json, {"compare_revs": [str(tree_a), str(tree_b)], "argv": sys.argv,
                                      "bench_argv": bench_args, "commit_a": runs["A"][0]["header"]["commit"],
                                      "commit_b": runs["B"][0]["header"]["commit"], "lineups": lineups},
                          ratios, outputs=outputs, runs=runs)
    return 0 if not different and outputs else 1


# ---------------------------------------------------------------------------------------------- main


def load_tuned_rows(path: str) -> tuple:
    """The ``TunedRow`` objects a tune_ulysses_a2a.py JSON chose (its ``tuned_rows_data``)."""
    from fastvideo.distributed.ulysses.policy import TunedRow

    data = json.loads(Path(path).read_text())
    rows = data.get("tuned_rows_data")
    if not rows:
        raise SystemExit(f"--tuned-from {path}: no tuned_rows_data (a tune_ulysses_a2a.py JSON from 2026-11-29 on)")
    return tuple(TunedRow(r["gpu"], r["world_size"], common.DTYPES[r["dtype"]], r["heads"], r["head_dim"],
                          ctas=r["ctas"], planes_per_chunk=r["planes_per_chunk"], row_chunks=r["row_chunks"],
                          engine=r.get("engine", "sm"), source=r["source"]) for r in rows)


def print_table(rows: list[dict]) -> None:
    cols = (f"{'geometry':>12} {'mode':>4} {'route':>5} {'ran':>9} {'median':>8} {'p10':>8} {'p90':>8} {'vote us':>8} "
            f"{'vote %':>6} {'host us':>7} {'xfer ms':>8} {'GB/s':>7} {'fabric%':>7} {'wrong':>6}")
    print(cols)

    def f(v, fmt):
        return format(v, fmt) if isinstance(v, (int, float)) else format("-", ">" + fmt.split(".")[0].lstrip(">"))

    for r in rows:
        if "skipped" in r:
            print(f"{r['geometry']:>12} {r['mode']:>4} {r['route']:>5} skipped: {r['skipped']}")
            continue
        share = r["vote_share"] * 100 if r.get("vote_share") is not None else None
        frac = r["fabric_fraction"] * 100 if r.get("fabric_fraction") is not None else None
        print(f"{r['geometry']:>12} {r['mode']:>4} {r['route']:>5} {r['route_ran'][:9]:>9} {f(r['median_ms'], '8.3f')} "
              f"{f(r['p10_ms'], '8.3f')} {f(r['p90_ms'], '8.3f')} {f(r['vote_us'], '8.1f')} {f(share, '6.1f')} "
              f"{f(r.get('host_overhead_us'), '7.1f')} {f(r['transfer_ms'], '8.3f')} {f(r['gbps'], '7.1f')} "
              f"{f(frac, '7.1f')} {r['wrong']:>6}")
        if r.get("aligned_median_ms") is not None and r.get("sp_size", 1) > 1:
            print(f"{'':>12}      from the last rank's entry: median {r['aligned_median_ms']:.3f} ms, host "
                  f"{f(r.get('host_overhead_aligned_us'), '.1f')} us; entry skew {f(r.get('entry_skew_us'), '.1f')} us")
        if r.get("plan"):
            print(f"{'':>12}      plan: {r['plan']}")
        if r.get("copy_out_ms") is not None and r.get("fabric_ms"):
            model = r["fabric_ms"] + r["chunks"] * r["barrier_pair_us"] / 1e3 + r["copy_out_ms"] / r["chunks"]
            print(f"{'':>12}      parts: fabric {r['fabric_ms']:.3f} ms ({r.get('fabric_engine')}), "
                  f"{r['chunks']} chunk(s) x "
                  f"barrier pair {r['barrier_pair_us']:.1f} us, copy-out {r['copy_out_ms']:.3f} ms alone; model "
                  f"{model:.3f} ms vs xfer {r['transfer_ms']:.3f} ms; host {r.get('host_overhead_us') or 0:.1f} us")
        if r.get("note"):
            print(f"{'':>12}      note: {r['note']}")
        if r.get("gemm_slowdown") is not None:
            print(f"{'':>12}      overlap: GEMM chain {r['gemm_chain_ms']:.3f} ms alone, "
                  f"{r['gemm_chain_beside_ms']:.3f} ms "
                  f"beside {r['overlap_calls']} calls: slowdown {r['gemm_slowdown'] * 100:.1f}%")
        elif r.get("overlap_note"):
            print(f"{'':>12}      overlap: {r['overlap_note']}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args([a for a in argv if a != "--"])
    if args.compare_revs:
        return compare_revs(args, argv)
    if args.quick:
        args.iters, args.warmup = 5, 2
    rank, world, device = common.init_distributed(args.device)
    common.set_lineup(args.lineup)
    dtype = common.DTYPES[args.dtype]
    default = DEFAULT_GEOMETRIES if device.type == "cuda" else ("toy",)
    geometries = args.geometry or [parse_geometry(g) for g in default]
    modes = [int(m) for m in args.modes.split(",")]
    routes = [r.strip() for r in args.routes.split(",")]
    for r in routes:
        if r not in ("off", "auto"):
            raise SystemExit(f"--routes: {r!r} is not a FASTVIDEO_ULYSSES_A2A value (off, auto)")

    helper, helper_note = None, None
    if "auto" in routes and world > 1:
        try:
            if device.type == "cpu":
                helper = common.install_cpu_transport_helper()
                helper_note = "CPU: GlooPlanTransport injected (timings mean nothing)"
            else:
                from fastvideo.distributed.ulysses.helper import get_default_helper

                helper = get_default_helper()
        except Exception as exc:  # noqa: BLE001 - reported; the op under auto would raise the same way
            helper_note = f"auto rows dropped: helper construction failed: {type(exc).__name__}: {exc}"
            routes = [r for r in routes if r != "auto"]
            if rank == 0:
                print(f"# {helper_note}", flush=True)
    tuned_from = None
    if args.tuned_from and helper is not None:
        tuned_from = load_tuned_rows(args.tuned_from)
        helper.tuned_table = tuned_from
    header = common.env_header(device, world, helper, {
        "tuned_from": ({"path": args.tuned_from, "rows": [repr(r) for r in tuned_from]} if tuned_from is not None
                       else None),
        "benchmark": "ulysses_a2a", "dtype": args.dtype, "iters": args.iters, "warmup": args.warmup,
        "helper": helper.stats() if helper is not None else None, "helper_note": helper_note,
        "bandwidth_definition": "bytes moved per rank / time; bytes moved per rank = operand bytes x (P-1)/P",
        "fabric_reference": "fvk_fabric_copy: flat push of operand/P bytes into every peer's window, all ranks at "
                            "once, copy engines and SM stores, the better one (same run); nccl_p2p_ms: "
                            "batch_isend_irecv of the same bytes",
    })
    if rank == 0:
        common.print_header(header)
    rows, fabric_cache, saved = [], {}, {}
    for name, shape in geometries:
        for mode in modes:
            for route in routes:
                rows.append(run_row(args, name, shape, mode, route, helper, dtype, device, fabric_cache, saved))
                if device.type == "cuda":
                    torch.cuda.empty_cache()  # the row's operands are gone; keep big geometries from stacking up
    if args.save_outputs:
        save_outputs(args.save_outputs, rank, saved)
    if helper is not None:
        header["helper_after"] = helper.stats()
    header["lineup"] = common.lineup()
    if rank == 0:
        print_table(rows)
        common.write_json(args.json, header, rows)
    not_fused = [r for r in rows
                 if r.get("route") == "auto" and r.get("sp_size", 1) > 1 and r.get("route_ran") != "fused"]
    if rank == 0 and args.require_fused and not_fused:
        for r in not_fused:
            print(f"# REQUIRED FUSED, ran {r.get('route_ran')}: {r['geometry']} mode {r['mode']} "
                  f"declines {r.get('declines')} {r.get('note', '')}")
    common.set_route("off")
    common.shutdown()
    return 1 if any(r.get("wrong") for r in rows) or (args.require_fused and not_fused) else 0


if __name__ == "__main__":
    sys.exit(main())
