"""The fused call's host overhead on one GPU: the whole call through the helper at P = 1, host-to-completion
against the device time of the same launch.

Two GPUs are needed for the real number; one GPU measures everything in it but the peer: a one-rank helper
(settings, policy and plan cache, the 12-field vote over the same-host shared memory, the verdict, ``execute``,
the watchdog's bookkeeping) driving the real kernel library on a one-rank NCCL communicator. At P = 1 the vote
waits for no peer, the barriers meet no peer and a copy-engine call pushes nothing, so this is a lower bound of
the SP2 overhead. The helper refuses SP sizes below 2; this case lowers that bound in its own process
(``product.one_rank_helpers``) and plans from rows it makes for SP1 (the H200 rows' plan shapes: SM 144 CTAs;
copy engine 66 CTAs in 1 or 2 row chunks).

Per row: ``host_ms`` (host-to-completion median of ``helper.all_to_all``), ``device_ms`` (CUDA events around the
transport's ``execute`` with the same plan, on an idle device), ``host_overhead_us`` = the difference of those two
medians, the vote's median, and ``sync_us`` (a synchronize of an idle device: the wake-up alone, part of every
host-to-completion number). Two per-iteration overheads, each from one host-timed call and one event-timed launch
back to back, so the drift of a shared host between two loops cancels (medians and quartiles):

* ``paired_us`` (``paired_p25_us``, ``paired_p75_us``): host-to-completion minus the launch's event time taken on
  an idle device (``timing.paired_overhead``). The start event fires as soon as it is recorded, so that event time
  also holds the host's time inside ``execute`` before its library call and the launch latency: that host time is
  subtracted away and never shows here. The metric ``--compare-revs`` compares (it compares one per case), timed in
  ``SLICES`` slices of the iterations, each its own turn: in turns, the two revisions' slices of a row alternate.
* ``busy_us`` (``busy_p25_us``, ``busy_p75_us``): host-to-completion minus the launch's pure device time, the events
  recorded behind a spin kernel that outlasts the host's enqueueing of the launch (``timing.busy_overhead``; an
  iteration whose spin ended first is taken again with the spin doubled, and the run notes it): every host
  microsecond of the call counts. ``device_busy_ms`` is the median of that pure device time, ``busy_spin_us`` the
  spin's length and ``busy_spin_doubled`` how often it doubled. Recorded in every run, not compared by
  ``--compare-revs``.

The plan that ran is asserted. Each geometry starts with a ``floor`` row: one plain torch op on the same bytes
(``out.copy_(x)``) timed the same way, what any single-kernel call pays in each metric. On CPU it is a dry run on
``GlooPlanTransport`` (timings mean nothing). The case takes turns (``harness.turns``): under ``--compare-revs``
the two revisions' runs go together, each row of one next to the same row of the other, and within a row each slice
of ``paired_us``'s iterations next to the other's: a stretch of host noise shorter than a row lands on both.

``--decompose`` (this tree and older ones, under ``--compare-revs`` too: ``product.call_stages`` adapts): per
untagged row the paired overhead of the call cut at its layers, each against the same launch, on ``paired_us``'s
measurement only (no busy counterpart), each stage in slices with its own turns as ``paired_us``: ``call_us``
(``UlyssesHelper.call`` on validated input), ``native_us`` (on a hot row: the hot lane's native call and the
transport's end of it alone, no helper frame), ``voted_us`` (the transport's voted launch alone: the proposal, the
library's vote and launch) and ``launch_us`` (the launch without a vote). ``paired_us - call_us`` is the public
checks, ``call_us - voted_us`` the helper's own Python, ``voted_us - launch_us`` the vote; on a hot row ``call_us -
native_us`` is the helper's Python around the lane. Each output is checked too (``#wrong``). With the hot path on,
``call_us`` is the hot call (no ``execute`` in it, so it can read below ``voted_us``): decompose the Python path
with ``--hot both``'s ``python`` rows.

``--hot built|both`` (default ``built``): the hot path (``fastvideo/distributed/ulysses/hot.py``) as the helper was
built (on where the extension is built for this torch), or ``both``: per plan and mode a row with it off
(``<plan> python``) and one with it on (``<plan> hot``), back to back on the same helper, which path ran asserted
(``stats()["hot_calls"]``): the A/B of what it saves.

``--compared-only``: each row times ``paired_us`` alone (no ``host_ms``, ``device_ms``, ``busy_us``), for an
A/B that wants more rounds (processes) rather than more columns per round: what moves a row is the process.

``--tag untagged|tagged|both`` (default ``untagged``, the rows as before): ``tagged`` calls
``helper.all_to_all(x, mode, tag=...)`` with a call-site tag (the vote's SEQ is then the tag's own count: one dict
lookup and one XOR more per call), its rows labelled ``<plan> tagged``; ``both`` measures the untagged and the
tagged row of each plan and mode back to back on the same helper, the A/B of what a tag costs the host.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import ClassVar

import torch

from benchmarks.harness import oracle, product, report, timing
from benchmarks.harness.case import Case, Context
from benchmarks.harness.cli import divisible, input_shape

TAG_CHOICES = ("untagged", "tagged", "both")
HOT_CHOICES = ("built", "both")
TAG = "blocks.0.attn.qkv"  # what DistributedAttention(prefix="blocks.0.attn") tags its first call


def median_us(seconds: list[float]) -> float:
    return statistics.median(seconds) * 1e6


STAGES = ("call", "native", "voted", "launch")  # --decompose: product.call_stages, outermost first
# paired_us's iterations in this many slices, each its own turn (harness.turns): a shared host's noise comes in
# stretches, many shorter than a row, that would land on one revision's row; slices of a row put both in each.
SLICES = 6


def quartile_columns(prefix: str, seconds: list[float]) -> dict:
    """``<prefix>_us`` and its quartiles ``<prefix>_p25_us``, ``<prefix>_p75_us`` of per-iteration seconds."""
    us = sorted(v * 1e6 for v in seconds)
    quartile = len(us) // 4
    return {f"{prefix}_us": statistics.median(us), f"{prefix}_p25_us": us[quartile],
            f"{prefix}_p75_us": us[-1 - quartile]}


def paired_columns(seconds: list[float]) -> dict:
    """A row's ``paired_us`` and its quartiles from ``timing.paired_overhead``'s differences."""
    return quartile_columns("paired", seconds)


def busy_columns(busy: dict) -> dict:
    """A row's ``busy_us`` and its quartiles, ``device_busy_ms``, and the spin, from ``timing.busy_overhead``."""
    return {**quartile_columns("busy", busy["overhead"]), "device_busy_ms": statistics.median(busy["device"]) * 1e3,
            "busy_spin_us": busy["spin_s"] * 1e6, "busy_spin_doubled": busy["spin_doubled"]}


