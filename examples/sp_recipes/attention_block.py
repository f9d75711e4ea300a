"""A sequence-parallel DiT self-attention block and its single-device reference.

Q, K and V are packed on the batch dim so one all-to-all carries all three (``[3B, S/P, H, D] ->
[3B, S, H/P, D]``); attention runs on the local heads over the whole sequence; a second all-to-all
returns ``[B, S/P, H, D]``. A sequence or a head count the SP size does not divide is split unevenly
(``seq_splits``; heads by ``balanced_splits``), never padded. The reference is the same module run on the
whole sequence with no collective, so ``forward(x_shard)`` must equal ``forward_reference(x)[shard]`` up to
rounding.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from fastvideo.attention.dense import attention
from fastvideo.distributed.communication_op import balanced_splits, sequence_model_parallel_all_to_all_4D
from fastvideo.distributed.parallel_state import get_sp_group


class SPSelfAttention(nn.Module):
    """Multi-head self-attention whose sequence is sharded over the SP group (Ulysses)."""

    def __init__(self, hidden: int, heads: int, *, dtype: torch.dtype = torch.float32, device=None) -> None:
        super().__init__()
        if hidden % heads:
            raise ValueError(f"SPSelfAttention: hidden={hidden} must be divisible by heads={heads}.")
        self.heads, self.head_dim = heads, hidden // heads
        self.qkv = nn.Linear(hidden, 3 * hidden, dtype=dtype, device=device)
        self.proj = nn.Linear(hidden, hidden, dtype=dtype, device=device)

    def _qkv(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # [B, S, 3, H, D] -> [3B, S, H, D]: Q, K, V packed on the batch dim for one all-to-all.
        qkv = self.qkv(x).view(b, s, 3, self.heads, self.head_dim)
        # contiguous(): with B = 1 the reshape is a strided view, which the fused route would decline.
        return qkv.permute(2, 0, 1, 3, 4).reshape(3 * b, s, self.heads, self.head_dim).contiguous()

    def forward(self, x_local: torch.Tensor, *, seq_splits: Sequence[int] | None = None) -> torch.Tensor:
        """``x_local``: this rank's ``[B, S_local, hidden]`` shard. Collective over the SP group. ``seq_splits``:
        every rank's ``S_local`` where they differ (None: equal shards); heads the SP size does not divide are
        split by ``balanced_splits``."""
        b = x_local.shape[0]
        world = get_sp_group().world_size
        heads = balanced_splits(self.heads, world) if self.heads % world else None
        packed = sequence_model_parallel_all_to_all_4D(self._qkv(x_local), scatter_dim=2, gather_dim=1,
                                                       seq_splits=seq_splits, head_splits=heads)
        q, k, v = packed.split(b, dim=0)
        out = attention(q, k, v)  # [B, S, this rank's heads, D]
        out = sequence_model_parallel_all_to_all_4D(out.contiguous(), scatter_dim=1, gather_dim=2,
                                                    seq_splits=seq_splits, head_splits=heads)
        return self.proj(out.reshape(b, out.shape[1], -1))

    def forward_reference(self, x: torch.Tensor) -> torch.Tensor:
        """The same block on the whole ``[B, S, hidden]`` sequence on one device (no collective)."""
        b = x.shape[0]
        q, k, v = self._qkv(x).split(b, dim=0)
        out = attention(q, k, v)
        return self.proj(out.reshape(b, out.shape[1], -1))
