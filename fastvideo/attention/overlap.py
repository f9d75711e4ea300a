"""``DistributedAttention`` with its exchanges hidden under its attention: heads in N groups, pipelined.

The layer's heads are cut into N contiguous groups (``head_groups``: as even as they go); each group is a
Ulysses attention of its own over the SP group (its heads split over the ranks as evenly as they go, so uneven
head splits per group are normal). ``schedule(N)`` orders the work: group g+1's packed q/k/v exchange is started
before group g's attention, and group g's output exchange is started right after it, so while the compute stream
runs group g's attention the communication stream moves group g+1's inputs and group g-1's output. Exchanges
are ``sequence_model_parallel_all_to_all_4D(..., async_op=True)`` (``ulysses/async_ops.py``): started on the
communication stream, waited on the compute stream just before their consumer. The backward mirrors it through
autograd (each wait's backward starts the reverse exchange, each start's backward waits for it).

Per-head attention does not mix heads, so the result is the unpipelined layer's (exactly where the attention
kernel's per-head arithmetic does not depend on how many heads a call carries). The replicated (text) tokens
are attended per group with this rank's heads of that group; their outputs are gathered over the SP group in
one all-gather and put back into head order.

``schedule_model`` is a host-side model of the two streams (vector clocks): for every consumer, which event it
waits on and whether the data it reads has landed. The tests check the layer's own schedule with it.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from fastvideo.distributed.all_to_all import balanced_splits, shares
from fastvideo.distributed.communication_op import sequence_model_parallel_all_gather
from fastvideo.distributed.parallel_state import get_sp_group, get_sp_parallel_rank, get_sp_world_size

SETTING = "FASTVIDEO_ULYSSES_A2A_OVERLAP"


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


def check_chunks(num_heads: int, chunks: int | None) -> int | None:
    """``chunks`` (``DistributedAttention(overlap_chunks=)``) if valid: None, or an int in 0..``num_heads``."""
    if chunks is None:
        return None
    if isinstance(chunks, bool) or not isinstance(chunks, int) or not 0 <= chunks <= num_heads:
        raise ValueError(f"DistributedAttention: overlap_chunks={chunks!r} must be an int in 0..num_heads "
                         f"({num_heads}): the number of head groups to pipeline (0 or 1: off; None: the agreed "
                         f"{SETTING}).")
    return chunks


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
    waits_on: dict[str, str] = {}
    unsafe: list[str] = []
    unwaited: list[str] = []
    overlapped: list[str] = []
    flying: set[str] = set()

    def tick(stream: str) -> int:
        clock[stream][stream] += 1
        return clock[stream][stream]

    def read(consumer: str, stream: str, data: str) -> None:
        src, at = writes.get(data, ("never", 1))
        if src == "never" or clock[stream][src] < at:
            unsafe.append(consumer)
        if stream == "compute":
            if data in waited:
                waits_on[consumer] = waited[data]
            else:  # safe at most through a later exchange's event: the schedule must not rely on that
                unwaited.append(consumer)

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
            overlapped += [f"{f} under attend {step.group}" for f in sorted(flying)]
        elif step.kind == "join":
            groups = sorted({s.group for s in steps if s.kind == "attend"})
            for g in groups:
                read(f"join out{g}", "compute", f"xout{g}")
    return ScheduleReport(waits_on, unsafe, unwaited, overlapped)


def group_calls(shape: Sequence[int], world_size: int, chunks: int) -> list[tuple[tuple[int, ...], tuple[int, ...],
                                                                            tuple[int, ...] | None]]:
    """Each head group's two exchanges for a layer whose packed q/k/v exchange input is ``shape`` ``[3B, S_local, H,
    D]`` on every rank (even shards): ``(qkv input shape, out input shape on rank 0, head_splits or None when even)``.
    Pure (``explain``)."""
    b, s, h, d = shape
    calls = []
    for hg in head_groups(h, chunks):
        heads = _group_heads(hg, world_size)
        calls.append(((b, s, hg, d), (b // 3, s * world_size, heads[0], d), None if hg % world_size == 0 else heads))
    return calls


def describe_plan(args, world_size: int, dtype: torch.dtype) -> tuple[int, list[str]]:
    """``explain --overlap N``'s exit status and lines (``args``: its parsed arguments; ``shape`` a layer's packed
    q/k/v exchange input): the head groups, and each group's two exchanges with the policy's route and kind for
    them; status 2 and an error line for arguments that describe no such layer. Pure."""
    from fastvideo.distributed.ulysses.policy import ENGINE_CE, Geometry, choose_plan

    shape, chunks = args.shape, args.overlap
    if args.mode != 0 or args.seq_splits is not None or args.head_splits is not None:
        return 2, ["error: --overlap explains a layer's packed q/k/v exchange: mode 0 with even shards (no splits)"]
    if not 1 < chunks <= shape[2]:
        return 2, [f"error: --overlap {chunks} must be in 2..H ({shape[2]}): each group needs a head"]
    gpu, window_bytes, grad, long_training = args.gpu, args.window_bytes, args.grad, args.long_training
    if world_size == 1:
        return 0, [f"overlap    {chunks} head groups; SP size 1: nothing is exchanged (the op returns its input)"]

    calls = group_calls(shape, world_size, chunks)
    lines = [f"overlap    {chunks} head groups of {[c[0][2] for c in calls]} heads; each group's q/k/v and output "
             "exchanges run on the communication stream (started before, waited after, the neighbouring group's "
             "attention on the compute stream)"]
    for g, (qkv, out, heads) in enumerate(calls):
        for role, call_shape, mode in (("qkv", qkv, 0), ("out", out, 1)):
            geom = Geometry.from_input(call_shape, mode, world_size, dtype, head_splits=heads)
            choice = choose_plan(geom, gpu=gpu, window_bytes=window_bytes, grad=grad, long_training=long_training)
            if getattr(args, "a2a", "auto") == "off":
                what = "nccl route on the communication stream (FASTVIDEO_ULYSSES_A2A=off)"
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


def _tag(layer, role: str, group: int) -> dict[str, str]:
    """The call tag of ``role``'s exchange of ``group``: the layer's tag for the role with ``.g{group}`` appended."""
    tag = layer.tags[role]
    return {"tag": f"{tag}.g{group}"} if tag else {}


def _group_heads(h: int, p: int) -> tuple[int, ...]:
    return (h // p,) * p if h % p == 0 else balanced_splits(h, p)


def forward(layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, original_seq_len: int | None,
            replicated_q: torch.Tensor | None, replicated_k: torch.Tensor | None, replicated_v: torch.Tensor | None,
            freqs_cis: tuple[torch.Tensor, torch.Tensor] | None, seq_splits: Sequence[int] | None,
            chunks: int, steps: Sequence[Step] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``DistributedAttention.forward`` (checked input) pipelined over ``chunks`` head groups: the same result.
    Collective over the SP group. ``steps``: the issue order (``schedule(chunks)``; tests pass another)."""
    b = q.shape[0]
    p, rank = get_sp_world_size(), get_sp_parallel_rank()
    groups = head_groups(layer.num_heads, chunks)
    first = [0, *itertools.accumulate(groups)]
    seq_kw = {}
    if seq_splits is not None:
        seq_kw["seq_splits"] = shares("DistributedAttention", "seq_splits", seq_splits, p)
        total = sum(seq_kw["seq_splits"])
        if original_seq_len not in (None, total):
            raise ValueError(f"DistributedAttention: original_seq_len={original_seq_len} with seq_splits "
                             f"(summing to {total}): uneven shards carry no padding; pass original_seq_len=None.")
    heads = [_group_heads(h, p) for h in groups]
    kws = [{**seq_kw, **({"head_splits": hs} if groups[g] % p else {})} for g, hs in enumerate(heads)]
    replicated = replicated_q is not None
    full = q.shape[1] * p if seq_splits is None else sum(seq_kw["seq_splits"])
    seq = original_seq_len or full
    if not 0 < seq <= full:
        raise ValueError(f"DistributedAttention: original_seq_len={original_seq_len} must be in 1..{full} (the "
                         f"padded sequence: {p} ranks x {q.shape[1]} rows).")
    if replicated:
        rep = torch.cat([replicated_q, replicated_k, replicated_v], dim=0)
    exchange = layer.all_to_all
    meta = layer._metadata()  # the forward context's attention metadata (upstream's backends), read once
    handles: dict[tuple[str, int], object] = {}
    landed: dict[tuple[str, int], torch.Tensor] = {}
    attended: dict[int, torch.Tensor] = {}
    rep_outs: dict[int, torch.Tensor] = {}
    for step in steps if steps is not None else schedule(chunks):
        g = step.group
        if step.kind == "start" and step.role == "qkv":
            sl = slice(first[g], first[g + 1])
            packed = torch.cat([q[:, :, sl], k[:, :, sl], v[:, :, sl]], dim=0)
            handles["qkv", g] = exchange(packed, 2, 1, "qkv", async_op=True, **kws[g], **_tag(layer, "qkv", g))
        elif step.kind == "start":
            handles["out", g] = exchange(attended.pop(g), 1, 2, "out", async_op=True, **kws[g], **_tag(layer, "out", g))
        elif step.kind == "wait":
            landed[step.role, g] = handles.pop((step.role, g)).wait()
        elif step.kind == "attend":
            qkv = landed.pop(("qkv", g))
            qkv = qkv[:, :seq] if seq < full else qkv
            qkv = layer._rotate(qkv, b, freqs_cis)
            if layer.attn_impl is not None:  # upstream's backend: its pre-processing, per head group
                qkv = layer.attn_impl.preprocess_qkv(qkv, meta)
            if replicated:
                mine = first[g] + sum(heads[g][:rank])
                qkv = torch.cat([qkv, rep[:, :, mine:mine + heads[g][rank]]], dim=1)
            q_, k_, v_ = qkv.chunk(3, dim=0)
            out = layer._attend_local(q_, k_, v_, meta)
            if replicated:
                rep_outs[g] = out[:, seq:]
                out = out[:, :seq]
            if layer.attn_impl is not None:
                out = layer.attn_impl.postprocess_output(out, meta)
            if seq < full:
                out = F.pad(out, (0, 0, 0, 0, 0, full - seq))
            attended[g] = out.contiguous()
    if handles:
        raise RuntimeError(f"overlap schedule left exchanges {sorted(handles)} unwaited")
    out = torch.cat([landed.pop(("out", g)) for g in range(chunks)], dim=2)
    replicated_out = None
    if replicated:
        replicated_out = _gather_replicated([rep_outs[g] for g in range(chunks)], heads, first, p)
    return out, replicated_out


