"""The public Ulysses all-to-all.

``sequence_model_parallel_all_to_all_4D`` is what models call. Mode 0 (``scatter_dim=2, gather_dim=1``)
trades the sequence shard for a head shard, ``[B, S/P, H, D] -> [B, S, H/P, D]``; mode 1
(``scatter_dim=1, gather_dim=2``) is its inverse. Both are differentiable: the backward of one is the
other.

Routes: ``FASTVIDEO_ULYSSES_A2A=off`` (default) always takes the NCCL route (permute +
``all_to_all_single`` + permute over the SP device group; over gloo on CPU), with no vote. ``auto``
asks the Ulysses helper, which votes collectively on every call and runs the fused transport where
every rank agrees it can, the NCCL route otherwise. The NCCL route is the correctness oracle.

Like any torch collective, every SP rank must call the op with matching tensors (shape, dtype, mode,
``requires_grad``), in the same order. Checked mode (``FASTVIDEO_ULYSSES_A2A_CHECKED=1``, or torch's
``TORCH_DISTRIBUTED_DEBUG=DETAIL``) checks that on every call and every route: each call votes its
12-field contract first, and a disagreement raises ``ContractMismatchError`` on every rank, a caller
error on one rank (invalid input, a meta tensor) raises there and ``PeerCallError`` on its peers.

The op is ``torch.ops.fastvideo.ulysses_all_to_all_4d`` (``ulysses/ops.py``): ``torch.compile`` sees one
opaque call (``fullgraph=True`` works) that votes each time the graph runs. Eager calls with plain
tensors run the same implementation without the dispatcher.

The settings are the SP group's agreed ones (``parallel_state.initialize_sequence_parallel`` agreed them
on every rank); a change of the environment between calls is re-agreed before the route is chosen
(``fastvideo/distributed/settings.py``), so ranks never take different routes.

This module is the top of the stack: it imports the op, the helper, the NCCL route and the layouts,
and nothing below imports it. The names other code imported from here before the layers were split
(``nccl_route``, ``validate_input``, ``mode_for_dims``, ``reference_all_to_all``, ...) stay
importable from here.
"""

from __future__ import annotations

import torch

from fastvideo.distributed import utils as _utils
from fastvideo.distributed.device_communicators import ulysses_a2a as _ulysses_a2a  # noqa: F401 - registers
from fastvideo.distributed.parallel_state import get_sp_group
from fastvideo.distributed.parallel_state import get_tp_group as _get_tp_group
from fastvideo.distributed.parallel_state import model_parallel_is_initialized as _model_parallel_is_initialized
from fastvideo.distributed.settings import CHECKED as _CHECKED
from fastvideo.distributed.ulysses import ops as _ops
from fastvideo.distributed.ulysses.layout import (
    MODE_HEAD_GATHER,
    MODE_SEQ_GATHER,
    mode_for_dims,
    output_shape,
    reference_all_to_all,
    validate_input,
)
from fastvideo.distributed.ulysses.layout import recv_layout as _recv_layout
from fastvideo.distributed.ulysses.layout import send_layout as _send_layout
from fastvideo.distributed.ulysses.nccl import NcclAllToAll as _NcclAllToAll
from fastvideo.distributed.ulysses.nccl import nccl_route

__all__ = [
    "MODE_HEAD_GATHER",
    "MODE_SEQ_GATHER",
    "_NcclAllToAll",
    "_recv_layout",
    "_send_layout",
    "mode_for_dims",
    "nccl_route",
    "output_shape",
    "reference_all_to_all",
    "sequence_model_parallel_all_to_all_4D",
    "validate_input",
]


