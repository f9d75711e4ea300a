"""How every case times: host-to-completion from a line-up, device time by CUDA events, rank-max.

* **Host-to-completion** of one call: ``perf_counter`` before the call, the call, a device synchronize,
  ``perf_counter`` after; the ranks lined up (``lineup.barrier``) before each iteration, outside the timed
  region. Per iteration the slowest rank's own time (``rank_max``), and the same iterations timed from the
  last rank's entry (``aligned``: last end - last start on the host's one monotonic clock, kept only where
  every rank is on one host) with the entry skew the line-up left.
* **Device time**: CUDA events around the call on the current stream (``perf_counter`` around it on CPU),
  each iteration after a line-up; rank-max per iteration. Recorded on an idle device, the start event fires at
  once, so this also takes in the call's host time before its first kernel and the launch latency.
* **Busy device time** (``busy_overhead``): the same events with the device kept busy ahead of them by a spin
  kernel (``torch.cuda._sleep``) that outlasts the host's enqueueing of the call, so they bracket only the
  device's execution of what the call enqueued.

The functions here block the host; each docstring says whether it is collective over the SP group (the ranks
must call it with the same iteration counts) or local.
"""

from __future__ import annotations

import math
import statistics
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


def _host_to_completion(fn: Callable[[], object], device: torch.device) -> float:
    """Host seconds of one call of ``fn`` and a device synchronize after it. Local."""
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - t0


def paired_overhead(host_fn: Callable[[], object], device_fn: Callable[[], object], device: torch.device, iters: int,
                    warmup: int) -> list[float]:
    """Per iteration, the host-to-completion seconds of ``host_fn`` minus the device seconds of ``device_fn``
    (CUDA events around it on an idle device; ``perf_counter`` on CPU) timed right after it. Local: one process,
    no line-up.

    The two halves of each difference are taken back to back, so a shared host's or device's drift between two
    separate loops (whose medians would be subtracted) cancels; the spread of the differences is the spread of
    the overhead itself. The device was idle when the start event was recorded, so the subtracted half also holds
    the host's time in ``device_fn`` before its first kernel: ``busy_overhead`` leaves that in the difference."""
    for _ in range(warmup):
        host_fn()
        device_fn()
    synchronize(device)
    events = _timing_events(device)
    return [_host_to_completion(host_fn, device) - _device_seconds(device_fn, events) for _ in range(iters)]


SPIN_COVER = 4.0  # the spin lasts this many times the host time of the call it must outlast
SPIN_FLOOR_S = 50e-6  # and at least this long
SPIN_MAX_S = 0.1  # a call not queued ahead of a spin this long waits for the device itself: refused
_SPIN_RATES: dict[int, float] = {}  # torch.cuda._sleep's cycles per second, per device index, measured once


def spin_rate(short_cycles: int, short_s: float, long_cycles: int, long_s: float) -> float:
    """Cycles per second of the spin kernel from two event-timed spins of different lengths: the slope, so the
    launch latency and event overhead both carry cancel. Pure; ValueError where the longer spin is not longer."""
    if long_cycles <= short_cycles or long_s <= short_s:
        raise ValueError(f"spin calibration: {long_cycles} cycles took {long_s * 1e6:.1f} us, not longer than "
                         f"{short_cycles} cycles ({short_s * 1e6:.1f} us)")
    return (long_cycles - short_cycles) / (long_s - short_s)


def spin_cycles(rate: float, host_s: float, cover: float = SPIN_COVER, floor_s: float = SPIN_FLOOR_S) -> int:
    """Cycles of a spin at ``rate`` cycles per second that lasts ``cover`` times ``host_s`` (the host time it must
    outlast), and at least ``floor_s``. Pure; ValueError for a rate that is not positive or a negative time."""
    if not rate > 0 or host_s < 0:
        raise ValueError(f"spin length from rate {rate} cycles/s and host time {host_s} s")
    return math.ceil(rate * max(cover * host_s, floor_s))


