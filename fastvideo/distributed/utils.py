"""Small helpers of upstream FastVideo's ``fastvideo.distributed.utils`` that models import: divisibility checks,
splitting along the last dim, and the sequence padding that sequence parallelism needs when the sequence does not
divide by the SP size (pure tensor code: no collective, no process group); and ``StatelessProcessGroup``, the
metadata exchange over a TCP store that upstream's pynccl/pyhccl communicators accept in place of a process group.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

logger = logging.getLogger(__name__)

__all__ = [
    "StatelessProcessGroup",
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


@dataclasses.dataclass
class StatelessProcessGroup:
    """Objects between ``world_size`` processes through a ``torch.distributed`` store, without a process group (so
    without touching torch's global state): for metadata only, not tensors in bulk. Every value is pickled under a
    key that names sender, receiver and a per-pair counter, so every rank must make matching calls in the same order.
    Values this rank wrote are deleted once older than ``data_expiration_seconds`` (checked when it writes again).
    Pickled objects are trusted: they come from the job's own ranks."""

    rank: int
    world_size: int
    store: Any  # a torch.distributed Store
    data_expiration_seconds: int = 3600
    send_dst_counter: dict[int, int] = dataclasses.field(default_factory=dict)
    recv_src_counter: dict[int, int] = dataclasses.field(default_factory=dict)
    broadcast_send_counter: int = 0
    broadcast_recv_src_counter: dict[int, int] = dataclasses.field(default_factory=dict)
    entries: deque[tuple[str, float]] = dataclasses.field(default_factory=deque)  # (key, when written), oldest first

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"StatelessProcessGroup: rank={self.rank} must be in 0..{self.world_size - 1}.")
        self.send_dst_counter = dict.fromkeys(range(self.world_size), 0)
        self.recv_src_counter = dict.fromkeys(range(self.world_size), 0)
        self.broadcast_recv_src_counter = dict.fromkeys(range(self.world_size), 0)

    def _put(self, key: str, obj: Any) -> None:
        self.expire_data()
        self.store.set(key, pickle.dumps(obj))
        self.entries.append((key, time.perf_counter()))

    def _take(self, key: str, counters: dict[int, int], src: int) -> Any:
        """The value under ``key/<counters[src]>`` (blocking up to the store's timeout); the counter then advances."""
        value = pickle.loads(self.store.get(f"{key}/{counters[src]}"))
        counters[src] += 1
        return value

    def send_obj(self, obj: Any, dst: int) -> None:
        """Point to point, non-blocking: ``obj`` for rank ``dst``'s next ``recv_obj(src=<this rank>)``."""
        self._put(f"send_to/{dst}/{self.send_dst_counter[dst]}", obj)
        self.send_dst_counter[dst] += 1

    def recv_obj(self, src: int) -> Any:
        """Point to point, blocking (up to the store's timeout): the next object rank ``src`` sent to this rank.
        The key names the receiver and a counter of receptions, so sends to one rank pair in order."""
        return self._take(f"send_to/{self.rank}", self.recv_src_counter, src)

    def expire_data(self) -> None:
        """Delete this rank's values older than ``data_expiration_seconds``. Local."""
        while self.entries and time.perf_counter() - self.entries[0][1] > self.data_expiration_seconds:
            key, _ = self.entries.popleft()
            self.store.delete_key(key)

    def broadcast_obj(self, obj: Any | None, src: int) -> Any:
        """Collective, blocking: rank ``src``'s ``obj`` on every rank. Values stay in the store until they expire:
        for a bounded number of uses (initialisation), not a loop."""
        if self.rank == src:
            self._put(f"broadcast_from/{src}/{self.broadcast_send_counter}", obj)
            self.broadcast_send_counter += 1
            return obj
        return self._take(f"broadcast_from/{src}", self.broadcast_recv_src_counter, src)

    def all_gather_obj(self, obj: Any) -> list[Any]:
        """Collective, blocking: every rank's ``obj``, by rank."""
        return [self.broadcast_obj(obj if src == self.rank else None, src=src) for src in range(self.world_size)]

    def barrier(self) -> None:
        """Collective, blocking: returns once every rank has reached it."""
        self.all_gather_obj(None)

    @staticmethod
    def create(host: str, port: int, rank: int, world_size: int,
               data_expiration_seconds: int = 3600) -> StatelessProcessGroup:
        """A group over a new ``TCPStore`` at ``host:port`` (rank 0 serves it); every rank calls it."""
        from torch.distributed import TCPStore

        store = TCPStore(host_name=host, port=port, world_size=world_size, is_master=(rank == 0))
        return StatelessProcessGroup(rank=rank, world_size=world_size, store=store,
                                     data_expiration_seconds=data_expiration_seconds)
