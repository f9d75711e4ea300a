"""Rotary embedding (upstream's ``_apply_rotary_emb`` conventions) against complex multiplication."""

from __future__ import annotations

import pytest
import torch

from fastvideo.attention.rotary import _apply_rotary_emb, apply_rotary_emb, rotary_3d


def _angles(s: int, half: int) -> torch.Tensor:
    return torch.rand(s, half, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 6


@pytest.mark.parametrize("neox", [False, True])
def test_half_width_tables_rotate_pairs_as_complex_numbers(neox):
    x = torch.randn(2, 5, 3, 8, dtype=torch.float64)
    a = _angles(5, 4)
    got = apply_rotary_emb(x, a.cos(), a.sin(), is_neox_style=neox)
    pairs = torch.stack(x.chunk(2, -1), -1) if neox else x.unflatten(-1, (4, 2))
    z = torch.view_as_complex(pairs.contiguous()) * torch.polar(torch.ones_like(a), a)[:, None, :]
    want = torch.view_as_real(z)
    want = torch.cat(want.unbind(-1), -1) if neox else want.flatten(-2)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert _apply_rotary_emb is apply_rotary_emb


def test_full_width_tables_rotate_half_interleaved():
    x = torch.randn(1, 4, 2, 6, dtype=torch.float64)
    a = _angles(4, 3).repeat_interleave(2, -1)  # the same angle for both members of a pair
    got = apply_rotary_emb(x, a.cos(), a.sin())
    want = apply_rotary_emb(x, a.cos()[:, ::2], a.sin()[:, ::2])
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_rotary_3d_tables_and_bad_shapes():
    cos, sin = rotary_3d(2, 3, 4, 16)
    assert cos.shape == sin.shape == (24, 8)
    torch.testing.assert_close(cos.square() + sin.square(), torch.ones_like(cos))
    assert torch.equal(cos[0], torch.ones(8))  # token (0, 0, 0): no rotation
    x = torch.randn(1, 24, 2, 16)
    assert apply_rotary_emb(x, cos, sin).norm() == pytest.approx(x.norm().item(), rel=1e-5)  # rotations keep norms
    with pytest.raises(ValueError, match=r"must both be \[S, D/2\] or \[S, D\]"):
        apply_rotary_emb(x, cos[:5], sin[:5])
    with pytest.raises(ValueError, match="head_dim=7 must be even"):
        rotary_3d(1, 1, 1, 7)
