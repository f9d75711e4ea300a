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

from fastvideo.distributed.parallel_state import get_sp_group
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
