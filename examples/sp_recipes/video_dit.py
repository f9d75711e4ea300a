"""A small video diffusion transformer with Wan-style blocks, sequence parallel through ``DistributedAttention``.

    model = VideoDiT(CONFIGS["tiny"])                 # the same weights on every rank (seed first)
    pred = model(latents, timestep, text)             # collective over the SP group

``latents`` ``[B, C, F, H, W]``, ``timestep`` ``[B]`` in [0, 1] and ``text`` ``[B, T, text_dim]`` are the same on
every SP rank (each DP group draws its own). The model patchifies the latents into ``F/pt * H/ph * W/pw`` video
tokens, shards them over the SP group (``sequence_model_parallel_shard``: by default every rank a share as even
as it goes, ``balanced_splits``, with no padding; ``seq_shard="pad"`` pads to a multiple of the SP size as
upstream does), runs its blocks on the shard, and all-gathers the prediction (``..._all_gather_with_unpad``,
with the same table): it returns the
full prediction ``[B, C, F, H, W]`` on every SP rank, so a loss on it is the same everywhere. Gradients follow
upstream's collectives (the all-gather's backward sums over SP ranks, the shard's divides by the SP size), so
the SP ranks' parameter gradients summed (FSDP averages them over the world: divide by it) are the single-device
gradient of the loss, per sample.

A block (as Wan's): adaptive LayerNorm from the timestep (six modulation vectors: shift, scale and gate for
attention and for the MLP, a learned per-block table added to the shared timestep projection), QKV projection
with RMSNorm on q and k, 3-D rotary embedding on the video tokens, ``DistributedAttention`` with the text tokens
as its replicated tokens (video and text attend jointly; the text stream shares the block's weights), output
projection, and a GELU MLP. The head is a modulated LayerNorm and a linear projection back to patches.

Pure module: no collective at construction. ``benchmarks/benchmark_dit_step.py`` can build on the same
module (``VideoDiTBlock`` alone takes ``[B, S/P, hidden]`` tokens).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from fastvideo.attention.layer import DistributedAttention
from fastvideo.attention.rotary import rotary_3d
from fastvideo.distributed.communication_op import (
    balanced_splits,
    sequence_model_parallel_all_gather_with_unpad,
    sequence_model_parallel_shard,
)
from fastvideo.distributed.parallel_state import get_sp_world_size

__all__ = ["CONFIGS", "VideoDiT", "VideoDiTBlock", "VideoDiTConfig", "config_with", "flow_matching_loss", "patchify",
           "unpatchify"]


@dataclass(frozen=True)
class VideoDiTConfig:
    """Model and latent geometry. ``frames, height, width``: the latent clip; ``patch``: (pt, ph, pw)."""

    in_channels: int = 4
    frames: int = 5
    height: int = 8
    width: int = 8
    patch: tuple[int, int, int] = (1, 2, 2)
    hidden: int = 96
    heads: int = 6
    depth: int = 2
    mlp_ratio: float = 4.0
    text_len: int = 8
    text_dim: int = 32
    freq_dim: int = 64
    eps: float = 1e-6
    rope_theta: float = 10000.0
    checkpointing: bool = False  # recompute each block in backward (its all-to-alls run again)

    def __post_init__(self) -> None:
        if self.hidden % self.heads or (self.hidden // self.heads) % 2:
            raise ValueError(f"VideoDiTConfig: hidden={self.hidden} / heads={self.heads} must be an even head size.")
        for name, size, p in zip(("frames", "height", "width"), (self.frames, self.height, self.width), self.patch,
                                 strict=True):
            if size % p:
                raise ValueError(f"VideoDiTConfig: {name}={size} is not divisible by its patch size {p}.")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def grid(self) -> tuple[int, int, int]:
        """Video tokens along (frames, height, width)."""
        return (self.frames // self.patch[0], self.height // self.patch[1], self.width // self.patch[2])

    @property
    def tokens(self) -> int:
        return math.prod(self.grid)

    @property
    def patch_dim(self) -> int:
        return self.in_channels * math.prod(self.patch)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> VideoDiTConfig:
        return cls(**{**values, "patch": tuple(values["patch"])})


CONFIGS = {
    # CPU: two gloo ranks train it in seconds. 80 video tokens (uneven shares at SP3) + 8 text; 6 heads (even at
    # SP 1, 2, 3, 6; uneven head shares elsewhere).
    "tiny": VideoDiTConfig(),
    # One GPU per rank (bf16): 2048 video tokens, 8 heads of 64, 4 blocks.
    "small": VideoDiTConfig(in_channels=16, frames=8, height=32, width=32, hidden=512, heads=8, depth=4,
                            text_len=32, text_dim=256, freq_dim=256),
}


def patchify(x: torch.Tensor, patch: tuple[int, int, int]) -> torch.Tensor:
    """``[B, C, F, H, W] -> [B, tokens, C * pt * ph * pw]``, tokens in (frame, height, width) order."""
    b, c, f, h, w = x.shape
    pt, ph, pw = patch
    x = x.reshape(b, c, f // pt, pt, h // ph, ph, w // pw, pw)
    return x.permute(0, 2, 4, 6, 1, 3, 5, 7).reshape(b, (f // pt) * (h // ph) * (w // pw), c * pt * ph * pw)


def unpatchify(tokens: torch.Tensor, patch: tuple[int, int, int], channels: int,
               grid: tuple[int, int, int]) -> torch.Tensor:
    """The inverse of ``patchify``."""
    b = tokens.shape[0]
    (gf, gh, gw), (pt, ph, pw) = grid, patch
    x = tokens.reshape(b, gf, gh, gw, channels, pt, ph, pw).permute(0, 4, 1, 5, 2, 6, 3, 7)
    return x.reshape(b, channels, gf * pt, gh * ph, gw * pw)


def timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal embedding ``[B, dim]`` of timesteps in [0, 1] (scaled to [0, 1000] as diffusion models do)."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = (t.float() * 1000.0)[:, None] * freqs[None]
    return torch.cat([args.cos(), args.sin()], dim=-1)


class VideoDiTBlock(nn.Module):
    """One Wan-style block on this rank's video tokens ``[B, S/P, hidden]`` and the text tokens ``[B, T, hidden]``
    (the same on every SP rank). Collective over the SP group (two all-to-alls, one all-gather)."""

    def __init__(self, cfg: VideoDiTConfig, *, all_to_all=None, attend=None, prefix: str = "") -> None:
        """``all_to_all`` / ``attend``: ``DistributedAttention``'s overrides (benchmarks); the package's by default.
        ``prefix``: the block's name in the model (``"blocks.3"``); its attention's all-to-alls are tagged
        ``f"{prefix}.attn.qkv"`` and ``f"{prefix}.attn.out"`` (untagged without one)."""
        super().__init__()
        hidden = cfg.hidden
        self.cfg = cfg
        self.norm1 = nn.LayerNorm(hidden, eps=cfg.eps, elementwise_affine=False)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.norm_q = nn.RMSNorm(hidden, eps=cfg.eps)
        self.norm_k = nn.RMSNorm(hidden, eps=cfg.eps)
        self.attn = DistributedAttention(cfg.heads, cfg.head_dim, all_to_all=all_to_all, attend=attend,
                                         prefix=f"{prefix}.attn" if prefix else "")
        self.proj = nn.Linear(hidden, hidden)
        self.norm2 = nn.LayerNorm(hidden, eps=cfg.eps, elementwise_affine=False)
        mlp = int(hidden * cfg.mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(hidden, mlp), nn.GELU(approximate="tanh"), nn.Linear(mlp, hidden))
        self.modulation = nn.Parameter(torch.randn(1, 6, hidden) / hidden ** 0.5)

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        shape = (b, s, self.cfg.heads, self.cfg.head_dim)
        return self.norm_q(q).view(shape), self.norm_k(k).view(shape), v.reshape(shape)

    def _forward(self, x: torch.Tensor, text: torch.Tensor | None, e: torch.Tensor,
                 freqs: tuple[torch.Tensor, torch.Tensor] | None, seq_len: int | None,
                 seq_splits: tuple[int, ...] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        shift_a, scale_a, gate_a, shift_m, scale_m, gate_m = (self.modulation + e).chunk(6, dim=1)
        q, k, v = self._qkv(self.norm1(x) * (1 + scale_a) + shift_a)
        tq = tk = tv = None
        if text is not None:
            tq, tk, tv = self._qkv(self.norm1(text) * (1 + scale_a) + shift_a)
        out, text_out = self.attn(q, k, v, original_seq_len=None if seq_splits else seq_len, replicated_q=tq,
                                  replicated_k=tk, replicated_v=tv, freqs_cis=freqs, seq_splits=seq_splits)
        x = x + gate_a * self.proj(out.flatten(2))
        x = x + gate_m * self.mlp(self.norm2(x) * (1 + scale_m) + shift_m)
        if text is not None:
            text = text + gate_a * self.proj(text_out.flatten(2))
            text = text + gate_m * self.mlp(self.norm2(text) * (1 + scale_m) + shift_m)
        return x, text

    def forward(self, x: torch.Tensor, text: torch.Tensor | None, e: torch.Tensor,
                freqs: tuple[torch.Tensor, torch.Tensor] | None = None, seq_len: int | None = None,
                seq_splits: tuple[int, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(x, text)`` after the block. ``text``: the text tokens, or None (video tokens only); ``e``:
        ``[B, 6, hidden]`` timestep modulation; ``freqs``: the rotary ``(cos, sin)`` of the whole unpadded video
        sequence, or None (no rotary); ``seq_len``: its length (None: no padding); ``seq_splits``: every SP
        rank's share of it where the shards are uneven (no padding; the same on every rank), or None."""
        if self.cfg.checkpointing and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(self._forward, x, text, e, freqs, seq_len, seq_splits,
                                                     use_reentrant=False)
        return self._forward(x, text, e, freqs, seq_len, seq_splits)


