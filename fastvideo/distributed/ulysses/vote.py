"""The per-call vote channel: 12 int64 fields all-gathered over a gloo group of the helper's own.

Buffers are allocated once per helper and reused (no per-call allocation on the hot path). The
group is created with the vote timeout, so a vote that never completes (a dead peer, a peer with
``FASTVIDEO_ULYSSES_A2A=off``) raises instead of hanging; a gloo group is unusable after that, so
the caller must treat any failure as terminal.
"""

from __future__ import annotations

import datetime
import pickle

import torch
import torch.distributed as dist

from fastvideo.distributed.ulysses.contract import NUM_FIELDS

# torch 2.13 renamed all_gather_into_tensor (the GPU hosts run 2.11): one name for both.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class VoteTimeoutError(RuntimeError):
    """A vote or construction exchange did not complete in time (or the vote group failed)."""


class GlooVote:
    """All-gather of the 12-field contract over a dedicated gloo group. Collective on every call."""

    def __init__(self, ranks: list[int], timeout_s: float) -> None:
        self.ranks = list(ranks)
        self.world_size = len(ranks)
        self.timeout_s = timeout_s
        # use_local_synchronization: only the SP group's ranks take part in creating it, so another
        # SP group (or a helper rebuilt on one SP group only) never blocks on this one.
        self.group = dist.new_group(
            self.ranks,
            backend="gloo",
            timeout=datetime.timedelta(seconds=timeout_s),
            use_local_synchronization=True,
        )
        self._send = torch.zeros(NUM_FIELDS, dtype=torch.int64)
        self._send_np = self._send.numpy()
        self._recv = torch.zeros(self.world_size * NUM_FIELDS, dtype=torch.int64)
        self._recv_rows = self._recv.view(self.world_size, NUM_FIELDS)

    def exchange(self, fields: list[int]) -> torch.Tensor:
        """Gather every rank's fields: returns the reused ``[P, 12]`` buffer (read it before the next call)."""
        self._send_np[:] = fields
        try:
            _all_gather(self._recv, self._send, group=self.group)
        except RuntimeError as exc:
            raise VoteTimeoutError(
                f"Ulysses vote over SP ranks {self.ranks} did not complete within {self.timeout_s:g} s ({exc}). "
                "A peer is dead, stuck, or is not calling the helper (e.g. FASTVIDEO_ULYSSES_A2A differs between "
                "ranks: set it identically everywhere)."
            ) from exc
        return self._recv_rows

    def all_gather_object(self, obj: object) -> list[object]:
        """Construction-time exchange of small Python objects (pickled, length-prefixed, over gloo)."""
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        try:
            sizes = torch.zeros(self.world_size, dtype=torch.int64)
            _all_gather(sizes, torch.tensor([payload.numel()], dtype=torch.int64), group=self.group)
            width = int(sizes.max())
            padded = torch.zeros(width, dtype=torch.uint8)
            padded[: payload.numel()] = payload
            gathered = torch.zeros(self.world_size * width, dtype=torch.uint8)
            _all_gather(gathered, padded, group=self.group)
        except RuntimeError as exc:
            raise VoteTimeoutError(
                f"Ulysses construction exchange over SP ranks {self.ranks} did not complete within "
                f"{self.timeout_s:g} s ({exc}). Every SP rank must construct the helper (same FASTVIDEO_ULYSSES_A2A)."
            ) from exc
        rows = gathered.view(self.world_size, width)
        return [pickle.loads(rows[r, : int(sizes[r])].numpy().tobytes()) for r in range(self.world_size)]

    def destroy(self) -> None:
        # Not dist.destroy_process_group: torch names a group created with use_local_synchronization
        # after len(_world.pg_names), so deregistering this one makes the next GlooVote on the same
        # ranks reuse its name and store keys, and peers then connect to stale addresses (connect
        # timeouts on helper rebuild). The group is released with the default process group.
        self.destroyed = True