def sequence_model_parallel_all_to_all_4D(x: torch.Tensor, scatter_dim: int = 2, gather_dim: int = 1) -> torch.Tensor:
    """Ulysses all-to-all over the SP group. Collective; blocks the host only for a vote (``auto``, checked mode).

    ``(2, 1)``: ``[B, S/P, H, D] -> [B, S, H/P, D]``; ``(1, 2)``: the inverse. Differentiable. SP size 1
    returns ``x`` itself. Every SP rank must call it with matching tensors, in the same order (checked on
    every call in checked mode, ``FASTVIDEO_ULYSSES_A2A_CHECKED``). Raises ValueError for input no route
    can serve (not 4-D, another dim pair, heads or sequence not divisible by the SP size, a meta tensor
    outside tracing) before any collective; in checked mode after one vote, so that every rank raises.
    A FakeTensor (``torch.compile``, FakeTensorMode) gets a fake output and no collective. Safe under
    ``torch.compile`` (one opaque op, ``fullgraph=True``); under CUDA-graph capture the fused route declines
    and the NCCL route is captured (replay graphs in the same order on every rank).
    """
    if torch.compiler.is_compiling():
        # Traced by dynamo: checks on the (fake) input's shape, then one opaque op (its fake impl gives the
        # output's shape; its eager implementation votes each time the compiled graph runs).
        mode = mode_for_dims(scatter_dim, gather_dim)
        world_size = get_sp_group().world_size
        validate_input(x, mode, world_size)
        if world_size == 1:
            return x
        return torch.ops.fastvideo.ulysses_all_to_all_4d(x, mode, torch.is_grad_enabled() and x.requires_grad)[0]
    sp = get_sp_group()
    mode = -1  # in the vote of an invalid dim pair
    try:
        mode = mode_for_dims(scatter_dim, gather_dim)
        validate_input(x, mode, sp.world_size)
    except (TypeError, ValueError, RuntimeError) as exc:
        _ops.fail(x, mode, exc)  # checked mode: votes first, so every rank raises
    if sp.world_size == 1:
        return x
    settings = sp.agreed_settings()
    if settings["FASTVIDEO_ULYSSES_A2A"] == "off" and not settings[_CHECKED] and _ops.is_plain(x):
        return _NcclAllToAll.apply(x, mode, sp.device_group)  # the baseline: no vote, no dispatcher
    return _ops.all_to_all(x, mode)


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


def sequence_model_parallel_all_gather(input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Every SP rank's ``input_`` concatenated along ``dim``. Collective; does not block the host; traceable by
    ``torch.compile`` (torch's functional all-gather). Differentiable: each rank's gradient is the sum over SP
    ranks of the output gradient's slice it contributed (a reduce-scatter). SP size 1 returns ``input_``."""
    return get_sp_group().all_gather(input_, dim)


def sequence_model_parallel_all_gather_with_unpad(input_: torch.Tensor, original_seq_len: int,
                                                  dim: int = -1) -> torch.Tensor:
    """``sequence_model_parallel_all_gather``, then the first ``original_seq_len`` rows of ``dim``: undoes
    ``sequence_model_parallel_shard``'s padding. Collective; differentiable."""
    gathered = get_sp_group().all_gather(input_, dim)
    return _utils.unpad_sequence_tensor(gathered, original_seq_len, seq_dim=dim)


def sequence_model_parallel_shard(input_: torch.Tensor, dim: int = 1) -> tuple[torch.Tensor, int]:
    """``(this rank's shard, original length)``: ``input_`` (the same on every SP rank) padded with zeros along
    ``dim`` to a multiple of the SP size, and this rank's contiguous chunk of it. Local in the forward; the
    backward all-gathers every rank's gradient and divides it by the SP size (upstream's ``scale_grad=True``),
    so it is collective. SP size 1: ``(input_, its length)``."""
    sp = get_sp_group()
    original = input_.shape[dim]
    padded, padding = _utils.compute_padding_for_sp(original, sp.world_size)
    if padding:
        input_ = _utils.pad_sequence_tensor(input_, padded, seq_dim=dim)
    return sp.shard(input_, dim, scale_grad=True), original


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
    if _WARMED_UP is sp or sp.world_size == 1:
        _WARMED_UP = sp
        return
    device = torch.device(device) if device is not None else sp.device
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    p = sp.world_size
    x = torch.zeros(1, 16, 4 * p, 64, device=device, dtype=dtype)  # [B, S/P, H, D]: both modes' shapes
    y = sequence_model_parallel_all_to_all_4D(x, scatter_dim=2, gather_dim=1)
    sequence_model_parallel_all_to_all_4D(y, scatter_dim=1, gather_dim=2)
    sequence_model_parallel_all_gather(y[:, :8], dim=2)  # as for replicated tokens: heads gathered
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    _WARMED_UP = sp


def _tp_size_one(what: str) -> None:
    size = _get_tp_group().world_size
    if size != 1:
        raise NotImplementedError(f"{what}: TP collectives are not part of this package (TP size {size}); it "
                                  "serves sequence parallelism (docs/fastvideo_migration.md).")


def tensor_model_parallel_all_reduce(input_: torch.Tensor) -> torch.Tensor:
    """Upstream's TP all-reduce at TP size 1: ``input_`` itself; raises NotImplementedError at TP size > 1."""
    _tp_size_one("tensor_model_parallel_all_reduce")
    return input_


def tensor_model_parallel_all_gather(input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Upstream's TP all-gather at TP size 1: ``input_`` itself; raises NotImplementedError at TP size > 1."""
    _tp_size_one("tensor_model_parallel_all_gather")
    return input_
