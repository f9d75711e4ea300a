"""Which ranks share a node: upstream FastVideo's ``get_same_node_ranks`` (and its older name
``is_the_same_node_as``), which ``parallel_state`` re-exports and uses to build the node group.

"The same node" means "can open the same shared memory": the source rank creates a small POSIX shared-memory
segment holding a random token, every rank tries to open it by name and compares the token, and the verdicts are
combined on every rank. That is the property the node group stands for (local ranks that can hand each other
memory), which a hostname comparison only approximates (containers may share a hostname and not ``/dev/shm``).
"""

from __future__ import annotations

import contextlib
import logging
import secrets
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import torch
import torch.distributed as dist

from fastvideo.distributed.communicator import group_peer

logger = logging.getLogger(__name__)

__all__ = ["get_same_node_ranks", "is_the_same_node_as"]

_TOKEN_BYTES = 16


def get_same_node_ranks(pg: Any, source_rank: int = 0) -> list[int]:
    """Collective over ``pg`` (a gloo ``ProcessGroup`` or a ``StatelessProcessGroup``), blocking: the global ranks
    (for a stateless group, its ranks) that can open the shared memory group rank ``source_rank`` creates, in
    order; ``source_rank``'s own rank always among them. An NCCL group raises ValueError (the exchange runs on
    the host)."""
    stateless = not isinstance(pg, dist.ProcessGroup)
    if stateless:
        rank, world, ranks = pg.rank, pg.world_size, list(range(pg.world_size))
    else:
        if dist.get_backend(pg) == dist.Backend.NCCL:
            raise ValueError("get_same_node_ranks: pg is an NCCL group; pass a gloo group (the coordinator's "
                             "cpu_group).")
        rank, world, ranks = dist.get_rank(pg), dist.get_world_size(pg), dist.get_process_group_ranks(pg)
    source = group_peer("get_same_node_ranks", "source_rank", source_rank, ranks)  # its global rank, checked

    seen = torch.zeros(world, dtype=torch.int32)
    created: shared_memory.SharedMemory | None = None
    offer: tuple[str, bytes] | None = None  # the source's segment and token (None: it has none)
    if rank == source_rank:
        seen[rank] = 1
        token = secrets.token_bytes(_TOKEN_BYTES)
        try:
            created = shared_memory.SharedMemory(create=True, size=_TOKEN_BYTES)
            created.buf[:_TOKEN_BYTES] = token
            offer = (created.name, token)
        except OSError as exc:  # no shared memory here: this rank alone is its node
            logger.warning("get_same_node_ranks: cannot create shared memory (%s); each rank is its own node", exc)
    if stateless:
        offer = pg.broadcast_obj(offer, src=source_rank)
    else:
        box = [offer]
        dist.broadcast_object_list(box, src=source, group=pg)
        offer = box[0]
    if rank != source_rank and offer is not None:
        name, token = offer
        with contextlib.suppress(OSError, ValueError):
            # Opened without this process's resource tracker adopting the segment (the creator unlinks it).
            try:
                shm = shared_memory.SharedMemory(name=name, track=False)  # Python >= 3.13
            except TypeError:
                shm = shared_memory.SharedMemory(name=name)
                with contextlib.suppress(Exception):
                    resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
            try:
                seen[rank] = int(bytes(shm.buf[:_TOKEN_BYTES]) == token)
            finally:
                shm.close()
    # Every rank's verdict, summed on every rank: a rank contributes once it has looked, so every rank has looked
    # before the source removes the segment below.
    if stateless:
        seen = sum(pg.all_gather_obj(seen), torch.zeros_like(seen))
    else:
        dist.all_reduce(seen, group=pg)
    if created is not None:
        created.close()
        with contextlib.suppress(OSError):
            created.unlink()
    return [ranks[i] for i, flag in enumerate(seen.tolist()) if flag]


# ``get_same_node_ranks`` under its older name (it returns ranks, as upstream's does since it was renamed).
is_the_same_node_as = get_same_node_ranks
