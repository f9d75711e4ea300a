"""The public Ulysses all-to-all, the top of the stack (nothing below imports this module).

``sequence_model_parallel_all_to_all_4D`` is what models call. Mode 0 (``scatter_dim=2, gather_dim=1``)
trades the sequence shard for a head shard, ``[B, S/P, H, D] -> [B, S, H/P, D]``; mode 1
(``scatter_dim=1, gather_dim=2``) is its inverse; ``seq_splits`` / ``head_splits`` give every rank's share
where P does not divide them (no padding). It validates its input, then calls the one ``torch.library`` op
(``ulysses/ops.py``), whose registered autograd formula is the only backward.

Routes, as the SP group agreed them (``ulysses/registry.py``): ``FASTVIDEO_ULYSSES_A2A=off`` (default)
always takes the NCCL route (permute + ``all_to_all_single`` + permute over the SP device group; over gloo
on CPU) with no vote; ``auto`` asks the Ulysses helper, which votes collectively on every call and runs the
fused transport where every rank agrees it can, the NCCL route otherwise. The NCCL route is the
correctness oracle.

Like any torch collective, every SP rank must call the op with matching tensors (shape, dtype, mode,
``requires_grad``), in the same order. Checked mode checks that on every call and every route, the NCCL route
included: on by default under ``auto`` (``FASTVIDEO_ULYSSES_A2A_CHECKED=0`` turns it off), and under ``off`` with
``FASTVIDEO_ULYSSES_A2A_CHECKED=1`` or torch's ``TORCH_DISTRIBUTED_DEBUG=DETAIL``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from fastvideo.distributed import utils as _utils
from fastvideo.distributed.all_to_all import (
    EVEN,
    MODE_HEAD_GATHER,
    MODE_SEQ_GATHER,
    MODES,
    Splits,
    balanced_splits,
    mode_for_dims,
    nccl_route,
    output_shape,
    reference_all_to_all,
    shares,
    validate_input,
)
from fastvideo.distributed.all_to_all import check_dim as _check_dim
from fastvideo.distributed.parallel_state import get_sp_group
from fastvideo.distributed.parallel_state import get_tp_group as _get_tp_group
from fastvideo.distributed.parallel_state import model_parallel_is_initialized as _model_parallel_is_initialized
from fastvideo.distributed.ulysses import ops as _ops
from fastvideo.distributed.ulysses.exchange import AllToAllHandle
from fastvideo.distributed.ulysses.exchange import voted_errors as _voted_errors

logger = logging.getLogger(__name__)

__all__ = [
    "EVEN",
    "MODE_HEAD_GATHER",
    "MODE_SEQ_GATHER",
    "AllToAllHandle",
    "Splits",
    "balanced_splits",
    "mode_for_dims",
    "nccl_route",
    "output_shape",
    "reference_all_to_all",
    "sequence_model_parallel_all_to_all_4D",
    "validate_input",
]


def sequence_model_parallel_all_to_all_4D(input_: torch.Tensor, scatter_dim: int = 2, gather_dim: int = 1, *,
                                          seq_splits: Sequence[int] | None = None,
                                          head_splits: Sequence[int] | None = None,
                                          tag: str | None = None,
                                          async_op: bool = False) -> torch.Tensor | AllToAllHandle:
    """Ulysses all-to-all over the SP group: collective; blocks the host only for a vote (``auto``, checked mode);
    capture-safe; differentiable (twice too).

    ``(2, 1)``: ``[B, S/P, H, D] -> [B, S, H/P, D]``; ``(1, 2)``: the inverse. Shares that P does not divide:
    ``seq_splits`` and ``head_splits``, every rank's sequence rows and heads (``P`` non-negative ints each, the
    same on every rank; None: even). Rank ``r`` then passes ``[B, seq_splits[r], sum(head_splits), D]`` to
    ``(2, 1)`` and gets ``[B, sum(seq_splits), head_splits[r], D]``; ``(1, 2)`` is the inverse, and the backward
    runs it with the same tables. A share of 0 is an idle rank (zero-size tensors in and out). SP size 1
    returns ``input_`` itself.

    Every SP rank must call it with matching tensors and tables, in the same order, from one thread of its process
    (as any torch collective on one group; checked on every call in checked mode, ``FASTVIDEO_ULYSSES_A2A_CHECKED``,
    and wherever the fused route votes: tables that differ raise ``ContractMismatchError`` on every rank).
    ``tag``: a non-empty str naming the call site, the same on every rank (e.g. ``"blocks.3.attn.qkv"``;
    ``DistributedAttention`` passes ``f"{prefix}.qkv"`` and ``f"{prefix}.out"``). Where the call votes, a rank
    that skipped or repeated a call with this tag then raises ``ContractMismatchError`` on every rank naming the
    tag; an untagged skip is not seen (every rank's untagged count moves with its own calls, so a rank one call
    short pairs its next call with the peer's skipped one).
    Raises ValueError for input no route can serve (not 4-D, another dim pair, a bad table or one that does not
    match ``input_``, heads or sequence not divisible by the SP size without a table, a meta tensor outside
    tracing; TypeError/ValueError for a tag that is not a non-empty str) before any collective; where the calls
    vote (checked mode, the default under ``auto``) after one vote, so that every rank raises (its peers
    ``PeerCallError`` naming this rank's error). A FakeTensor (``torch.compile``, FakeTensorMode) gets a fake output
    and no collective; ``torch.compile(fullgraph=True)`` traces one opaque op, which votes each time the graph
    runs.
    Under CUDA-graph capture every rank votes once and the agreed plan (with the tables) is frozen into the
    graph (or the NCCL route is captured); replay graphs in the same order on every rank.

    ``async_op=True``: returns an ``AllToAllHandle`` at once (after the vote, which stays on the host at issue) and
    the exchange runs on the communication stream: ``handle.wait()`` returns the output, the only way to get it,
    so nothing reads it before it landed; call ``wait()`` once, in the same order relative to other collectives
    on every rank. Streams, as torch states them for ``async_op`` collectives: the exchange is issued on this
    process's communication stream of ``input_``'s device after it waited for the current stream (so the input
    is read as it stood at the call); ``wait()`` makes the then-current stream wait for the exchange (it does not
    block the host) and returns the output ready on that stream. **The input is the caller's until ``wait()``**:
    the exchange may read it until then, so do not write it in between; an in-place write is caught at ``wait()``,
    which raises ``InputModifiedError`` on the rank that wrote (the version counter; not under
    ``torch.inference_mode``, whose tensors have none, nor writes through ``.data``: ``ulysses/exchange.py``); on
    CUDA its peers may have received the written data, so that error must end the step (on CPU the exchange sends
    a copy and every output is the input as it stood at the call). An ``nn.Parameter`` or another tensor subclass,
    or any input under a dispatch mode (``FlopCounterMode``), is copied at the start instead: a write in between is
    no error, and every output is the input as it stood at the call. ``record_stream`` keeps the input's memory
    from the allocator until the communication stream has read it, and the output's (allocated on the
    communication stream) until the stream that waited has used it. On CPU (gloo) the NCCL route runs in gloo's
    threads and ``wait()`` blocks until it landed. A handle dropped without ``wait()`` is released with a
    ``ResourceWarning`` naming where it was started. Differentiable (twice): the backward starts the reverse
    exchange where autograd reaches the ``wait`` and waits for it where it reaches the call, so the gradient
    exchange is in flight across the backward of what ran in between; a backward that votes (``auto``, checked
    mode) votes the SEQ word of the call it differentiates, so ranks whose autograd orders two backward exchanges
    differently raise together instead of swapping gradients (``off`` without checked mode votes nothing, and
    cannot see it: run a new training loop in checked mode once). ``torch.compile(fullgraph=True)`` traces a start
    and a wait node, and refuses a start without its wait in the region; under a manual CUDA-graph capture the side
    stream is forked and joined inside the graph (wait before the capture ends). Underneath: ``ulysses/ops.py``
    and ``ulysses/exchange.py``.
    """
    mode = MODES.get((scatter_dim, gather_dim))  # a dict lookup: the call enters each module once
    if mode is None:
        grad = torch.is_grad_enabled() and isinstance(input_, torch.Tensor) and input_.requires_grad
        with _voted_errors(get_sp_group(), -1, grad):  # checked mode: votes first (-1: an invalid dim pair)
            mode_for_dims(scatter_dim, gather_dim)
    return _ops.call(input_, mode, 0, seq_splits, head_splits, tag, async_op)


# ---------------------------------------------------------------------- upstream FastVideo's SP collectives
#
# What upstream's models call besides the all-to-all, with upstream's names, signatures and gradients. They
# run over the SP group's device communicator (``device_communicators/base_device_communicator.py``).

__all__ += [
    "sequence_model_parallel_all_gather",
    "sequence_model_parallel_all_gather_with_unpad",
    "sequence_model_parallel_shard",
    "tensor_model_parallel_all_gather",
    "tensor_model_parallel_all_reduce",
    "warmup_sequence_parallel_communication",
]


def sequence_model_parallel_all_gather(input_: torch.Tensor, dim: int = -1, *,
                                       splits: Sequence[int] | None = None) -> torch.Tensor:
    """Every SP rank's ``input_`` concatenated along ``dim``. Collective; does not block the host; traceable by
    ``torch.compile`` (torch's functional all-gather). Differentiable: each rank's gradient is the sum over SP
    ranks of the output gradient's slice it contributed (a reduce-scatter). SP size 1 returns ``input_``.

    ``splits`` (keyword-only, this package's; the same on every rank): every rank's rows along ``dim`` where they
    differ, e.g. the ``seq_splits`` of ``sequence_model_parallel_shard``; None: every rank has as many."""
    return get_sp_group().all_gather(input_, dim, splits=splits)


def sequence_model_parallel_all_gather_with_unpad(input_: torch.Tensor, original_seq_len: int, dim: int = -1, *,
                                                  seq_splits: Sequence[int] | None = None) -> torch.Tensor:
    """``sequence_model_parallel_all_gather``, then the first ``original_seq_len`` rows of ``dim``: undoes
    ``sequence_model_parallel_shard``'s padding. With ``seq_splits`` (the shard's uneven table, keyword-only)
    there was no padding: the shares are gathered as they are, and ``original_seq_len`` must be their sum.
    Collective; differentiable."""
    # A table must sum to original_seq_len (nothing to cut then); None passes.
    shares("sequence_model_parallel_all_gather_with_unpad", "seq_splits", seq_splits, get_sp_group().world_size,
           original_seq_len)
    gathered = sequence_model_parallel_all_gather(input_, dim, splits=seq_splits)
    return _utils.unpad_sequence_tensor(gathered, original_seq_len, seq_dim=dim)


def sequence_model_parallel_shard(input_: torch.Tensor, dim: int = 1, *,
                                  seq_splits: Sequence[int] | None = None) -> tuple[torch.Tensor, int]:
    """``(this rank's shard, original length)``: ``input_`` (the same on every SP rank) padded with zeros along
    ``dim`` to a multiple of the SP size, and this rank's contiguous chunk of it. Local in the forward; the
    backward all-gathers every rank's gradient and divides it by the SP size (upstream's ``scale_grad=True``),
    so it is collective. SP size 1: ``(input_, its length)``.

    ``seq_splits`` (keyword-only, this package's; the same on every rank): every rank's rows, summing to the
    length (``balanced_splits(length, P)`` cuts it as evenly as it goes): no padding, rank ``r`` gets rows
    ``sum(seq_splits[:r])`` on; pass the same table to the all-to-all and the all-gather after it."""
    sp = get_sp_group()
    dim = _check_dim("sequence_model_parallel_shard", input_, dim)
    original = input_.shape[dim]
    table = shares("sequence_model_parallel_shard", "seq_splits", seq_splits, sp.world_size, original)
    if table is None:  # equal chunks: zero rows appended up to a multiple of the SP size
        padded, _ = _utils.compute_padding_for_sp(original, sp.world_size)
        input_ = _utils.pad_sequence_tensor(input_, padded, seq_dim=dim)
    return sp.shard(input_, dim, scale_grad=True, splits=table), original


_WARMED_UP: object | None = None  # the SP coordinator the warm-up last ran on (new groups: warm up again)


def warmup_sequence_parallel_communication(device: torch.device | None = None) -> None:
    """Run the SP collectives once on small tensors (both all-to-all modes, an all-gather), so that lazy
    communicator set-up (and under ``auto`` the Ulysses helper's construction) happens before the first real
    step. Collective over the SP group; blocks the host until done. Once per set of SP groups; a no-op before
    they exist or at SP size 1, as upstream's. ``device``: the SP group's device by default."""
    global _WARMED_UP
    if not _model_parallel_is_initialized():
        return
    sp = get_sp_group()
    if _WARMED_UP is sp or sp.world_size == 1:  # size 1 has nothing to warm up
        return
    device = torch.device(device) if device is not None else sp.device
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    x = torch.zeros(1, 16, 4 * sp.world_size, 64, device=device, dtype=dtype)  # [B, S/P, H, D]: both modes' shapes
    y = sequence_model_parallel_all_to_all_4D(x, scatter_dim=2, gather_dim=1)
    sequence_model_parallel_all_to_all_4D(y, scatter_dim=1, gather_dim=2)
    sequence_model_parallel_all_gather(y[:, :8], dim=2)  # as for replicated tokens: heads gathered
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    _WARMED_UP = sp


def tensor_model_parallel_all_reduce(input_: torch.Tensor) -> torch.Tensor:
    """Upstream's TP all-reduce: the sum of ``input_`` over the TP group, out of place (TP size 1: ``input_``).
    Collective over the TP group; differentiable (the gradient is the all-reduced gradient)."""
    return _get_tp_group().all_reduce(input_)


def tensor_model_parallel_all_gather(input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Upstream's TP all-gather: every TP rank's ``input_`` joined along ``dim`` in group order (TP size 1:
    ``input_``). Collective over the TP group; differentiable (the gradient is reduce-scattered)."""
    return _get_tp_group().all_gather(input_, dim)
