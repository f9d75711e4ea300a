"""The plan of ``DistributedAttention(overlap_chunks=N)``'s pipeline: head groups, the issue order, and a
host-side model of the two streams that checks it. Pure: no process group, no GPU (``explain --overlap`` reads it).

The layer's heads are cut into N contiguous groups (``head_groups``: as even as they go); each group is a Ulysses
attention of its own over the SP group (its heads split over the ranks as evenly as they go, so uneven head splits
per group are normal). ``schedule(N)`` orders the work: group g+1's packed q/k/v exchange is started before group
g's attention, and group g's output exchange is started right after it, so while the compute stream runs group g's
attention the communication stream moves group g+1's inputs and group g-1's output. ``schedule(1)`` is the
unpipelined forward's order: one exchange in, the attention, one exchange back. ``CallLayout`` is one call's split
(the layer's, or a head group's): the layer runs on it, ``describe_plan`` describes it.

``schedule_model`` is a host-side model of the two streams (vector clocks): for every consumer, which event it
waits on and whether the data it reads has landed. The tests check the layer's own schedule with it.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import accumulate
from typing import Any, NamedTuple

import torch

from fastvideo.distributed.all_to_all import balanced_splits
from fastvideo.distributed.settings import OVERLAP as SETTING  # the variable this plan's group count comes from
from fastvideo.distributed.settings import ROUTE
from fastvideo.distributed.ulysses.policy import ENGINE_CE, Geometry, choose_plan


class Step(NamedTuple):
    """One step of the pipeline: ``start`` / ``wait`` an exchange (``role`` ``qkv`` or ``out``) of ``group``, or
    ``attend`` a group, or ``join`` (concatenate every group's output)."""

    kind: str
    role: str
    group: int


def head_groups(num_heads: int, chunks: int) -> tuple[int, ...]:
    """The heads of each of ``chunks`` groups (contiguous, as even as they go). Pure."""
    if not 1 <= chunks <= num_heads:
        raise ValueError(f"overlap_chunks={chunks} must be in 1..num_heads ({num_heads}): each group needs a head.")
    return balanced_splits(num_heads, chunks)


def check_chunks(cls: str, num_heads: int, chunks: int | None) -> int | None:
    """``chunks`` (``DistributedAttention(overlap_chunks=)``, or a subclass's: ``cls`` names it in the error) if
    valid: None, or an int in 0..``num_heads``."""
    if chunks is None:
        return None
    if isinstance(chunks, bool) or not isinstance(chunks, int) or not 0 <= chunks <= num_heads:
        raise ValueError(f"{cls}: overlap_chunks={chunks!r} must be an int in 0..num_heads "
                         f"({num_heads}): the number of head groups to pipeline (0 or 1: off; None: the agreed "
                         f"{SETTING}).")
    return chunks


@dataclass(frozen=True)
class CallLayout:
    """One attention call's split of the sequence and heads over the SP group (the same on every rank): a layer's
    heads, or one head group's. Pure."""

    world: int
    rank: int
    heads: tuple[int, ...]  # every rank's heads of the call after the first exchange
    seq_splits: tuple[int, ...] | None  # every rank's rows, where uneven
    seq: int  # the unpadded sequence length
    full: int  # the sequence length the exchange gathers (padded to a multiple of the SP size, or the splits' sum)
    first: int = 0  # the call's first head in the layer
    group: int | None = None  # the head group of a pipelined forward

    @property
    def uneven(self) -> dict[str, Any]:
        """The public op's ``seq_splits`` / ``head_splits``, only where uneven (an even call passes neither, so an
        ``all_to_all`` override that takes neither serves it)."""
        kw: dict[str, Any] = {} if self.seq_splits is None else {"seq_splits": self.seq_splits}
        return {**kw, "head_splits": self.heads} if len(set(self.heads)) > 1 else kw

    def span(self, rank: int | None = None) -> slice:
        """The layer's heads of the call (``rank`` None), or of ``rank``'s share of them."""
        if rank is None:
            return slice(self.first, self.first + sum(self.heads))
        start = self.first + sum(self.heads[:rank])
        return slice(start, start + self.heads[rank])

    def groups(self, chunks: int) -> list[CallLayout]:
        """The layouts of ``chunks`` head groups of the call (``head_groups``; itself where ``chunks`` <= 1)."""
        if chunks <= 1:
            return [self]
        sizes = head_groups(sum(self.heads), chunks)
        return [replace(self, heads=balanced_splits(n, self.world), first=self.first + at, group=g)
                for g, (n, at) in enumerate(zip(sizes, accumulate(sizes, initial=0)))]


def gather_plan(groups: Sequence[CallLayout]) -> tuple[list[int] | None, list[int] | None]:
    """How the replicated tokens' outputs of ``groups`` (each rank's heads of every group side by side) are
    all-gathered over the heads: every rank's heads (None: even), and the gathered position of each of the layer's
    heads (None: already in order, one group). Pure."""
    per_rank = [sum(g.heads[r] for g in groups) for r in range(groups[0].world)]
    blocks = [g.span(r) for r in range(groups[0].world) for g in groups]  # the gathered heads, in order
    heads = [h for block in blocks for h in range(block.start, block.stop)]
    order = sorted(range(len(heads)), key=heads.__getitem__) if len(groups) > 1 else None
    return (None if len(set(per_rank)) == 1 else per_rank), order


def schedule(chunks: int) -> tuple[Step, ...]:
    """The pipeline's issue order on the host. Pure."""
    steps = [Step("start", "qkv", 0)]
    for g in range(chunks):
        if g + 1 < chunks:
            steps.append(Step("start", "qkv", g + 1))  # in flight under group g's attention
        steps += [Step("wait", "qkv", g), Step("attend", "", g), Step("start", "out", g)]
    steps += [Step("wait", "out", g) for g in range(chunks)]
    steps.append(Step("join", "", -1))
    return tuple(steps)


class ScheduleReport(NamedTuple):
    waits_on: dict[str, str]  # consumer -> the event its stream waited on for the data it reads
    unsafe: list[str]  # consumers that read data not yet landed on their stream (must be empty)
    unwaited: list[str]  # compute consumers whose stream never waited on their exchange's own event (must be empty)
    overlapped: list[str]  # exchanges in flight while an attention ran on the compute stream


def schedule_model(steps: Sequence[Step]) -> ScheduleReport:
    """Model the two streams of ``steps`` with vector clocks: every start forks the communication stream from the
    compute stream (it reads what the compute stream wrote), writes its exchange there and records an event;
    every wait makes the compute stream wait on that event. A consumer (an attention reads its group's q/k/v
    exchange, an output start reads its group's attention, the join reads every output exchange) is safe when
    the write it reads happens before it on its stream, and a compute consumer must have waited on its own
    exchange's event (not merely on a later one of the same stream). Pure."""
    clock = {"compute": {"compute": 0, "comm": 0}, "comm": {"compute": 0, "comm": 0}}
    writes: dict[str, tuple[str, int]] = {"input": ("compute", 0)}
    events: dict[str, dict[str, int]] = {}
    waited: dict[str, str] = {}  # data name -> event name the compute stream last waited on for it
    report = ScheduleReport(waits_on={}, unsafe=[], unwaited=[], overlapped=[])
    flying: set[str] = set()

    def tick(stream: str) -> int:
        clock[stream][stream] += 1
        return clock[stream][stream]

    def read(consumer: str, stream: str, data: str) -> None:
        src, at = writes.get(data, ("never", 1))
        if src == "never" or clock[stream][src] < at:
            report.unsafe.append(consumer)
        if stream == "compute":
            if data in waited:
                report.waits_on[consumer] = waited[data]
            else:  # safe at most through a later exchange's event: the schedule must not rely on that
                report.unwaited.append(consumer)

    for step in steps:
        name = f"{step.role}{step.group}"
        if step.kind == "start":
            clock["comm"] = {s: max(clock["comm"][s], clock["compute"][s]) for s in clock["comm"]}  # fork
            read(f"start {name}", "comm", "input" if step.role == "qkv" else f"attn{step.group}")
            writes[f"x{name}"] = ("comm", tick("comm"))
            events[f"event {name}"] = dict(clock["comm"])
            flying.add(name)
        elif step.kind == "wait":
            event = events.get(f"event {name}")
            if event is not None:
                clock["compute"] = {s: max(clock["compute"][s], event[s]) for s in event}
                waited[f"x{name}"] = f"event {name}"
            flying.discard(name)
        elif step.kind == "attend":
            read(f"attend {step.group}", "compute", f"xqkv{step.group}")
            writes[f"attn{step.group}"] = ("compute", tick("compute"))
            report.overlapped.extend(f"{f} under attend {step.group}" for f in sorted(flying))
        elif step.kind == "join":
            for g in sorted({s.group for s in steps if s.kind == "attend"}):
                read(f"join out{g}", "compute", f"xout{g}")
    return report


def describe_plan(args: argparse.Namespace, world_size: int, dtype: torch.dtype) -> tuple[int, list[str]]:
    """``explain --overlap N``'s exit status and lines (``args``: its parsed arguments; ``shape`` a layer's packed
    q/k/v exchange input): the head groups, and each group's two exchanges with the policy's route and kind for
    them. ``--overlap`` stands for the setting (its default), which the layer caps at its heads: so is it here.
    Arguments that describe no such layer: given as ``--overlap``, status 2 and an error line; taken from the
    setting, which applies to layers alone, status 0 and a line saying why nothing is described. Pure."""
    shape, chunks = args.shape, min(args.overlap, args.shape[2])
    split = list(balanced_splits(shape[2], world_size))  # the layer's heads: uneven where P does not divide H
    why = (("mode 0, even sequence shards and the layer's head split (even, or --head-splits "
            f"{','.join(map(str, split))})") if args.mode != 0 or args.seq_splits is not None
           or args.head_splits not in (None, split) else f"a batch of 3B (this input's is {shape[0]})" if shape[0] % 3
           else f"a layer of 2 heads or more (H = {shape[2]})" if chunks < 2 else None)
    if why:
        flag = getattr(args, "sources", {}).get("overlap", "--overlap") == "--overlap"
        return (2, [f"error: --overlap {args.overlap} explains a layer's packed q/k/v [3B, S_local, H, D]: {why}"]) \
            if flag else (0, [f"overlap    none: {SETTING}={args.overlap} pipelines DistributedAttention layers, "
                              f"whose packed q/k/v exchange needs {why}; this call is no such exchange"])
    if world_size == 1:
        return 0, [f"overlap    {chunks} head groups; SP size 1: nothing is exchanged (the op returns its input)"]

    # Each head group's two exchanges (even sequence shards): the packed q/k/v input [3B, S_local, h, D] and rank 0's
    # output input [B, S, h_0, D], with the group's head splits (None: even).
    b, s, _, d = shape
    groups = CallLayout(world_size, 0, tuple(split), None, s * world_size, s * world_size).groups(chunks)
    lines = [f"overlap    {chunks} head groups{' (capped at H)' * (args.overlap > chunks)} of "
             f"{[sum(g.heads) for g in groups]} heads; each group's q/k/v and output exchanges run on the "
             "communication stream (started before, waited after, the neighbouring group's attention on the compute "
             "stream)"]
    for g, group in enumerate(groups):
        heads = group.uneven.get("head_splits")
        calls = (("qkv", (b, s, sum(group.heads), d), 0), ("out", (b // 3, s * world_size, group.heads[0], d), 1))
        for role, call_shape, mode in calls:
            geom = Geometry.from_input(call_shape, mode, world_size, dtype, head_splits=heads)
            choice = choose_plan(geom, gpu=args.gpu, window_bytes=args.window_bytes, grad=args.grad,
                                 long_training=args.long_training)
            if getattr(args, "a2a", "auto") == "off":
                what = f"nccl route on the communication stream ({ROUTE}=off)"
            elif choice.plan is None:
                what = f"nccl route on the communication stream (fused declined: {choice.reason.label})"
            elif choice.plan.engine == ENGINE_CE:
                what = f"fused, copy engines, no SMs beside the attention ({choice.plan.describe(geom)})"
            else:
                what = (f"fused, SM kind: {choice.plan.ctas} CTAs compete with the attention for SMs "
                        f"({choice.plan.describe(geom)})")
            split = f", head splits {list(heads)}" if heads else ""
            lines.append(f"group {g} {role:<3} {list(call_shape)} mode {mode}{split}: {what}")
    return 0, lines
