"""Progress lines for long runs: ``# progress: [done/total] what, elapsed, about T left`` on rank 0."""

from __future__ import annotations

import sys
import time


class Progress:
    """Counts finished units of work and prints a line at most every ``every_s`` seconds, and at the last unit.
    Local: only the rank constructed with ``enabled=True`` prints."""

    def __init__(self, total: int, *, every_s: float = 30.0, enabled: bool = True, stream=None) -> None:
        self.total, self.every_s, self.enabled = max(int(total), 0), every_s, enabled
        self.done = 0
        self.start = self.last = time.monotonic()
        self.stream = stream if stream is not None else sys.stdout
        self.lines: list[str] = []

    def advance(self, what: str = "", units: int = 1) -> None:
        self.done += units
        now = time.monotonic()
        if not self.enabled or (now - self.last < self.every_s and self.done < self.total):
            return
        self.last = now
        elapsed = now - self.start
        left = elapsed / self.done * (self.total - self.done) if self.done else float("nan")
        line = (f"# progress: [{self.done}/{self.total}] {what}, elapsed {elapsed:.0f} s"
                + (f", about {left:.0f} s left" if self.done < self.total else ""))
        self.lines.append(line)
        print(line, file=self.stream, flush=True)
