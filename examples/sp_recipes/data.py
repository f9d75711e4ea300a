"""Synthetic video latents for the training recipe: a fixed set of clips, deterministic per (step, DP rank).

Each clip is a few moving plane waves per latent channel (structure a denoiser can learn, so the loss falls),
with a random caption embedding of its own. A step's batch is a pure function of ``(seed, step, dp_rank)``:
the same on every SP rank of a DP group, different across DP groups, and the same again after a resume, which
is what makes a resumed run's losses equal the uninterrupted run's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

__all__ = ["Batch", "LatentGeometry", "SyntheticVideoLatents"]


class Geometry(Protocol):
    """What the data needs of a model config: the latent clip and the caption it conditions on."""

    in_channels: int
    frames: int
    height: int
    width: int
    text_len: int
    text_dim: int


@dataclass(frozen=True)
class LatentGeometry:
    """A latent clip ``[in_channels, frames, height, width]`` and its caption ``[text_len, text_dim]``."""

    in_channels: int
    frames: int
    height: int
    width: int
    text_len: int
    text_dim: int


@dataclass(frozen=True)
class Batch:
    """One training batch: clean latents, noise, timesteps in [0, 1], text embeddings, and the noisy input."""

    x0: torch.Tensor
    noise: torch.Tensor
    t: torch.Tensor
    text: torch.Tensor

    @property
    def xt(self) -> torch.Tensor:
        t = self.t.view(-1, 1, 1, 1, 1)
        return (1 - t) * self.x0 + t * self.noise

    def to(self, device: torch.device) -> Batch:
        return Batch(*(v.to(device) for v in (self.x0, self.noise, self.t, self.text)))


class SyntheticVideoLatents:
    """``clips`` latent clips of ``cfg``'s geometry (a ``VideoDiTConfig``, a ``LatentGeometry``), built on the CPU
    from ``seed``."""

    def __init__(self, cfg: Geometry, *, clips: int = 16, waves: int = 3, seed: int = 0) -> None:
        self.cfg, self.seed = cfg, seed
        g = torch.Generator().manual_seed(seed)
        c, f, h, w = cfg.in_channels, cfg.frames, cfg.height, cfg.width
        grid_f = torch.arange(f, dtype=torch.float64).view(f, 1, 1) / f
        grid_h = torch.arange(h, dtype=torch.float64).view(1, h, 1) / h
        grid_w = torch.arange(w, dtype=torch.float64).view(1, 1, w) / w
        data = torch.zeros(clips, c, f, h, w, dtype=torch.float64)
        for i in range(clips):
            for ch in range(c):
                for _ in range(waves):
                    kh, kw, speed, phase = (torch.rand(4, generator=g, dtype=torch.float64) * torch.tensor(
                        [3.0, 3.0, 2.0, 2 * math.pi], dtype=torch.float64)).tolist()
                    data[i, ch] += torch.sin(2 * math.pi * (kh * grid_h + kw * grid_w - speed * grid_f) + phase)
        self.latents = (data / math.sqrt(waves)).float()
        self.text = torch.randn(clips, cfg.text_len, cfg.text_dim, generator=g)

    def batch(self, step: int, *, batch_size: int, dp_rank: int = 0, dp_size: int = 1) -> Batch:
        """The batch of ``step`` for DP rank ``dp_rank`` (CPU tensors; ``Batch.to`` moves them)."""
        n = len(self.latents)
        first = (step * dp_size + dp_rank) * batch_size
        index = torch.arange(first, first + batch_size) % n
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 1009 + dp_rank)
        noise = torch.randn(batch_size, *self.latents.shape[1:], generator=g)
        t = torch.rand(batch_size, generator=g)
        return Batch(self.latents[index], noise, t, self.text[index])
