"""The Ulysses all-to-all's data movement over ``torch.distributed``: input validation, the split tables, the
block layouts, and the NCCL route that moves those blocks. Below every group, helper and op.

The one place that decides what input any route can serve (``validate_input``, ``check_tag``): every entry
point validates through it once, before any vote or collective, and every route relies on it. Mode 0
(``scatter_dim=2, gather_dim=1``) trades the sequence shard for a head shard, mode 1 is its inverse. Each
rank's share is a row of two split tables, the same on every rank:

* ``seq_splits[r]``: the sequence rows rank ``r`` holds before mode 0 (after mode 1);
* ``head_splits[r]``: the heads rank ``r`` holds after mode 0 (before mode 1).

Mode 0 takes ``[B, seq_splits[r], H, D]`` with ``H = sum(head_splits)`` to ``[B, sum(seq_splits),
head_splits[r], D]``. ``None`` is the even table (``S_local`` rows and ``H / P`` heads on every rank): the
same layouts, with every block the same size. A share of 0 is an idle rank (zero-size tensors in and out).

The NCCL route (``nccl_route``) is pack + ``all_to_all_single`` + unpack over a process group (gloo on CPU):
always available, the correctness oracle, and the one implementation of that route (the op's decline path,
the op in flight, and ``DeviceCommunicatorBase.all_to_all_4D`` all run it).
"""

from __future__ import annotations

import math
import operator
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as _fc

from fastvideo.distributed.host_exchange import classify_failure, group_timeout_s

MODE_SEQ_GATHER = 0  # scatter heads (dim 2), gather sequence (dim 1)
MODE_HEAD_GATHER = 1  # scatter sequence (dim 1), gather heads (dim 2)
MODES = {(2, 1): MODE_SEQ_GATHER, (1, 2): MODE_HEAD_GATHER}  # (scatter_dim, gather_dim) -> mode
_OP = "sequence_model_parallel_all_to_all_4D"
_is_batched = torch._C._functorch.is_batchedtensor  # checked on every call: looked up once (a tensor that escaped
# a vmap is still batched after it: whether a transform is active says nothing of the tensor)
_Tensor, _STRIDED = torch.Tensor, torch.strided
_DIM_NAMES = {1: "sequence", 2: "heads"}
_COUNTED = {1: "sequence rows", 2: "heads"}


class Splits(NamedTuple):
    """Every rank's sequence and head shares (``validate_input``'s result). ``None``: the even table."""

    seq: tuple[int, ...] | None = None
    heads: tuple[int, ...] | None = None


EVEN = Splits()
Shape = tuple[int, int, int, int]


def mode_for_dims(scatter_dim: int, gather_dim: int) -> int:
    """Map a (scatter_dim, gather_dim) pair to its mode, or raise a ValueError naming the fix."""
    try:
        return MODES[(scatter_dim, gather_dim)]
    except KeyError:
        raise ValueError(
            f"{_OP}: (scatter_dim, gather_dim)=({scatter_dim}, {gather_dim}) is not "
            "supported; use (2, 1) before attention ([B, S/P, H, D] -> [B, S, H/P, D]) or (1, 2) after it."
        ) from None


def check_tag(tag: object, where: str = _OP) -> None:
    """Raise TypeError/ValueError, before any collective, for a tag that is not a non-empty ``str`` (or None)."""
    if tag is None:
        return
    if type(tag) is not str:
        raise TypeError(f"{where}: tag={tag!r} must be a str naming the call site (e.g. 'blocks.3.attn.qkv') or "
                        "None; it is in every vote of the call, so pass the same tag on every rank.")
    if not tag:
        raise ValueError(f"{where}: tag='' is empty; pass a non-empty str naming the call site, or None (untagged).")


