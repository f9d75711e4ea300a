"""Host-side exchange of small Python objects over a gloo group (construction and settings agreement).

Pickled and length-prefixed: one all-gather of a fixed slot (a second, padded one only for an
object larger than the slot). ``timeout_s`` bounds this one exchange
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


# One all-gather of a fixed slot carries any object whose pickle fits (construction reports, unique ids):
# one round instead of two (sizes, then payloads). Bigger objects take a second, padded round, which
# every rank enters together because every rank sees every length after the first.
SLOT_BYTES = 4096
_HEADER = 8  # int64 length


def all_gather_objects(
    group: dist.ProcessGroup, world_size: int, obj: object, *, timeout_s: float | None = None
) -> list[object]:
    """Every rank's ``obj``, by rank in ``group``. Collective; raises RuntimeError from the backend on failure."""
    payload = pickle.dumps(obj)
    slot = torch.zeros(SLOT_BYTES, dtype=torch.uint8)
    slot[:_HEADER].view(torch.int64)[0] = len(payload)
    if _HEADER + len(payload) <= SLOT_BYTES:
        slot[_HEADER : _HEADER + len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    slots = torch.zeros(world_size * SLOT_BYTES, dtype=torch.uint8)
    _gather(slots, slot, group, timeout_s)
    rows = slots.view(world_size, SLOT_BYTES)
    sizes = [int(rows[r, :_HEADER].view(torch.int64)[0]) for r in range(world_size)]
    if max(sizes) + _HEADER <= SLOT_BYTES:
        return [pickle.loads(rows[r, _HEADER : _HEADER + sizes[r]].numpy().tobytes()) for r in range(world_size)]
    width = max(sizes)
    padded = torch.zeros(width, dtype=torch.uint8)
    padded[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    gathered = torch.zeros(world_size * width, dtype=torch.uint8)
    _gather(gathered, padded, group, timeout_s)
    wide = gathered.view(world_size, width)
    return [pickle.loads(wide[r, : sizes[r]].numpy().tobytes()) for r in range(world_size)]
