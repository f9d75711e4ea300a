"""Rotary position embedding as upstream FastVideo applies it (``_apply_rotary_emb``), and the 3-D (frame,
height, width) tables a video DiT uses. Pure tensor code.
"""

from __future__ import annotations

import torch

__all__ = ["apply_rotary_emb", "rotary_3d"]


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     is_neox_style: bool = False) -> torch.Tensor:
    """``x`` ``[..., S, H, D]`` rotated by the angles whose ``cos``/``sin`` are ``[S, D // 2]`` (or ``[S, D]``).

    Half-width tables rotate pairs: ``(x[2i], x[2i+1])`` (GPT-J style, ``is_neox_style=False``, what upstream's
    attention layers use) or ``(x[i], x[i + D/2])`` (NeoX). Full-width tables (HunyuanVideo's) rotate the
    interleaved pairs with ``x * cos + rotate_half(x) * sin``. Computed in float32 (float64 for float64 ``x``),
    returned in ``x``'s dtype.
    """
    d = x.shape[-1]
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[-1] not in (d, d // 2) or cos.shape[0] != x.shape[-3]:
        raise ValueError(f"apply_rotary_emb: cos/sin {tuple(cos.shape)}/{tuple(sin.shape)} must both be [S, D/2] or "
                         f"[S, D] for x of shape {tuple(x.shape)} (S = {x.shape[-3]}, D = {d}).")
    compute = torch.promote_types(x.dtype, torch.float32)
    cos, sin = cos.unsqueeze(-2).to(compute), sin.unsqueeze(-2).to(compute)  # broadcast over heads
    xf = x.to(compute)
    if cos.shape[-1] == d:
        real, imag = xf.unflatten(-1, (-1, 2)).unbind(-1)
        rotated = torch.stack([-imag, real], dim=-1).flatten(-2)
        return (xf * cos + rotated * sin).to(x.dtype)
    if is_neox_style:
        x1, x2 = xf.chunk(2, dim=-1)
    else:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
    o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    out = torch.cat((o1, o2), dim=-1) if is_neox_style else torch.stack((o1, o2), dim=-1).flatten(-2)
    return out.to(x.dtype)


_apply_rotary_emb = apply_rotary_emb  # upstream's name, imported by its model code


def rotary_3d(frames: int, height: int, width: int, head_dim: int, *, theta: float = 10000.0,
              device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each ``[frames * height * width, head_dim // 2]``, for tokens in (frame, height, width)
    order: the head dim's rotary pairs split between the three axes as Wan does (the frame axis gets what the
    two spatial axes, equal shares rounded down to even, leave)."""
    if head_dim % 2:
        raise ValueError(f"rotary_3d: head_dim={head_dim} must be even.")
    half = head_dim // 2
    spatial = half // 3  # rotary pairs per spatial axis
    parts = (half - 2 * spatial, spatial, spatial)
    angles = []
    for size, pairs in zip((frames, height, width), parts, strict=True):
        inv = 1.0 / theta ** (torch.arange(pairs, dtype=torch.float64, device=device) / max(pairs, 1))
        angles.append(torch.outer(torch.arange(size, dtype=torch.float64, device=device), inv))
    f, h, w = angles
    grid = torch.cat([
        f[:, None, None, :].expand(frames, height, width, -1),
        h[None, :, None, :].expand(frames, height, width, -1),
        w[None, None, :, :].expand(frames, height, width, -1),
    ], dim=-1).reshape(frames * height * width, half)
    return grid.cos().float(), grid.sin().float()