def _table(name: str, value: Sequence[int] | None, world_size: int, op: str = _OP) -> tuple[int, ...] | None:
    """``value`` as a tuple of ``world_size`` non-negative ints, or a ValueError naming ``op``, ``name`` and the
    fix."""
    if value is None:
        return None
    what = f"one non-negative int per SP rank ({world_size}), the same on every rank"
    if isinstance(value, (str, bytes, torch.Tensor)) or not isinstance(value, Sequence):
        raise ValueError(f"{op}: {name} must be a list or tuple of {what}; got {type(value).__name__} {value!r}.")
    if len(value) != world_size:
        raise ValueError(f"{op}: {name} has {len(value)} entries for SP size {world_size}; pass {what}.")
    table = []
    for r, share in enumerate(value):
        # An int, or a SymInt: a share derived from a dynamic size under torch.compile (kept symbolic, compared
        # symbolically below); any other integer (a numpy one, say) becomes an int.
        try:
            if isinstance(share, bool):
                raise TypeError
            if not isinstance(share, (int, torch.SymInt)):
                share = operator.index(share)
        except TypeError:
            raise ValueError(f"{op}: {name}[{r}] = {share!r} is not an int; pass {what}.") from None
        if share < 0:
            raise ValueError(f"{op}: {name}[{r}] = {share} is negative; pass {what} (0: an idle rank).")
        table.append(share)
    # A dim (and the vote's int64 fields) holds less than 2**63; a SymInt is a real size, bounded already.
    if all(type(share) is int for share in table) and sum(table) >= 1 << 63:
        raise ValueError(f"{op}: {name} sums to {sum(table)}, more than a dim holds; pass {what}.")
    return tuple(table)


def validate_input(x: torch.Tensor, mode: int, world_size: int, rank: int = 0,
                   seq_splits: Sequence[int] | None = None, head_splits: Sequence[int] | None = None,
                   tag: object = None, *, allow_meta: bool = False) -> Splits:
    """Raise for input that no route can serve, before any collective; return the split tables.

    ``rank``: this rank's place in the SP group (which row of the tables ``x`` must match). Checked: ``x`` is a
    4-D tensor with real data (a meta tensor raises: ``allow_meta`` checks a shape only, for the CLI's
    ``explain``), not under ``vmap``; each table has one non-negative int per rank; in mode 0 ``x`` is
    ``[B, seq_splits[rank], sum(head_splits), D]``, in mode 1 ``[B, sum(seq_splits), head_splits[rank], D]``;
    a ``None`` table needs the dim it splits divisible by the SP size; ``tag`` is None or a non-empty str
    (``check_tag``). In checked mode the op then votes the error, so that every rank raises."""
    # Every call's case first (a plain tensor, even tables, input that passes): the same checks as below, fewest
    # bytecodes; anything else, including every error, takes the full path and its messages.
    if seq_splits is None and head_splits is None and type(x) is _Tensor and (mode == 0 or mode == 1):
        shape = x.shape
        if (len(shape) == 4 and not shape[2 - mode] % world_size and not x.is_meta and x.layout is _STRIDED
                and not _is_batched(x) and (tag is None or (type(tag) is str and tag))):
            return EVEN
    check_tag(tag)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{_OP}: x must be a torch.Tensor, got {type(x).__name__}.")
    if mode not in (MODE_SEQ_GATHER, MODE_HEAD_GATHER):
        raise ValueError(f"{_OP}: mode={mode!r} must be 0 (scatter heads, gather sequence) or 1 (the inverse).")
    if x.dim() != 4:
        raise ValueError(
            f"{_OP}: x must be 4-D [B, S, H, D], got shape {tuple(x.shape)}; reshape packed heads to [B, S, H, D] "
            "first."
        )
    if x.layout is not _STRIDED:  # a sparse or other layout has no rows to move (and no data pointer)
        raise ValueError(f"{_OP}: x is a {x.layout} tensor; the all-to-all moves dense tensors: pass x.to_dense().")
    if x.is_meta and not allow_meta:
        raise ValueError(
            f"{_OP}: x is a meta tensor (a shape without data). The all-to-all moves data between ranks, and "
            "returning a meta output here would leave the peers waiting in the collective. Pass real tensors; to "
            "trace shapes, use torch.compile or FakeTensorMode, where the op returns a fake output without any "
            "collective."
        )
    if _is_batched(x):
        raise RuntimeError(
            f"{_OP} does not support torch.func.vmap: it would run one collective per batch element and ranks that "
            "disagree on the batch size hang. Fold the batch into dim 0 instead."
        )
    seq = _table("seq_splits", seq_splits, world_size)
    heads = _table("head_splits", head_splits, world_size)
    if (seq is not None or heads is not None) and not 0 <= rank < world_size:  # the rank reads a table's row
        raise ValueError(f"{_OP}: rank={rank} is outside the SP group of size {world_size}.")
    _, s, h, _ = x.shape
    dims = "(2, 1)" if mode == MODE_SEQ_GATHER else "(1, 2)"
    # Mode 0's x holds this rank's share of the sequence and every head; mode 1's every sequence row and its
    # share of the heads.
    own, whole = ((seq, "seq_splits", 1, s), (heads, "head_splits", 2, h)) if mode == MODE_SEQ_GATHER else (
        (heads, "head_splits", 2, h), (seq, "seq_splits", 1, s))
    table, name, dim, size = own
    if table is not None and size != table[rank]:
        raise ValueError(
            f"{_OP}: {name}[{rank}] = {table[rank]} but this rank's x has {size} {_COUNTED[dim]} (dim {dim}, shape "
            f"{tuple(x.shape)}); with {dims} rank r passes its own share, {name}[r], in dim {dim}."
        )
    table, name, dim, size = whole
    if table is None and size % world_size:  # the even table (every call without splits): the scattered dim divides
        raise ValueError(
            f"{_OP}: {_DIM_NAMES[dim]} (dim {dim}) = {size} is not divisible by the SP size {world_size}; pass {name} "
            "(every rank's share, the same on every rank) or choose an SP size that divides it."
        )
    if table is not None and sum(table) != size:
        raise ValueError(
            f"{_OP}: {name} sums to {sum(table)} but x has {size} {_COUNTED[dim]} (dim {dim}, shape "
            f"{tuple(x.shape)}); with {dims} dim {dim} holds every rank's share, so sum({name}) must equal it."
        )
    return EVEN if seq is None and heads is None else Splits(seq, heads)


