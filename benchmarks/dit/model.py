"""The model the DiT step benchmark runs: the recipes' video DiT blocks (``examples/sp_recipes/video_dit.py``) on
video tokens alone, under FSDP2 (``examples/sp_recipes/fsdp.py``).

What the runner needs from it:

* ``build_model(config, device, attention, all_to_all) -> nn.Module``: collective (FSDP sharding over the world);
  ``config`` has ``hidden``, ``heads``, ``blocks``, ``dtype`` (the compute dtype name), ``seed``,
  ``no_checkpointing``; the module maps this rank's ``[B, S/P, hidden]`` shard to the same shape;
* every Ulysses all-to-all of the model goes through ``all_to_all(x, scatter_dim, gather_dim, name)`` with
  ``name`` ``qkv`` (the packed Q, K, V, mode 0) or ``out`` (the attention output, mode 1): the runner swaps the op
  (the communication-free stand-in) and times each call in the check pass through it (``DistributedAttention``'s
  ``all_to_all`` argument);
* ``SparseAttention`` (the block-sparse attention of ``--attention sparse``) and ``dense_attention``.

The model: ``blocks`` ``VideoDiTBlock``s (Wan-style: adaptive LayerNorm from a learned modulation in place of the
timestep's, QKV with RMSNorm on q and k, ``DistributedAttention`` (packed QKV, mode 0; attention on the local
heads; mode 1 back), output projection and gated residual; a modulated 4x GELU MLP and gated residual), without
text tokens or rotary, and a final LayerNorm. Per token and block the same multiply-adds as before (QKV 3h^2, proj
h^2, MLP 8h^2: ``estimate.forward_flops``) plus elementwise modulation. Every block and the root are
``fully_shard``-ed over the same ranks with forward/backward prefetch of the neighbouring block; fp32 master
weights, compute in ``config.dtype``; full activation checkpointing of every block unless ``no_checkpointing``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from benchmarks.harness.cli import DTYPES
from sp_recipes.fsdp import shard_dit, world_mesh
from sp_recipes.video_dit import VideoDiTBlock, VideoDiTConfig

SPARSE_BLOCK = 128
SPARSE_KEEP_EVERY = 10  # keep 1 key block in 10: 90% block sparsity

AllToAll = Callable[[torch.Tensor, int, int, str], torch.Tensor]


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The product's attention (flash-attn where installed, SDPA otherwise) on ``[B, S, H, D]``."""
    from fastvideo.attention.dense import attention

    return attention(q, k, v)


def attention_backend(probe: torch.Tensor) -> str:
    from fastvideo.attention.dense import attention_backend as backend

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


class TokenDiT(nn.Module):
    """The product's blocks on this rank's ``[B, S/P, hidden]`` video tokens; a learned modulation stands in for
    the timestep's (the benchmark has no diffusion timestep)."""

    def __init__(self, cfg: VideoDiTConfig, attn, all_to_all: AllToAll) -> None:
        super().__init__()
        attend = None if attn is dense_attention else attn  # the product's own attention unless it is another
        # Named as the product's VideoDiT names its blocks: each attention's two all-to-alls carry their call tags.
        self.blocks = nn.ModuleList(VideoDiTBlock(cfg, all_to_all=all_to_all, attend=attend, prefix=f"blocks.{i}")
                                    for i in range(cfg.depth))
        self.modulation = nn.Parameter(torch.randn(1, 6, cfg.hidden) / cfg.hidden ** 0.5)
        self.norm = nn.LayerNorm(cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.modulation.expand(x.shape[0], -1, -1)
        for block in self.blocks:
            x, _ = block(x, None, e)
        return self.norm(x)


def build_model(config, device: torch.device, attn, all_to_all: AllToAll) -> nn.Module:
    """The model, FSDP2-sharded over the world (module docstring). Collective."""
    cfg = VideoDiTConfig(hidden=config.hidden, heads=config.heads, depth=config.blocks,
                         checkpointing=not config.no_checkpointing)
    torch.manual_seed(config.seed)  # identical initial weights on every rank before sharding
    with torch.device(device):
        model = TokenDiT(cfg, attn, all_to_all)
    return shard_dit(model, world_mesh(device), blocks=model.blocks, param_dtype=DTYPES[config.dtype])
