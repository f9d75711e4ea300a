"""The ``#wrong`` column: elements of an output that differ from the oracle's output for the same input.

Every row of every case carries ``wrong`` (an int, summed over ranks; None where the case could not compare)
and ``wrong_oracle`` (what the output was compared against, or why nothing was: a case that moves no data
says so). Inputs are seeded, so every route and every revision sees the same bits.
"""

from __future__ import annotations

import hashlib

import torch

NO_DATA = "none: the case moves no data (0 by construction)"


def make_input(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, seed: int) -> torch.Tensor:
    """Deterministic input: the same bits for the same seed in every revision, route and run."""
    gen = torch.Generator(device=device).manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)
    return torch.randint(0, 256, shape, generator=gen, device=device, dtype=torch.uint8).to(dtype)


def count_bitwise_diff(a: torch.Tensor, b: torch.Tensor) -> int:
    """Elements of ``a`` and ``b`` whose bits differ (NaN payloads included). A shape or dtype mismatch counts
    every element. Blocks the host (reads the count back)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return max(a.numel(), b.numel())
    if b.device != a.device:
        b = b.to(a.device)
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return int((a.contiguous().view(ints) != b.contiguous().view(ints)).sum().item())


def count_beyond(a: torch.Tensor, b: torch.Tensor, threshold: float) -> int:
    """Elements whose absolute difference exceeds ``threshold`` (for results that may round differently, such
    as gradients through reductions), NaN in either counted; a shape mismatch counts every element."""
    if a.shape != b.shape:
        return max(a.numel(), b.numel())
    diff = (a.float() - b.to(a.device).float()).abs()
    return int(((diff > threshold) | diff.isnan()).sum().item())


def tensor_sha256(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes (bit-for-bit identity of large outputs without keeping them)."""
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
    return hashlib.sha256(memoryview(flat.numpy())).hexdigest()
