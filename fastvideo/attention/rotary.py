"""Rotary position embedding as upstream FastVideo applies it in its attention layers (``apply_rotary``, also
under upstream's name ``_apply_rotary_emb``), and the 3-D (frame, height, width) tables a video DiT uses. Pure
tensor code.

This module is at a path upstream FastVideo does not have, so nothing of upstream's imports it. Upstream's
``fastvideo.layers.rotary_embedding.apply_rotary_emb`` is another function (complex ``freqs_cis``); this module
does not define that name. ``tests/test_rotary_embedding.py`` compares ``apply_rotary`` with upstream's
``_apply_rotary_emb`` where the unpacked wheel is importable.
"""

from __future__ import annotations

import torch

__all__ = ["apply_rotary", "rotary_3d"]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox_style: bool = False) -> torch.Tensor:
    """``x`` ``[..., S, H, D]`` rotated by the angles whose ``cos``/``sin`` are ``[S, D // 2]`` (or ``[S, D]``, or
    any shape that broadcasts so over the heads, as upstream's).

    Half-width tables rotate pairs: ``(x[2i], x[2i+1])`` (GPT-J style, ``is_neox_style=False``, what upstream's
    attention layers use) or ``(x[i], x[i + D/2])`` (NeoX). Full-width tables (HunyuanVideo's) rotate the
    interleaved pairs with ``x * cos + rotate_half(x) * sin``. Upstream's arithmetic: ``x`` in float32 times the
    tables in their own dtype (type promotion), each half cast back to ``x``'s dtype, so the result is identical to
    upstream's; except that a float64 ``x`` is computed in float64 (upstream rounds it to float32 first).
    """
    d = x.shape[-1]
    fits = cos.shape == sin.shape and cos.shape[-1] in (d, d // 2)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over the heads
    want = (*x.shape[:-1], cos.shape[-1])
    try:
        fits = fits and torch.broadcast_shapes(cos.shape, want) == want
    except RuntimeError:
        fits = False
    if not fits:
        given = "/".join(str(tuple(t.shape[:-2] + t.shape[-1:])) for t in (cos, sin))
        raise ValueError(f"apply_rotary: cos/sin {given} must both be [S, D/2] or [S, D] for x of shape "
                         f"{tuple(x.shape)} (S = {x.shape[-3] if x.dim() >= 3 else '?'}, D = {d}): they do not "
                         "broadcast over x.")
    xf = x if x.dtype == torch.float64 else x.float()
    if cos.shape[-1] == d:
        real, imag = xf.unflatten(-1, (-1, 2)).unbind(-1)
        rotated = torch.stack([-imag, real], dim=-1).flatten(-2)
        return (xf * cos + rotated * sin).to(x.dtype)
    if is_neox_style:
        x1, x2 = xf.chunk(2, dim=-1)
    else:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
    o1, o2 = (x1 * cos - x2 * sin).to(x.dtype), (x2 * cos + x1 * sin).to(x.dtype)
    return torch.cat((o1, o2), dim=-1) if is_neox_style else torch.stack((o1, o2), dim=-1).flatten(-2)


_apply_rotary_emb = apply_rotary  # upstream's name (fastvideo.layers.rotary_embedding) for this same function


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