class VideoDiT(nn.Module):
    """The video DiT (see the module docstring). ``forward`` is collective over the SP group."""

    def __init__(self, cfg: VideoDiTConfig, *, seq_shard: str = "uneven") -> None:
        """``seq_shard``: ``"uneven"`` (every SP rank a share as even as it goes, no padding) or ``"pad"`` (the
        sequence padded to a multiple of the SP size, upstream's way); the same on every rank."""
        super().__init__()
        if seq_shard not in ("uneven", "pad"):
            raise ValueError(f"VideoDiT: seq_shard={seq_shard!r} must be 'uneven' or 'pad'.")
        self.cfg = cfg
        self.seq_shard = seq_shard
        hidden = cfg.hidden
        self.patch_embed = nn.Linear(cfg.patch_dim, hidden)
        self.text_embed = nn.Sequential(nn.Linear(cfg.text_dim, hidden), nn.GELU(approximate="tanh"),
                                        nn.Linear(hidden, hidden))
        self.time_embed = nn.Sequential(nn.Linear(cfg.freq_dim, hidden), nn.SiLU(), nn.Linear(hidden, hidden))
        self.time_proj = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 6 * hidden))
        self.blocks = nn.ModuleList(VideoDiTBlock(cfg, prefix=f"blocks.{i}") for i in range(cfg.depth))
        self.norm_out = nn.LayerNorm(hidden, eps=cfg.eps, elementwise_affine=False)
        self.head_modulation = nn.Parameter(torch.randn(1, 2, hidden) / hidden ** 0.5)
        self.head = nn.Linear(hidden, cfg.patch_dim)
        self._rope: dict[tuple[str, int | None], tuple[torch.Tensor, torch.Tensor]] = {}

    def rotary(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The video tokens' 3-D rotary tables, built once per device."""
        key = (device.type, device.index)
        if key not in self._rope:
            self._rope[key] = rotary_3d(*self.cfg.grid, self.cfg.head_dim, theta=self.cfg.rope_theta, device=device)
        return self._rope[key]

    def forward(self, latents: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        """The prediction ``[B, C, F, H, W]`` (the same on every SP rank) for ``latents`` at ``timestep`` given
        ``text``. Collective over the SP group."""
        cfg = self.cfg
        expected = (cfg.in_channels, cfg.frames, cfg.height, cfg.width)
        if latents.dim() != 5 or tuple(latents.shape[1:]) != expected:
            raise ValueError(f"VideoDiT: latents must be [B, {', '.join(map(str, expected))}], got "
                             f"{tuple(latents.shape)}.")
        if tuple(text.shape[1:]) != (cfg.text_len, cfg.text_dim) or text.shape[0] != latents.shape[0]:
            raise ValueError(f"VideoDiT: text must be [B, {cfg.text_len}, {cfg.text_dim}], got {tuple(text.shape)}.")
        temb = self.time_embed(timestep_embedding(timestep, cfg.freq_dim).to(latents.dtype))
        e = self.time_proj(temb).unflatten(1, (6, cfg.hidden))
        tokens = self.patch_embed(patchify(latents, cfg.patch))
        p = get_sp_world_size()
        # Even shares take the same path as uneven ones; the table is None where they are even, as padding
        # would be none too (so a divisible sequence makes the same calls either way).
        splits = balanced_splits(tokens.shape[1], p) if self.seq_shard == "uneven" and tokens.shape[1] % p else None
        tokens, seq_len = sequence_model_parallel_shard(tokens, dim=1, seq_splits=splits)
        txt = self.text_embed(text)
        freqs = self.rotary(latents.device)
        for block in self.blocks:
            tokens, txt = block(tokens, txt, e, freqs, seq_len, splits)
        shift, scale = (self.head_modulation + temb[:, None]).chunk(2, dim=1)
        out = self.head(self.norm_out(tokens) * (1 + scale) + shift)
        out = sequence_model_parallel_all_gather_with_unpad(out, seq_len, dim=1, seq_splits=splits)
        return unpatchify(out, cfg.patch, cfg.in_channels, cfg.grid)


def config_with(name: str, **overrides) -> VideoDiTConfig:
    """A preset of ``CONFIGS`` with some fields replaced (validated)."""
    if name not in CONFIGS:
        raise ValueError(f"VideoDiT config {name!r} is not one of {sorted(CONFIGS)}.")
    return replace(CONFIGS[name], **overrides)


def flow_matching_loss(pred: torch.Tensor, x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Rectified-flow loss: the model predicts the velocity ``noise - x0`` at ``x_t = (1 - t) x0 + t noise``."""
    dtype = torch.promote_types(pred.dtype, torch.float32)  # bf16 compute: the loss in float32
    return F.mse_loss(pred.to(dtype), (noise - x0).to(dtype))