def shares(op: str, name: str, value: Sequence[int] | None, world_size: int,
           total: int | None = None) -> tuple[int, ...] | None:
    """``value`` checked as every rank's share of a dim (``world_size`` non-negative ints, summing to ``total``
    where given), or None; a ValueError naming ``op`` and ``name`` otherwise. For the SP collectives besides the
    all-to-all (shard, all-gather), whose tables mean what ``seq_splits`` means to it."""
    table = _table(name, value, world_size, op)
    if table is not None and total is not None and sum(table) != total:
        raise ValueError(f"{op}: {name}={list(table)} sums to {sum(table)}, but the dim has {total} rows; pass "
                         f"shares that sum to {total} (balanced_splits({total}, {world_size}) cuts it evenly).")
    return table


def check_dim(op: str, x: torch.Tensor, dim: int) -> int:
    """``dim`` made non-negative, or a ValueError naming ``op`` where it is not a dim of ``x``. Local."""
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"{op}: dim={dim} is out of range for a tensor of shape {tuple(x.shape)}.")
    return dim % x.dim()


def balanced_splits(total: int, world_size: int) -> tuple[int, ...]:
    """``total`` cut into ``world_size`` shares as even as possible, the larger ones first: ``(4, 3, 3)`` for 10
    over 3 (a table for ``seq_splits`` or ``head_splits`` where the SP size does not divide the dim)."""
    if total < 0 or world_size < 1:
        raise ValueError(f"balanced_splits: total={total} must be >= 0 and world_size={world_size} >= 1.")
    base, extra = divmod(total, world_size)
    return tuple(base + (r < extra) for r in range(world_size))


def tables(shape: Sequence[int], mode: int, world_size: int,
           splits: Splits = EVEN) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Every rank's (sequence rows, heads) for a call whose input on this rank has ``shape``: the given tables,
    or the even ones (``S_local`` rows and ``H / P`` heads each) where a table is None."""
    _, s, h, _ = shape
    p = world_size
    seq = splits.seq if splits.seq is not None else (s if mode == MODE_SEQ_GATHER else s // p,) * p
    heads = splits.heads if splits.heads is not None else (h // p if mode == MODE_SEQ_GATHER else h,) * p
    return seq, heads


def output_shape(shape: Sequence[int], mode: int, world_size: int, *, rank: int = 0,
                 splits: Splits = EVEN) -> Shape:
    """The op's output shape on ``rank`` for an input of ``shape`` there (``rank`` matters for uneven tables)."""
    b, _, _, d = shape
    seq, heads = tables(shape, mode, world_size, splits)
    if mode == MODE_SEQ_GATHER:
        return (b, sum(seq), heads[rank], d)
    return (b, seq[rank], sum(heads), d)


