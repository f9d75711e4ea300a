"""FSDP2 (``torch.distributed.fsdp.fully_shard``) for a DiT: every block, then the root, over one mesh.

    mesh = world_mesh(device)
    model = shard_dit(model, mesh, blocks=model.blocks, param_dtype=torch.bfloat16)

The mesh spans the world (SP and DP ranks alike), as the DiT benchmark's: parameters, gradients and optimizer
state are sharded over every rank, and the reduce-scatter averages gradients over all of them. Works over NCCL
and over gloo on CPU (torch 2.13 and 2.11: ``docs/fastvideo_migration.md``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

__all__ = ["shard_dit", "world_mesh"]


def world_mesh(device: torch.device) -> DeviceMesh:
    """A 1-D mesh over every rank on ``device``'s type. Collective (the first time a mesh is built)."""
    return init_device_mesh(device.type, (dist.get_world_size(),))


def shard_dit(model: nn.Module, mesh: DeviceMesh, *, blocks: Sequence[nn.Module],
              param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype = torch.float32,
              prefetch: bool = True) -> nn.Module:
    """``fully_shard`` each of ``blocks`` and then ``model`` (which keeps the rest: embeddings, head) over ``mesh``.

    ``param_dtype``: compute dtype (None: the parameters' own); gradients are reduced in ``reduce_dtype``.
    ``prefetch``: each block all-gathers its neighbour's parameters ahead, forward and backward. Collective at the
    first forward, not here. Returns ``model`` (sharded in place).
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    if prefetch:
        blocks = list(blocks)
        for i, block in enumerate(blocks):
            if i + 1 < len(blocks):
                block.set_modules_to_forward_prefetch([blocks[i + 1]])
            if i > 0:
                block.set_modules_to_backward_prefetch([blocks[i - 1]])
    return model
