"""Dense attention on one rank's heads: flash-attn where installed and applicable (bf16/fp16 on CUDA), SDPA
otherwise. What ``DistributedAttention`` computes with when no upstream attention backend is present.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

__all__ = ["attention", "attention_backend"]


def _flash_attn_usable(q: torch.Tensor) -> bool:
    return (
        q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and importlib.util.find_spec("flash_attn") is not None
    )


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, softmax_scale: float | None = None,
              causal: bool = False, deterministic: bool = False) -> torch.Tensor:
    """Attention on ``[B, S, H, D]`` (``k``, ``v``: ``[B, S_kv, H_kv, D]``, ``H_kv`` dividing ``H``): flash-attn when
    installed and applicable (bf16/fp16 on CUDA), SDPA otherwise. ``softmax_scale`` defaults to ``D ** -0.5``.
    ``causal`` masks key j > query i (q and k of one length, where both backends agree). ``deterministic``:
    flash-attn's deterministic backward (its default accumulates dQ with atomics, so two identical steps can
    differ in the last bits)."""
    if _flash_attn_usable(q):
        from flash_attn import flash_attn_func

        return flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal, deterministic=deterministic)
    extra = {"enable_gqa": True} if k.shape[2] != q.shape[2] else {}
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
                                         scale=softmax_scale, **extra)
    return out.transpose(1, 2)


def attention_backend(q: torch.Tensor) -> str:
    return "flash-attn" if _flash_attn_usable(q) else "sdpa"