def block_shapes(shape: Sequence[int], mode: int, world_size: int, rank: int,
                 splits: Splits = EVEN) -> tuple[list[Shape], list[Shape]]:
    """(sent, received): the shape of the block this rank sends to each rank p, and of the one it receives from
    each rank p, for an input of ``shape`` here. Mode 0 sends rank p its head share of this rank's rows and
    receives rank p's rows of its own head share; mode 1 is the inverse."""
    b, _, _, d = shape
    seq, heads = tables(shape, mode, world_size, splits)
    p = range(world_size)
    # Mode 0's blocks out are mode 1's blocks in: this rank's rows of every rank's heads, every rank's rows of its own.
    own_rows, own_heads = [(b, seq[rank], heads[q], d) for q in p], [(b, seq[q], heads[rank], d) for q in p]
    return (own_rows, own_heads) if mode == MODE_SEQ_GATHER else (own_heads, own_rows)


def scatter_dim(mode: int) -> int:
    """The dim the input is cut along into blocks by destination (heads in mode 0, sequence in mode 1)."""
    return 2 if mode == MODE_SEQ_GATHER else 1


def pack(x: torch.Tensor, dim: int, sizes: Sequence[int]) -> torch.Tensor:
    """``x`` cut along ``dim`` into blocks of ``sizes``, laid end to end in one flat contiguous tensor (block p,
    row-major, at the sum of the earlier blocks' sizes): one copy at most. Where every dim before ``dim`` has size 1
    the blocks already lie end to end (a view of contiguous ``x``); equal blocks move in one strided copy; unequal
    ones block by block into one buffer. Contiguous, never merely flat: a strided ``x`` can flatten to a 1-D view
    with a step, which the backends cannot send."""
    if all(n == 1 for n in x.shape[:dim]):
        return x.contiguous().view(-1)
    if all(n == sizes[0] for n in sizes):
        return x.reshape(*x.shape[:dim], len(sizes), sizes[0], *x.shape[dim + 1:]).movedim(dim, 0).contiguous().view(-1)
    flat = x.new_empty(x.numel())
    offset = 0
    for block in x.split(list(sizes), dim):
        flat[offset:offset + block.numel()].view(block.shape).copy_(block)
        offset += block.numel()
    return flat


def unpack(flat: torch.Tensor, shapes: Sequence[Shape], dim: int) -> torch.Tensor:
    """The inverse of ``pack``: blocks of ``shapes`` laid end to end in ``flat``, concatenated along ``dim`` (one
    copy; none where every dim before ``dim`` has size 1: the blocks are then the output's own layout)."""
    out = list(shapes[0])
    out[dim] = sum(shape[dim] for shape in shapes)
    if all(n == 1 for n in out[:dim]):
        return flat.view(out)
    blocks = flat.split([math.prod(shape) for shape in shapes])
    return torch.cat([block.view(shape) for block, shape in zip(blocks, shapes, strict=True)], dim)


def send_layout(x: torch.Tensor, mode: int, world_size: int, *, splits: Splits = EVEN) -> torch.Tensor:
    """This rank's send buffer, flat: the block for rank p (``block_shapes``' p-th sent shape) after the blocks for
    ranks 0..p-1. What the NCCL route's ``all_to_all_single`` moves."""
    seq, heads = tables(x.shape, mode, world_size, splits)
    return pack(x, scatter_dim(mode), heads if mode == MODE_SEQ_GATHER else seq)


def recv_layout(flat: torch.Tensor, mode: int, received: Sequence[Shape]) -> torch.Tensor:
    """This rank's output from its flat receive buffer: the block from rank p (``received[p]``) after those from
    ranks 0..p-1, concatenated along the gathered dim."""
    return unpack(flat, received, 3 - scatter_dim(mode))


def reference_all_to_all(inputs: list[torch.Tensor], mode: int, *, splits: Splits = EVEN) -> list[torch.Tensor]:
    """Every rank's NCCL-route output computed locally from every rank's input (no collective).

    The oracle for checks that simulate peers on one device: the exchange ``recv_r[p] = send_p[r]`` is exactly
    what ``all_to_all_single`` does between ``send_layout`` and ``recv_layout``.
    """
    world_size = len(inputs)
    blocks = []
    for p, x in enumerate(inputs):
        sent, _ = block_shapes(x.shape, mode, world_size, p, splits)
        blocks.append(send_layout(x, mode, world_size, splits=splits).split([math.prod(s) for s in sent]))
    outs = []
    for r, x in enumerate(inputs):
        _, received = block_shapes(x.shape, mode, world_size, r, splits)
        outs.append(recv_layout(torch.cat([blocks[p][r] for p in range(world_size)]), mode, received))
    return outs


