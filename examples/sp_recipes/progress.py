"""A per-step progress line for training: step, a bar, loss, step time and the route the step's all-to-alls took.

On a terminal it redraws one line; in a log (not a TTY) it writes one line per step, so the log keeps every
step. Only rank 0 should draw one.
"""

from __future__ import annotations

import sys
from typing import TextIO

__all__ = ["ProgressBar"]


class ProgressBar:
    """``update`` once per step; ``close`` at the end (ends the redrawn line)."""

    def __init__(self, total: int, label: str, *, stream: TextIO | None = None, width: int = 20,
                 first: int = 0) -> None:
        self.total, self.label, self.width, self.first = total, label, width, first
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def line(self, step: int, loss: float, step_ms: float, route: str) -> str:
        done = round(self.width * step / max(self.total, 1))
        bar = "#" * done + "." * (self.width - done)
        digits = len(str(self.total))
        return (f"[{self.label}] step {step:>{digits}}/{self.total} [{bar}] loss {loss:.6f}  "
                f"{step_ms:8.1f} ms/step  route {route}")

    def update(self, step: int, loss: float, step_ms: float, route: str) -> None:
        text = self.line(step, loss, step_ms, route)
        if self.tty:
            self.stream.write("\r\033[K" + text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