def held_samples(sample: Callable[[int], tuple[object, bool]], cycles: int, iters: int,
                 max_cycles: int) -> tuple[list, int, int]:
    """``iters`` values of ``sample(cycles)`` -> (value, held) that held: an iteration whose spin did not hold
    (it ended before the work behind it was queued) is taken again with the spin doubled. Returns (values, the
    cycles at the end, how many times they doubled). Local; RuntimeError once the spin would pass ``max_cycles``."""
    values, doubled = [], 0
    while len(values) < iters:
        value, held = sample(cycles)
        if held:
            values.append(value)
            continue
        cycles, doubled = max(1, 2 * cycles), doubled + 1
        if cycles > max_cycles:
            raise RuntimeError(f"the spin ended before the work behind it was queued, even at {max_cycles} cycles: "
                               "the timed call waits for the device itself")
    return values, cycles, doubled


def _sleep_rate(device: torch.device) -> float:
    """``torch.cuda._sleep``'s cycles per second on ``device`` (``spin_rate`` of the medians of five event-timed
    spins of each of two lengths), measured once per device. Local."""
    index = torch.cuda.current_device() if device.index is None else device.index
    if index not in _SPIN_RATES:
        events = _timing_events(device)

        def timed(cycles: int) -> float:
            return statistics.median(_device_seconds(lambda: torch.cuda._sleep(cycles), events) for _ in range(5))

        timed(100_000)  # the spin kernel's first launch
        _SPIN_RATES[index] = spin_rate(200_000, timed(200_000), 1_000_000, timed(1_000_000))
    return _SPIN_RATES[index]


def _enqueue_seconds(fn: Callable[[], object], device: torch.device) -> float:
    """Host seconds of one call of ``fn`` on an idle device, up to its return (its work queued); a synchronize
    after it, untimed. Local."""
    t0 = time.perf_counter()
    fn()
    seconds = time.perf_counter() - t0
    synchronize(device)
    return seconds


def _busy_device_seconds(fn: Callable[[], object], events: tuple | None, cycles: int) -> tuple[float, bool]:
    """One call of ``fn`` timed on the device behind a spin of ``cycles``: (seconds between the events, whether
    the start event was still pending once ``fn`` and the end event were queued, i.e. whether the spin held).
    ``perf_counter`` around it where ``events`` is None (CPU; always held). Local."""
    if events is None:
        return _device_seconds(fn, None), True
    start, end = events
    torch.cuda._sleep(cycles)
    start.record()
    fn()
    end.record()
    held = not start.query()
    end.synchronize()
    return start.elapsed_time(end) / 1e3, held


def busy_overhead(host_fn: Callable[[], object], device_fn: Callable[[], object], device: torch.device, iters: int,
                  warmup: int) -> dict:
    """Per iteration, the host-to-completion seconds of ``host_fn`` minus the device seconds of ``device_fn`` timed
    right after it with the device kept busy ahead of the start event: a spin kernel queued before it outlasts the
    host's enqueueing of ``device_fn``, so the events bracket only the device's execution of what ``device_fn``
    enqueued, and every host second of ``host_fn`` stays in the difference. Local: one process, no line-up.

    The spin lasts ``spin_cycles`` of the median host time to enqueue ``device_fn`` (five calls), at the rate
    ``_sleep_rate`` measured; an iteration whose start event had already fired once its work was queued is taken
    again with the spin doubled (``held_samples``). On CPU ``perf_counter`` around ``device_fn``, no spin (timings
    mean nothing). Returns ``{"overhead": [...], "device": [...], "spin_s": the spin's length at the end (0 on
    CPU), "spin_doubled": how many times it doubled}``."""
    for _ in range(warmup):
        host_fn()
        device_fn()
    synchronize(device)
    events = _timing_events(device)
    rate, cycles = 0.0, 0
    if events is not None:
        rate = _sleep_rate(device)
        cycles = spin_cycles(rate, statistics.median(_enqueue_seconds(device_fn, device) for _ in range(5)))

    def sample(spin: int) -> tuple[tuple[float, float], bool]:
        host_s = _host_to_completion(host_fn, device)
        dev, held = _busy_device_seconds(device_fn, events, spin)
        return (host_s - dev, dev), held

    pairs, cycles, doubled = held_samples(sample, cycles, iters, max_cycles=math.ceil(rate * SPIN_MAX_S))
    return {"overhead": [o for o, _ in pairs], "device": [d for _, d in pairs],
            "spin_s": cycles / rate if rate else 0.0, "spin_doubled": doubled}


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
