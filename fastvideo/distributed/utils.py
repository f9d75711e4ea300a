"""Small tensor helpers of upstream FastVideo's ``fastvideo.distributed.utils`` that models import: divisibility
checks, splitting along the last dim, and the sequence padding that sequence parallelism needs when the
sequence does not divide by the SP size. Pure tensor code: no collective, no process group.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "compute_padding_for_sp",
    "divide",
    "ensure_divisibility",
    "pad_sequence_tensor",
    "split_tensor_along_last_dim",
    "unpad_sequence_tensor",
]


def ensure_divisibility(numerator: int, denominator: int) -> None:
    """Raise ValueError unless ``denominator`` divides ``numerator``."""
    if denominator <= 0 or numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by {denominator}")


def divide(numerator: int, denominator: int) -> int:
    """``numerator // denominator``, checked to divide exactly."""
    ensure_divisibility(numerator, denominator)
    return numerator // denominator


def split_tensor_along_last_dim(tensor: torch.Tensor, num_partitions: int,
                                contiguous_split_chunks: bool = False) -> Sequence[torch.Tensor]:
    """``num_partitions`` equal views of ``tensor`` along its last dim (contiguous copies if asked)."""
    chunks = torch.split(tensor, divide(tensor.shape[-1], num_partitions), dim=-1)
    return tuple(c.contiguous() for c in chunks) if contiguous_split_chunks else tuple(chunks)


def compute_padding_for_sp(seq_len: int, sp_world_size: int) -> tuple[int, int]:
    """``(padded_seq_len, padding)``: the smallest multiple of ``sp_world_size`` >= ``seq_len``, and the rows added."""
    if sp_world_size < 1:
        raise ValueError(f"compute_padding_for_sp: sp_world_size={sp_world_size} must be >= 1")
    padding = -seq_len % sp_world_size
    return seq_len + padding, padding


def pad_sequence_tensor(tensor: torch.Tensor, target_seq_len: int, seq_dim: int = 1,
                        pad_value: float = 0.0) -> torch.Tensor:
    """``tensor`` padded with ``pad_value`` along ``seq_dim`` to ``target_seq_len`` (itself if already that long)."""
    missing = target_seq_len - tensor.shape[seq_dim]
    if missing <= 0:
        return tensor
    shape = list(tensor.shape)
    shape[seq_dim] = missing
    return torch.cat([tensor, tensor.new_full(shape, pad_value)], dim=seq_dim)


def unpad_sequence_tensor(tensor: torch.Tensor, original_seq_len: int, seq_dim: int = 1) -> torch.Tensor:
    """The first ``original_seq_len`` rows of ``tensor`` along ``seq_dim`` (a view)."""
    return tensor.narrow(seq_dim, 0, min(original_seq_len, tensor.shape[seq_dim]))
