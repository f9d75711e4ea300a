"""Host-side exchange of small Python objects over a gloo group (construction and settings agreement).

Pickled and length-prefixed: two all-gathers of CPU tensors. ``timeout_s`` bounds this one exchange
whatever the group's own timeout is (a group shared with user code keeps its default), so an
agreement that a peer never joins ends in an error instead of a hang.
"""

from __future__ import annotations

import datetime
import pickle

import torch
import torch.distributed as dist

# torch 2.13 renamed all_gather_into_tensor (the GPU hosts run 2.11): one name for both.
all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _gather(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup, timeout_s: float | None) -> None:
    if timeout_s is not None:
        try:
            from torch._C._distributed_c10d import AllgatherOptions

            opts = AllgatherOptions()
            opts.timeout = datetime.timedelta(seconds=timeout_s)
            work = group._allgather_base(out, inp, opts)
        except (ImportError, AttributeError, TypeError):
            pass  # no per-call timeout in this torch build: the group's own timeout bounds the exchange
        else:
            work.wait()
            return
    all_gather_tensor(out, inp, group=group)


def all_gather_objects(
    group: dist.ProcessGroup, world_size: int, obj: object, *, timeout_s: float | None = None
) -> list[object]:
    """Every rank's ``obj``, by rank in ``group``. Collective; raises RuntimeError from the backend on failure."""
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    sizes = torch.zeros(world_size, dtype=torch.int64)
    _gather(sizes, torch.tensor([payload.numel()], dtype=torch.int64), group, timeout_s)
    width = int(sizes.max())
    padded = torch.zeros(width, dtype=torch.uint8)
    padded[: payload.numel()] = payload
    gathered = torch.zeros(world_size * width, dtype=torch.uint8)
    _gather(gathered, padded, group, timeout_s)
    rows = gathered.view(world_size, width)
    return [pickle.loads(rows[r, : int(sizes[r])].numpy().tobytes()) for r in range(world_size)]
