"""Rotary embedding (upstream's ``_apply_rotary_emb`` conventions) against complex multiplication, and against
upstream's own function bit for bit where the unpacked wheel is present.

Upstream's function is taken from its file in the pinned wheel (``tests/upstream_tree.py``): its module imports the
rest of upstream FastVideo, so the test compiles that one function's own source, unchanged, against torch. Negative
control: a variant that casts the tables to ``x``'s dtype first differs from upstream's, so the bit-equality check
can fail.
"""

from __future__ import annotations

import ast

import pytest
import torch

from fastvideo.attention import rotary
from fastvideo.attention.rotary import _apply_rotary_emb, apply_rotary, rotary_3d
from tests import upstream_tree


def _angles(s: int, half: int) -> torch.Tensor:
    return torch.rand(s, half, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 6


@pytest.mark.parametrize("neox", [False, True])
def test_half_width_tables_rotate_pairs_as_complex_numbers(neox):
    x = torch.randn(2, 5, 3, 8, dtype=torch.float64)
    a = _angles(5, 4)
    got = apply_rotary(x, a.cos(), a.sin(), is_neox_style=neox)
    pairs = torch.stack(x.chunk(2, -1), -1) if neox else x.unflatten(-1, (4, 2))
    z = torch.view_as_complex(pairs.contiguous()) * torch.polar(torch.ones_like(a), a)[:, None, :]
    want = torch.view_as_real(z)
    want = torch.cat(want.unbind(-1), -1) if neox else want.flatten(-2)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert _apply_rotary_emb is apply_rotary


def test_full_width_tables_rotate_half_interleaved():
    x = torch.randn(1, 4, 2, 6, dtype=torch.float64)
    a = _angles(4, 3).repeat_interleave(2, -1)  # the same angle for both members of a pair
    got = apply_rotary(x, a.cos(), a.sin())
    want = apply_rotary(x, a.cos()[:, ::2], a.sin()[:, ::2])
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_rotary_3d_tables_and_bad_shapes():
    cos, sin = rotary_3d(2, 3, 4, 16)
    assert cos.shape == sin.shape == (24, 8)
    torch.testing.assert_close(cos.square() + sin.square(), torch.ones_like(cos))
    assert torch.equal(cos[0], torch.ones(8))  # token (0, 0, 0): no rotation
    x = torch.randn(1, 24, 2, 16)
    assert apply_rotary(x, cos, sin).norm() == pytest.approx(x.norm().item(), rel=1e-5)  # rotations keep norms
    with pytest.raises(ValueError, match="do not broadcast over x"):
        apply_rotary(x, cos[:5], sin[:5])
    with pytest.raises(ValueError, match=r"must both be \[S, D/2\] or \[S, D\]"):
        apply_rotary(x, cos[:, :3], sin[:, :3])
    with pytest.raises(ValueError, match="head_dim=7 must be even"):
        rotary_3d(1, 1, 1, 7)


def test_tables_that_broadcast_as_upstreams_do():
    """A batch of tables ``[B, S, D/2]`` broadcasts over the heads, as with upstream's function."""
    x = torch.randn(2, 5, 3, 8, dtype=torch.float64)
    a = _angles(5, 4)
    per_batch = apply_rotary(x, a.cos().expand(2, 5, 4), a.sin().expand(2, 5, 4))
    assert torch.equal(per_batch, apply_rotary(x, a.cos(), a.sin()))


def test_upstream_names_are_not_shadowed():
    """This module defines upstream's same-signature name and not upstream's other ``apply_rotary_emb``."""
    assert not hasattr(rotary, "apply_rotary_emb")
    assert rotary.__name__ not in {"fastvideo.layers.rotary_embedding"}


# ------------------------------------------------------------------------------------- upstream's function


def _upstream_apply_rotary_emb():
    path = upstream_tree.path("layers/rotary_embedding.py")
    source = path.read_text()
    fn = next((n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == "_apply_rotary_emb"),
              None)
    if fn is None:
        pytest.skip(f"{path} defines no _apply_rotary_emb")
    namespace: dict = {"torch": torch}
    exec(compile(ast.Module([fn], []), str(path), "exec"), namespace)  # upstream's own source, unchanged
    return namespace["_apply_rotary_emb"]


CASES = [(xd, td, style) for xd in (torch.float32, torch.bfloat16, torch.float16)
         for td in (torch.float32, torch.float64, torch.bfloat16) for style in ("gptj", "neox", "full")]


def _case(x_dtype, table_dtype, style):
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(6, 7, 3, 16, generator=g) * 3).to(x_dtype)  # [3B, S, H, D] as after the exchange
    width = 16 if style == "full" else 8
    a = torch.rand(7, width, generator=g, dtype=torch.float64) * 6
    return x, a.cos().to(table_dtype), a.sin().to(table_dtype), style == "neox"


@pytest.mark.parametrize("x_dtype,table_dtype,style", CASES)
def test_identical_to_upstreams_function(x_dtype, table_dtype, style):
    upstream = _upstream_apply_rotary_emb()
    x, cos, sin, neox = _case(x_dtype, table_dtype, style)
    want = upstream(x, cos, sin, neox)
    got = apply_rotary(x, cos, sin, is_neox_style=neox)
    assert got.dtype == want.dtype and torch.equal(got, want)


def test_negative_control_tables_cast_first_differ_from_upstream():
    upstream = _upstream_apply_rotary_emb()

    def cast_first(x, cos, sin, neox):  # a plausible port: the tables rounded to x's dtype
        return apply_rotary(x, cos.to(x.dtype), sin.to(x.dtype), is_neox_style=neox)

    differ = [case for case in CASES if not torch.equal(cast_first(*_case(*case)), upstream(*_case(*case)))]
    assert differ, "the bit-equality check could not tell a different rounding apart"


def test_float64_is_kept_where_upstream_rounds_to_float32():
    """The one documented difference: float64 ``x`` stays float64 here (closer to the exact rotation)."""
    upstream = _upstream_apply_rotary_emb()
    _, cos, sin, _ = _case(torch.float64, torch.float64, "gptj")
    x = torch.randn(6, 7, 3, 16, generator=torch.Generator().manual_seed(3), dtype=torch.float64)  # not float32's
    exact = torch.view_as_real(torch.view_as_complex(x.unflatten(-1, (8, 2)).contiguous())
                               * torch.polar(torch.ones_like(cos), torch.atan2(sin, cos))[:, None, :]).flatten(-2)
    ours, theirs = apply_rotary(x, cos, sin), upstream(x, cos, sin, False)
    assert (ours - exact).abs().max() < 1e-12 < (theirs - exact).abs().max()