# ---------------------------------------------------------------------------------------------------- the NCCL route


class CollectiveError(RuntimeError):
    """The NCCL route's collective failed on this rank (a synchronous backend, gloo on CPU): it timed out (a peer is
    stopped, stuck or not calling) or a peer closed the connection (it raised or exited). ``kind``: ``timeout``,
    ``closed`` or ``failed``. On NCCL (CUDA) a failure surfaces through torch's NCCL watchdog instead."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


def _split_sizes(shapes: list[Shape], itemsize: int) -> tuple[int, list[int] | None]:
    """(total bytes, per-rank split sizes in bytes, or None when they are equal: ``all_to_all_single``'s even
    split, which NCCL may serve with its own all-to-all)."""
    sizes = [math.prod(shape) * itemsize for shape in shapes]
    return sum(sizes), (None if all(n == sizes[0] for n in sizes) else sizes)


def nccl_route(x: torch.Tensor, mode: int, group: dist.ProcessGroup, *, splits: Splits = EVEN,
               async_op: bool = False, own_input: bool = False) -> torch.Tensor | Callable[[], torch.Tensor]:
    """The NCCL route: collective over ``group``; blocks the host only as ``all_to_all_single`` does; capture-safe on
    NCCL. ``x`` and ``splits`` must be what ``validate_input`` accepted. The exchange moves bytes, so every dtype
    goes (NCCL and gloo have no int16, and NCCL no complex types). A grad-tracked ``x`` (a direct caller:
    ``DeviceCommunicatorBase.all_to_all_4D``) is differentiable through torch's ``all_to_all_single`` formula (the
    gradient is the inverse exchange); the op calls it only where autograd does not record.

    ``async_op`` (gloo on CPU: the exchange then runs in the backend's threads) returns ``finish()`` instead of the
    output: it waits for the backend and lays the output out (call it once). The backend reads the send buffer
    until then; where that is a view of ``x`` (no pack copy was needed), ``own_input`` copies it first, so that
    ``x`` may be reused as soon as this returns."""
    world_size, rank = group.size(), group.rank()  # the group's own: dist.get_rank(group) walks c10d's maps
    sent, received = block_shapes(x.shape, mode, world_size, rank, splits)
    send = send_layout(x, mode, world_size, splits=splits)
    if torch.is_grad_enabled() and x.requires_grad:
        recv = _fc.all_to_all_single_autograd(send, [math.prod(s) for s in received], [math.prod(s) for s in sent],
                                              group)
        return recv_layout(recv, mode, received)
    total, recv_sizes = _split_sizes(received, x.element_size())
    _, send_sizes = _split_sizes(sent, x.element_size())
    recv = torch.empty(total, dtype=torch.uint8, device=x.device)
    send = send.view(torch.uint8)
    if own_input and send.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
        send = send.clone()
    start = time.perf_counter()
    try:
        work = dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=group, async_op=async_op)
    except RuntimeError as exc:
        raise _failure(group, exc, time.perf_counter() - start) from exc

    def finish(send: torch.Tensor = send) -> torch.Tensor:  # ``send`` held: the backend reads it until done
        if work is not None:
            try:
                work.wait()
            except RuntimeError as exc:
                raise _failure(group, exc, time.perf_counter() - start) from exc
        return recv_layout(recv.view(x.dtype), mode, received)

    return finish if async_op else finish()


def _failure(group: dist.ProcessGroup, exc: RuntimeError, seconds: float) -> CollectiveError:
    ranks = dist.get_process_group_ranks(group)
    timeout = group_timeout_s(group)
    limit = f"{timeout:g} s" if timeout is not None else "its timeout"
    kind = classify_failure(exc)
    if kind == "timeout":
        what = (f"timed out after {seconds:.1f} s (the SP group's timeout, {limit}: the default process group's "
                "unless initialize_sequence_parallel was given one): a peer is stopped, stuck, or not calling the op")
    elif kind == "closed":
        # A peer that raised closes its groups too, alive: the closed connection alone does not say it exited.
        what = f"failed after {seconds:.3f} s: the peer closed the connection (it raised or exited)"
    else:
        what = f"failed after {seconds:.3f} s"
    return CollectiveError(f"Ulysses all-to-all (NCCL route) over SP ranks {ranks} {what} ({exc}).", kind)