def sliced_paired(host_fn, device_fn, device: torch.device, args, turn: Callable[[], None]) -> list[float]:
    """``timing.paired_overhead``'s differences over ``args.iters`` iterations in ``SLICES`` slices (each warmed up
    as the whole is), calling ``turn`` before each slice after the first. Local; ``turn`` blocks in turns."""
    sizes = [n for n in (args.iters // SLICES + (i < args.iters % SLICES) for i in range(SLICES)) if n]
    seconds: list[float] = []
    for i, n in enumerate(sizes):
        if i:
            turn()
        seconds += timing.paired_overhead(host_fn, device_fn, device, n, args.warmup)
    return seconds


def overhead_columns(host_fn, device_fn, device: torch.device, args, turn: Callable[[], None]) -> dict:
    """The timing columns of a row: ``host_fn``'s host-to-completion median, ``device_fn``'s event-timed median,
    the difference of the two, the paired overhead (``sliced_paired``, ``turn`` between slices) and the busy
    overhead with their quartiles; with ``--compared-only`` the paired overhead alone."""
    if args.compared_only:
        return paired_columns(sliced_paired(host_fn, device_fn, device, args, turn))
    host = statistics.median(timing.host_latencies(host_fn, device, args.iters, args.warmup))
    dev = statistics.median(timing.device_times(device_fn, device, args.iters, args.warmup))
    busy = busy_columns(timing.busy_overhead(host_fn, device_fn, device, args.iters, args.warmup))
    return {"host_ms": host * 1e3, "device_ms": dev * 1e3, "host_overhead_us": (host - dev) * 1e6,
            **paired_columns(sliced_paired(host_fn, device_fn, device, args, turn)), **busy}


def add_row(ctx: Context, row: dict) -> None:
    """Record ``row``, with a note where the busy measurement's spin had to grow."""
    if row.get("busy_spin_doubled"):
        ctx.note(f"{row['geometry']} mode {row['mode']} {row['label']}: the busy measurement's spin ended before "
                 f"the launch was queued; doubled {row['busy_spin_doubled']} time(s), to {row['busy_spin_us']:.0f} us")
    ctx.add_row(row)


def measure(helper, x: torch.Tensor, mode: int, engine: str, ctas: int, args, turn: Callable[[], None],
            tag: str | None = None, hot: bool | None = None) -> dict:
    """One row: the helper's call (with ``tag``, None: untagged) and the launch alone, for ``x`` in ``mode``; the
    plan that ran asserted (the row's engine and CTAs, tuned) and the tag it was recorded with. ``turn``: between
    the compared metric's slices (``sliced_paired``). ``hot``: the hot
    path turned off or on for the row (``product.hot_path``) and its use asserted (every call after the first on
    it, none off it); None: as the helper was built (the --compare-revs rows, older trees too)."""
    from fastvideo.distributed.ulysses.policy import Geometry

    device = x.device
    geom = Geometry.from_input(x.shape, mode, 1, x.dtype)
    if hot is not None:
        product.hot_path(helper, hot)
    with torch.no_grad():  # the helper is called directly: no route setting
        mark = helper.stats()["calls"]
        hot_mark = helper.stats().get("hot_calls", 0)
        # Untagged rows call without the keyword, so --compare-revs against a tree from before tags runs them.
        call = (lambda: helper.all_to_all(x, mode)) if tag is None else (lambda: helper.all_to_all(x, mode, tag=tag))
        out = call()
        timing.synchronize(device)
        wrong = oracle.count_bitwise_diff(out, x)
        record = helper.history[-1]
        plan = record.plan
        if record.route != "fused" or plan is None or (plan.engine, plan.ctas, plan.tuned) != (engine, ctas, True):
            raise SystemExit(f"mode {mode}: expected the fused tuned {engine} plan of {ctas} CTAs, ran {record}")
        if getattr(record, "tag", None) != tag:
            raise SystemExit(f"mode {mode}: expected a call tagged {tag!r}, ran {record}")
        execute = product.transport(helper).execute
        columns = overhead_columns(call, lambda: execute(x, geom, plan), device, args, turn)
    calls, hot_calls = helper.stats()["calls"] - mark, helper.stats().get("hot_calls", 0) - hot_mark
    if hot is not None and (hot_calls < calls - 1 if hot else hot_calls != 0):
        raise SystemExit(f"mode {mode}: the hot path {'on' if hot else 'off'} made {hot_calls} of {calls} calls")
    row = {"mode": mode, "engine": engine, "tagged": tag is not None, "plan": plan.describe(geom),
           "chunks": plan.num_chunks(geom), "calls": calls, "hot_calls": hot_calls, **columns,
           "vote_us": median_us(helper.vote_seconds(args.iters)),
           "wrong": wrong, "wrong_oracle": "the input (the all-to-all at P = 1 is the identity)"}
    if args.decompose and tag is None:
        with torch.no_grad():
            stages = product.call_stages(helper, x, mode)
            for name in STAGES:
                if name in stages:
                    stage = stages[name]
                    turn()  # each stage in turns too: the two trees' stages of a row alternate
                    row[f"{name}_us"] = median_us(sliced_paired(stage, lambda: execute(x, geom, plan), device, args,
                                                                turn))
                    row["wrong"] += oracle.count_bitwise_diff(stage(), x)
    return row


def floor(x: torch.Tensor, args, turn: Callable[[], None]) -> dict:
    """The metric's floor: one plain torch op on the same bytes (``out.copy_(x)``, one kernel through the
    dispatcher), timed as the fused call is (``turn`` between slices). What any single-kernel call pays here: its
    host path to the launch, the launch latency and the synchronize's wake-up."""
    device = x.device
    out = torch.empty_like(x)

    def copy() -> None:
        out.copy_(x)

    columns = overhead_columns(copy, copy, device, args, turn)
    timing.synchronize(device)
    return {"mode": 0, "engine": "torch", "tagged": False, "plan": "out.copy_(x)", "chunks": 0, "calls": 0, **columns,
            "vote_us": None, "wrong": oracle.count_bitwise_diff(out, x), "wrong_oracle": "the input (a copy)"}


class FusedHostOverheadCase(Case):
    name = "fused_host_overhead"
    summary = "the whole fused call at P = 1: host-to-completion minus the launch's device time, per plan"
    key = ("geometry", "mode", "label")
    metric = "paired_us"
    takes_turns = True
    defaults: ClassVar[dict] = {"iters": 300, "warmup": 20}
    quick: ClassVar[dict] = {"iters": 10, "warmup": 2}
    columns = (
        report.Column("geometry", "geometry", width=12),
        report.Column("mode", "mode"),
        report.Column("label", "plan", width=22),
        report.Column("chunks", "chunks"),
        report.Column("host_ms", "host ms"),
        report.Column("device_ms", "device ms"),
        report.Column("device_busy_ms", "busy dev ms"),
        report.Column("host_overhead_us", "host us", fmt=".1f"),
        report.Column("paired_us", "paired us", fmt=".1f"),
        report.Column("paired_p25_us", "p25", fmt=".1f"),
        report.Column("paired_p75_us", "p75", fmt=".1f"),
        report.Column("busy_us", "busy us", fmt=".1f"),
        report.Column("busy_p25_us", "p25", fmt=".1f"),
        report.Column("busy_p75_us", "p75", fmt=".1f"),
        report.Column("vote_us", "vote us", fmt=".1f"),
        report.Column("call_us", "call us", fmt=".1f"),
        report.Column("native_us", "native us", fmt=".1f"),
        report.Column("voted_us", "voted us", fmt=".1f"),
        report.Column("launch_us", "launch us", fmt=".1f"),
    )

    def lane(self, row: dict) -> str:
        """A row's lane for ``--within``'s counts: the floor, the hot path's and the Python path's rows (``--hot
        both``), or the fused rows as built."""
        label = str(row.get("label", ""))
        if label.startswith("floor"):
            return "floor"
        last = label.rsplit(" ", 1)[-1]
        return last if last in ("hot", "python") else "fused"

    def add_arguments(self, parser) -> None:
        parser.add_argument("--at-sp", type=int, default=2, help="the geometries' per-rank operands at this SP size")
        parser.add_argument("--decompose", action="store_true",
                            help="per untagged row, also the paired overhead of the call cut at its layers: "
                                 "helper.call without the public checks, the hot lane's native call alone (hot rows), "
                                 "the voted launch alone, the launch without a vote (product.call_stages)")
        parser.add_argument("--compared-only", action="store_true",
                            help="time only the metric --compare-revs compares (paired_us; the vote's median is "
                                 "read, not timed): no host_ms, device_ms or busy_us, so a round is shorter and an "
                                 "A/B fits more rounds in a run")
        parser.add_argument("--hot", choices=HOT_CHOICES, default="built",
                            help="the hot path (fastvideo/distributed/ulysses/hot.py) as the helper was built, or "
                                 "both: a row with it off (labelled 'python') and one with it on ('hot') per plan and "
                                 "mode, back to back on the same helper, each one's use asserted: the A/B")
        parser.add_argument("--tag", choices=TAG_CHOICES, default="untagged",
                            help="call the helper untagged (the rows as before), with a call-site tag, or both "
                                 "(an untagged and a tagged row per plan and mode, back to back: the A/B)")

    def run(self, ctx: Context) -> None:
        from fastvideo.distributed.ulysses.helper import UlyssesHelper
        from fastvideo.distributed.ulysses.policy import ENGINE_CE, ENGINE_SM, TunedRow, normalize_gpu_name

        args, device = ctx.args, ctx.device
        if ctx.world != 1:
            raise SystemExit("fused_host_overhead: run it as one process (P = 1)")
        cuda = device.type == "cuda"
        ctx.turn()
        sync_s = []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            timing.synchronize(device)
            sync_s.append(time.perf_counter() - t0)
        ctx.header.update(sync_us=median_us(sync_s), at_sp=args.at_sp, dry_run=not cuda, tag=args.tag, hot=args.hot)
        hots = (None,) if args.hot == "built" else (False, True)
        tags = {"untagged": (None,), "tagged": (TAG,), "both": (None, TAG)}[args.tag]
        if not cuda:
            ctx.note("CPU: a dry run on GlooPlanTransport at P = 1 (timings mean nothing)")
        ctx.log(f"synchronize of an idle device: {median_us(sync_s):.1f} us median")
        gpu = normalize_gpu_name(torch.cuda.get_device_name(device) if cuda else "cpu")
        geometries = ctx.geometries(cpu=("toy",), gpu=("wan720p", "h3-32k"))
        kinds = ((ENGINE_SM, 144, 1), (ENGINE_CE, 66, 1), (ENGINE_CE, 66, 2))
        ctx.progress.total = len(geometries) * len(kinds)
        with product.one_rank_helpers():
            for name, shape in geometries:
                why = divisible(shape, args.at_sp)
                if why:
                    ctx.skip(why, geometry=name, mode=None, label="")
                    continue
                x = oracle.make_input(input_shape(shape, 0, args.at_sp), ctx.dtype, device, args.seed)
                ctx.turn()
                add_row(ctx, {"geometry": name, "label": "floor: torch copy_", **floor(x, args, ctx.turn),
                              "sync_us": median_us(sync_s)})
                for engine, ctas, splits in kinds:
                    table = (TunedRow(gpu, 1, x.dtype, x.shape[2], x.shape[3], ctas=ctas, planes_per_chunk=1,
                                      row_chunks=splits, engine=engine, source="fused_host_overhead (P = 1)"),)
                    transport = None
                    if not cuda:
                        GlooPlanTransport = product.plan_transport()

                        transport = GlooPlanTransport()
                    helper = UlyssesHelper(tuned_table=table, vote="shm" if cuda else "auto", transport=transport)
                    try:
                        if not helper.fused_available:
                            raise SystemExit(f"the one-rank helper declined: {helper.stats()['construction_detail']}")
                        ctx.header.setdefault("hot_path", helper.stats().get("hot_path", "absent from this tree"))
                        for mode in (0, 1):
                            for tag in tags:
                                for hot in hots:
                                    ctx.turn()
                                    row = measure(helper, x, mode, engine, ctas, args, ctx.turn, tag, hot)
                                    label = (f"{engine} {ctas} CTAs x{splits}" + (" tagged" if tag is not None else "")
                                             + ("" if hot is None else " hot" if hot else " python"))
                                    add_row(ctx, {"geometry": name, "label": label, **row,
                                                  "sync_us": median_us(sync_s)})
                    finally:
                        helper.destroy()
                    ctx.advance(f"{name} {engine} x{splits}")
                if cuda:
                    torch.cuda.empty_cache()


CASE = FusedHostOverheadCase()
