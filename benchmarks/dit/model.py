"""The model the DiT step benchmark runs: sequence-parallel DiT blocks under FSDP2.

This module is the one to replace with the product model (``fastvideo/models/``). What the runner needs from it:

* ``build_model(config, device, attention, all_to_all) -> nn.Module``: collective (FSDP sharding over the world);
  ``config`` has ``hidden``, ``heads``, ``blocks``, ``dtype`` (the compute dtype name), ``seed``,
  ``no_checkpointing``; the module maps this rank's ``[B, S/P, hidden]`` shard to the same shape;
* every Ulysses all-to-all of the model goes through ``all_to_all(x, scatter_dim, gather_dim, name)`` with
  ``name`` ``qkv`` (the packed Q, K, V, mode 0) or ``out`` (the attention output, mode 1): the runner swaps the op
  (the communication-free stand-in) and times each call in the check pass through it;
* ``SparseAttention`` (the block-sparse attention of ``--attention sparse``) and ``dense_attention``.

The model: ``blocks`` DiT blocks (LayerNorm -> QKV -> all-to-all (packed QKV, mode 0) -> attention on the local
heads -> all-to-all back (mode 1) -> proj, residual; LayerNorm -> 4x GELU MLP, residual). Every block and the root
are ``fully_shard``-ed (FSDP2) over the same ranks, with explicit forward/backward prefetch of the neighbouring
block; fp32 master weights, compute in ``config.dtype`` (``MixedPrecisionPolicy(param_dtype, reduce_dtype=fp32)``);
full activation checkpointing of every block unless ``no_checkpointing``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from benchmarks.harness.cli import DTYPES

SPARSE_BLOCK = 128
SPARSE_KEEP_EVERY = 10  # keep 1 key block in 10: 90% block sparsity

AllToAll = Callable[[torch.Tensor, int, int, str], torch.Tensor]


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The product's attention (flash-attn where installed, SDPA otherwise) on ``[B, S, H, D]``."""
    from fastvideo.layers.attention import attention

    return attention(q, k, v)


def attention_backend(probe: torch.Tensor) -> str:
    from fastvideo.layers.attention import attention_backend as backend

    return backend(probe)


def _sparse_mask_mod(b, h, q_idx, kv_idx):
    return (q_idx // SPARSE_BLOCK - kv_idx // SPARSE_BLOCK) % SPARSE_KEEP_EVERY == 0


class SparseAttention:
    """flex_attention with a fixed 90%-sparse block mask (CUDA; built once per sequence length)."""

    def __init__(self, device: torch.device) -> None:
        from torch.nn.attention.flex_attention import flex_attention

        self.device = device
        self.fn = torch.compile(flex_attention, dynamic=False)
        self.masks: dict[int, object] = {}

    def mask(self, s: int):
        if s not in self.masks:
            from torch.nn.attention.flex_attention import BlockMask

            n = -(-s // SPARSE_BLOCK)
            q = torch.arange(n, device=self.device)
            # Key blocks j with (i - j) % 10 == 0 for query block i: the diagonal plus every 10th block.
            first = q % SPARSE_KEEP_EVERY
            count = (n - 1 - first) // SPARSE_KEEP_EVERY + 1
            # kv_indices is [q blocks, kv blocks]: the first count[i] entries of row i are used.
            idx = first[:, None] + SPARSE_KEEP_EVERY * torch.arange(n, device=self.device)[None, :]
            idx = torch.where(idx < n, idx, torch.zeros_like(idx)).to(torch.int32)
            # Listed as full blocks (the kernel applies no mask_mod inside them); mask_mod states the same
            # pattern element-wise for paths that evaluate it (eager flex_attention, to_dense).
            self.masks[s] = BlockMask.from_kv_blocks(
                torch.zeros_like(count, dtype=torch.int32)[None, None], idx[None, None],
                full_kv_num_blocks=count.to(torch.int32)[None, None], full_kv_indices=idx[None, None],
                BLOCK_SIZE=SPARSE_BLOCK, mask_mod=_sparse_mask_mod, seq_lengths=(s, s))
        return self.masks[s]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = self.fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=self.mask(q.shape[1]))
        return out.transpose(1, 2)


class DiTBlock(nn.Module):
    """One sequence-parallel DiT block on this rank's ``[B, S/P, hidden]`` shard."""

    def __init__(self, hidden: int, heads: int, attn, checkpointing: bool, all_to_all: AllToAll) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.norm1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.norm2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)
        self.attn = attn
        self.checkpointing = checkpointing
        self.all_to_all = all_to_all

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, hidden = x.shape
        qkv = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, self.head_dim)
        # Packed Q, K, V planes. contiguous(): with B = 1 the reshape is a strided view, which the fused
        # route declines (NON_CONTIGUOUS) while the NCCL route copies it silently.
        qkv = qkv.permute(2, 0, 1, 3, 4).reshape(3 * b, s, self.heads, self.head_dim).contiguous()
        qkv = self.all_to_all(qkv, 2, 1, "qkv")  # [3B, S, H/P, D]
        q, k, v = qkv.split(b, dim=0)
        out = self.all_to_all(self.attn(q, k, v).contiguous(), 1, 2, "out")  # [B, S/P, H, D]
        x = x + self.proj(out.reshape(b, s, hidden))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x)), approximate="tanh"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointing and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)


class DiT(nn.Module):
    def __init__(self, hidden: int, heads: int, blocks: int, attn, checkpointing: bool, all_to_all: AllToAll) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(DiTBlock(hidden, heads, attn, checkpointing, all_to_all) for _ in range(blocks))
        self.norm = nn.LayerNorm(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


def build_model(config, device: torch.device, attn, all_to_all: AllToAll) -> nn.Module:
    """The model, FSDP2-sharded over the world (module docstring). Collective."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(config.seed)  # identical initial weights on every rank before sharding
    with torch.device(device):
        model = DiT(config.hidden, config.heads, config.blocks, attn, not config.no_checkpointing, all_to_all)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=DTYPES[config.dtype], reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    blocks = list(model.blocks)
    for i, block in enumerate(blocks):  # prefetch the neighbouring block's parameters
        if i + 1 < len(blocks):
            block.set_modules_to_forward_prefetch([blocks[i + 1]])
        if i > 0:
            block.set_modules_to_backward_prefetch([blocks[i - 1]])
    return model
