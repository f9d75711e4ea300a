"""Pure arithmetic of the measurements: medians with spread, and the one bandwidth definition.

    GB/s = bytes moved per rank / time,   bytes moved per rank = operand bytes x (P - 1) / P

The bytes each rank sends to its peers (its 1/P self-share never crosses the fabric), divided by the measured
time, in 1e9 bytes per second. With P = 1 nothing moves and the bandwidth is 0.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def quantile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank quantile of an already sorted, non-empty sequence."""
    return sorted_values[min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))]


def summarize(values: Sequence[float], scale: float = 1e3, unit: str = "ms") -> dict:
    """Median, p10, p90, min and max of ``values`` (seconds), scaled (default: to milliseconds), and n.

    Keys are ``median_<unit>``, ``p10_<unit>``, ``p90_<unit>``, ``min_<unit>``, ``max_<unit>`` and ``n``; every
    value is None for an empty sequence.
    """
    v = sorted(values)
    keys = ("median", "p10", "p90", "min", "max")
    if not v:
        return {**{f"{k}_{unit}": None for k in keys}, "n": 0}
    picked = (statistics.median(v), quantile(v, 0.10), quantile(v, 0.90), v[0], v[-1])
    return {**{f"{k}_{unit}": x * scale for k, x in zip(keys, picked, strict=True)}, "n": len(v)}


def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def bytes_moved_per_rank(operand_bytes: int, world_size: int) -> int:
    """Bytes one rank sends to its peers in one all-to-all of an ``operand_bytes`` per-rank operand."""
    return operand_bytes * (world_size - 1) // world_size


def bandwidth_gbps(operand_bytes: int, world_size: int, seconds: float | None) -> float | None:
    """THE bandwidth definition: bytes moved per rank / time, in GB/s (1e9 B/s); 0 at P = 1, None untimed."""
    if world_size < 2:
        return 0.0
    if not seconds:
        return None
    return bytes_moved_per_rank(operand_bytes, world_size) / seconds / 1e9


def rate_gbps(nbytes: int, seconds: float | None) -> float | None:
    """``nbytes`` / ``seconds`` in GB/s (1e9 B/s), for flat copies whose bytes are counted directly."""
    return nbytes / seconds / 1e9 if seconds else None
