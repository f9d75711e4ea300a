"""Host-side exchange of small Python objects over a gloo group (construction and settings agreement), and what
the job's groups time out after.

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


def allgather_options(timeout_s: float):
    """All-gather options carrying ``timeout_s`` (built once by a caller that reuses them), or None where this
    torch has no per-call timeout."""
    try:
        from torch._C._distributed_c10d import AllgatherOptions

        opts = AllgatherOptions()
        opts.timeout = datetime.timedelta(seconds=timeout_s)
    except (ImportError, AttributeError, TypeError):
        return None
    return opts


def gather_into(out: torch.Tensor, row: torch.Tensor, group: dist.ProcessGroup, opts) -> None:
    """One all-gather of every rank's ``row`` into ``out`` over ``group``, bounded by ``opts`` (``allgather_options``)
    where given, else by the group's own timeout."""
    if opts is None:  # no per-call timeout (in this torch build): the group's own timeout bounds the exchange
        all_gather_tensor(out, row, group=group)
    else:
        group._allgather_base(out, row, opts).wait()


def _gather_rows(row: torch.Tensor, world_size: int, group: dist.ProcessGroup,
                 timeout_s: float | None) -> torch.Tensor:
    """Every rank's ``row`` (uint8, as long on every rank), one per rank in ``group``: one all-gather."""
    out = torch.zeros(world_size * row.numel(), dtype=torch.uint8)
    gather_into(out, row, group, None if timeout_s is None else allgather_options(timeout_s))
    return out.view(world_size, row.numel())


# One all-gather of a fixed slot carries any object whose pickle fits (construction reports, unique ids):
# one round instead of two (sizes, then payloads). Bigger objects take a second, padded round, which
# every rank enters together because every rank sees every length after the first.
SLOT_BYTES = 4096
_HEADER = 8  # int64 length


def all_gather_objects(
    group: dist.ProcessGroup, world_size: int, obj: object, *, timeout_s: float | None = None
) -> list[object]:
    """Every rank's ``obj``, by rank in ``group``. Collective; raises RuntimeError from the backend on failure."""
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    slot = torch.zeros(SLOT_BYTES, dtype=torch.uint8)
    slot[:_HEADER].view(torch.int64)[0] = len(payload)
    if _HEADER + len(payload) <= SLOT_BYTES:
        slot[_HEADER : _HEADER + len(payload)] = payload
    rows, start = _gather_rows(slot, world_size, group, timeout_s), _HEADER
    sizes = [int(rows[r, :_HEADER].view(torch.int64)[0]) for r in range(world_size)]
    if max(sizes) + _HEADER > SLOT_BYTES:  # the second round: every payload, padded to the largest
        padded = torch.zeros(max(sizes), dtype=torch.uint8)
        padded[: len(payload)] = payload
        rows, start = _gather_rows(padded, world_size, group, timeout_s), 0
    return [pickle.loads(rows[r, start : start + sizes[r]].numpy().tobytes()) for r in range(world_size)]


def group_timeout_s(group: dist.ProcessGroup | None = None) -> float | None:
    """Local: the timeout ``group``'s collectives run under (the default group when None), in seconds, or None
    where this torch does not say. It is what ``init_process_group(timeout=...)`` / ``new_group(timeout=...)``
    set, or torch's default for the backend."""
    group = group if group is not None else dist.group.WORLD
    try:
        device = torch.device("cuda") if dist.get_backend(group) == "nccl" else torch.device("cpu")
        return group._get_backend(device).options._timeout.total_seconds()
    except Exception:  # noqa: BLE001 - private API that differs across torch builds: None says "unknown"
        return None


def job_timeout_s() -> float:
    """Local: the default process group's timeout in seconds (torch's default for its backend when it cannot
    be read). The SP groups and the Ulysses vote follow it unless told otherwise."""
    timeout = group_timeout_s()
    return timeout if timeout is not None else dist.distributed_c10d.default_pg_timeout.total_seconds()


def classify_failure(exc: BaseException) -> str:
    """``timeout``, ``closed`` (the connection to a peer closed or reset: the peer is gone) or ``failed``, from
    the message a gloo collective raised."""
    text = str(exc).lower()
    if "timed out" in text or "timeout" in text:
        return "timeout"
    if any(k in text for k in ("connection closed", "connection reset", "broken pipe", "closed by peer", "eof")):
        return "closed"
    return "failed"
