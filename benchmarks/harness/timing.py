"""How every case times: host-to-completion from a line-up, device time by CUDA events, rank-max.

* **Host-to-completion** of one call: ``perf_counter`` before the call, the call, a device synchronize,
  ``perf_counter`` after; the ranks lined up (``lineup.barrier``) before each iteration, outside the timed
  region. Per iteration the slowest rank's own time (``rank_max``), and the same iterations timed from the
  last rank's entry (``aligned``: last end - last start on the host's one monotonic clock, kept only where
  every rank is on one host) with the entry skew the line-up left.
* **Device time**: CUDA events around the call on the current stream (``perf_counter`` around it on CPU),
  each iteration after a line-up; rank-max per iteration.

Every function here is collective over the SP group (the ranks must call it with the same iteration counts)
and blocks the host.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from benchmarks.harness import lineup
from benchmarks.harness.process import cpu_group


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _multi_rank() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def rank_max(values: Sequence[float]) -> list[float]:
    """Element-wise max over ranks of a list of numbers (every rank passes the same length). Collective."""
    t = torch.tensor(list(values), dtype=torch.float64)
    if _multi_rank():
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=cpu_group())
    return t.tolist()


def rank_sum(value: int) -> int:
    """Sum over ranks of one integer (wrong-element counts). Collective."""
    t = torch.tensor([int(value)], dtype=torch.int64)
    if _multi_rank():
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=cpu_group())
    return int(t.item())


def gather(obj: object) -> list:
    """Every rank's ``obj``, by rank (a picklable object). Collective."""
    if not _multi_rank():
        return [obj]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=cpu_group())
    return out


def aligned_times(starts: torch.Tensor, ends: torch.Tensor) -> tuple[list[float], list[float]]:
    """Per iteration, from ``[rank, iteration]`` start and end times on one clock: (last end - last start, last
    start - first start). A collective cannot finish before its last rank arrives, so the first is its cost
    from that arrival; the second is the skew the line-up left. Pure."""
    last_start = starts.max(dim=0).values
    return (ends.max(dim=0).values - last_start).tolist(), (last_start - starts.min(dim=0).values).tolist()


def host_timings(fn: Callable[[], object], device: torch.device, iters: int, warmup: int) -> dict[str, list[float]]:
    """Host-to-completion seconds of ``fn`` per iteration (module docstring): ``rank_max``, ``aligned`` and
    ``entry_skew`` lists. Collective; ``warmup`` untimed calls first."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    starts, ends = [], []
    for _ in range(iters):
        lineup.barrier()
        start = time.perf_counter()
        fn()
        synchronize(device)
        starts.append(start)
        ends.append(time.perf_counter())
    if not _multi_rank():
        own = [e - s for s, e in zip(starts, ends, strict=True)]
        return {"rank_max": own, "aligned": own, "entry_skew": [0.0] * len(starts)}
    # One gather serves all three: each rank's own durations need no common clock, the other two do.
    both = torch.tensor([starts, ends], dtype=torch.float64)
    gathered = [torch.empty_like(both) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, both, group=cpu_group())
    stacked = torch.stack(gathered)  # [rank, start|end, iteration]
    rank_max_times = (stacked[:, 1] - stacked[:, 0]).max(dim=0).values.tolist()
    if not lineup.same_host():
        return {"rank_max": rank_max_times, "aligned": [], "entry_skew": []}
    aligned, skew = aligned_times(stacked[:, 0], stacked[:, 1])
    return {"rank_max": rank_max_times, "aligned": aligned, "entry_skew": skew}


def host_latencies(fn: Callable[[], object], device: torch.device, iters: int, warmup: int) -> list[float]:
    """Host-to-completion seconds of ``fn`` per iteration: the rank-max of ``host_timings``. Collective."""
    return host_timings(fn, device, iters, warmup)["rank_max"]


def _device_seconds(fn: Callable[[], object], events: tuple | None) -> float:
    """One call of ``fn`` timed on the device: CUDA events ``events`` (start, end) around it and waited for;
    ``perf_counter`` around it where ``events`` is None (CPU)."""
    if events is None:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    start, end = events
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def _timing_events(device: torch.device) -> tuple | None:
    return (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if device.type == "cuda" \
        else None


def device_times(fn: Callable[[], object], device: torch.device, iters: int, warmup: int) -> list[float]:
    """Device seconds of ``fn`` per iteration: CUDA events around it (``perf_counter`` on CPU), a line-up
    before each, rank-max. Collective."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    events = _timing_events(device)
    times = []
    for _ in range(iters):
        lineup.barrier()
        times.append(_device_seconds(fn, events))
    return rank_max(times)


def paired_overhead(host_fn: Callable[[], object], device_fn: Callable[[], object], device: torch.device, iters: int,
                    warmup: int) -> list[float]:
    """Per iteration, the host-to-completion seconds of ``host_fn`` minus the device seconds of ``device_fn``
    (CUDA events around it; ``perf_counter`` on CPU) timed right after it. Local: one process, no line-up.

    The two halves of each difference are taken back to back, so a shared host's or device's drift between two
    separate loops (whose medians would be subtracted) cancels; the spread of the differences is the spread of
    the overhead itself."""
    for _ in range(warmup):
        host_fn()
        device_fn()
    synchronize(device)
    events = _timing_events(device)
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        host_fn()
        synchronize(device)
        host = time.perf_counter() - t0
        out.append(host - _device_seconds(device_fn, events))
    return out


class Samples:
    """Timings of one contender accumulated over rotated rounds (``host_timings`` dicts appended)."""

    def __init__(self) -> None:
        self.rank_max: list[float] = []
        self.aligned: list[float] = []
        self.entry_skew: list[float] = []

    def add(self, timings: dict[str, list[float]]) -> None:
        self.rank_max += timings["rank_max"]
        self.aligned += timings["aligned"]
        self.entry_skew += timings["entry_skew"]


def rotated(items: Sequence, round_index: int) -> list:
    """``items`` rotated left by ``round_index`` (round r starts with item r mod n): each item leads once in
    every n rounds, so slow drift (clocks, temperature, the allocator) spreads over all of them. Pure."""
    if not items:
        return []
    k = round_index % len(items)
    return list(items[k:]) + list(items[:k])