def _gather_replicated(outs: list[torch.Tensor], heads: list[tuple[int, ...]], first: list[int],
                       p: int) -> torch.Tensor:
    """Every rank's heads of every group's replicated-token output, in head order: one all-gather over the heads
    (each rank's groups side by side), then one index to the layer's head order."""
    per_rank = [sum(hs[r] for hs in heads) for r in range(p)]
    even = all(n == per_rank[0] for n in per_rank)
    gathered = sequence_model_parallel_all_gather(torch.cat(outs, dim=2).contiguous(), dim=2,
                                                  splits=None if even else per_rank)
    position = {}  # global head -> its position in the gathered tensor
    at = 0
    for r in range(p):
        for g, hs in enumerate(heads):
            start = first[g] + sum(hs[:r])
            for j in range(hs[r]):
                position[start + j] = at
                at += 1
    index = torch.tensor([position[h] for h in range(len(position))], device=gathered.device)
    return gathered.index_select(2, index)


def agreed_chunks() -> int:
    """The agreed ``FASTVIDEO_ULYSSES_A2A_OVERLAP`` of the SP group (0 before the group agreed any settings)."""
    agreed = get_sp_group().settings
    return int(agreed[SETTING]) if agreed is not None else 0


def chunks_for(num_heads: int, overlap_chunks: int | None) -> int:
    """How many head groups a layer with ``num_heads`` pipelines over: its own ``overlap_chunks``, else the agreed
    setting capped at ``num_heads``; 0 or 1: not pipelined. Local (reads the agreed value)."""
    if overlap_chunks is not None:
        return overlap_chunks
    return min(agreed_chunks(), num_heads)
