"""The public Ulysses all-to-all.

``sequence_model_parallel_all_to_all_4D`` is what models call. Mode 0 (``scatter_dim=2,
gather_dim=1``) trades the sequence shard for a head shard, ``[B, S/P, H, D] -> [B, S, H/P, D]``;
mode 1 (``scatter_dim=1, gather_dim=2``) is its inverse. Both are differentiable: the backward of
one is the other.

Routes: ``FASTVIDEO_ULYSSES_A2A=off`` (default) always takes the NCCL route (permute +
``all_to_all_single`` + permute over the SP device group; over gloo on CPU), with no vote. ``auto``
asks the Ulysses helper, which votes collectively on every call and runs the fused transport where
every rank agrees it can, the NCCL route otherwise. The NCCL route is the correctness oracle.

The setting is the SP group's agreed one (``parallel_state.initialize_sequence_parallel`` agreed it
on every rank); a change of the environment between calls is re-agreed before the route is chosen
(``fastvideo/distributed/settings.py``), so ranks never take different routes.

This module is the top of the stack: it imports the helper, the NCCL route and the layouts, and
nothing below imports it. The names other code imported from here before the layers were split
(``nccl_route``, ``validate_input``, ``mode_for_dims``, ``reference_all_to_all``, ...) stay
importable from here.
"""

from __future__ import annotations

import torch

from fastvideo.distributed.parallel_state import get_sp_group
from fastvideo.distributed.ulysses.helper import get_default_helper
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
    """Ulysses all-to-all over the SP group. Collective, blocking on the host only under ``auto`` (the vote).

    ``(2, 1)``: ``[B, S/P, H, D] -> [B, S, H/P, D]``; ``(1, 2)``: the inverse. Differentiable.
    SP size 1 returns ``x`` itself. Raises ValueError for input no route can serve (not 4-D, another
    dim pair, heads or sequence not divisible by the SP size) before any collective.
    """
    sp = get_sp_group()
    mode = mode_for_dims(scatter_dim, gather_dim)
    validate_input(x, mode, sp.world_size)
    if sp.world_size == 1:
        return x
    if sp.agreed_settings()["FASTVIDEO_ULYSSES_A2A"] == "off":
        return _NcclAllToAll.apply(x, mode, sp.device_group)
    return get_default_helper().all_to_all(x, mode)
