"""Typed registry of FastVideo's environment variables.

Values are read from ``os.environ`` every time they are asked for (never frozen at import), so a
recipe, a test or a launcher can change them between calls. ``docs/env_vars.md`` lists the same
variables; ``tests/test_envs.py`` fails when the two drift apart.

    >>> from fastvideo import envs
    >>> envs.get("FASTVIDEO_ULYSSES_A2A")
    'off'
    >>> with envs.override(FASTVIDEO_ULYSSES_A2A="auto"):
    ...     envs.get("FASTVIDEO_ULYSSES_A2A")
    'auto'
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EnvVar:
    """One variable: its name, how to parse it, its default and a one-line doc."""

    name: str
    kind: str  # "choice" | "int" | "float" | "str"
    default: Any
    doc: str
    choices: tuple[str, ...] = ()
    minimum: float | None = None

    def parse(self, raw: str | None) -> Any:
        """Parse ``raw`` (``None`` or empty means unset), raising a ValueError that says how to fix it."""
        if raw is None or raw.strip() == "":
            return self.default
        value = raw.strip()
        if self.kind == "str":
            return value
        if self.kind == "choice":
            low = value.lower()
            if low not in self.choices:
                raise ValueError(
                    f"{self.name}={raw!r} is not valid: choose one of {', '.join(self.choices)} "
                    f"(default {self.default!r})."
                )
            return low
        cast: Callable[[str], Any] = int if self.kind == "int" else float
        try:
            number = cast(value)
        except ValueError:
            raise ValueError(
                f"{self.name}={raw!r} is not valid: expected {'an integer' if self.kind == 'int' else 'a number'} "
                f"(default {self.default!r})."
            ) from None
        if self.minimum is not None and number < self.minimum:
            raise ValueError(
                f"{self.name}={raw!r} is not valid: must be >= {self.minimum:g} (default {self.default!r})."
            )
        return number


_REGISTRY: dict[str, EnvVar] = {}


def _register(var: EnvVar) -> EnvVar:
    _REGISTRY[var.name] = var
    return var


_register(
    EnvVar(
        "FASTVIDEO_ULYSSES_A2A",
        "choice",
        "off",
        "Ulysses all-to-all transport: `off` always takes the NCCL route (no vote); `auto` votes on every "
        "call and takes the fused NCCL-device-API route where every rank agrees it can.",
        choices=("off", "auto"),
    )
)
_register(
    EnvVar(
        "FASTVIDEO_ULYSSES_A2A_LONG_TRAINING",
        "choice",
        "auto",
        "Grad-tracked operands with planes over 512 MiB: `auto` keeps the original (untuned) policy; "
        "`chunked` lets them use tuned chunks.",
        choices=("auto", "chunked"),
    )
)
_register(
    EnvVar(
        "FASTVIDEO_ULYSSES_A2A_WINDOW_BYTES",
        "int",
        1 << 30,
        "Registered symmetric window per rank, in bytes (agreed across ranks at construction).",
        minimum=1,
    )
)
_register(
    EnvVar(
        "FASTVIDEO_ULYSSES_A2A_VOTE_TIMEOUT_S",
        "float",
        300.0,
        "Seconds a construction step or per-call vote may wait for peers before the helper disposes "
        "itself and raises instead of hanging.",
        minimum=0.1,
    )
)
_register(
    EnvVar(
        "FASTVIDEO_KERNEL_LIBRARY",
        "str",
        "",
        "Path of a separately built fastvideo-kernel communication library to load instead of the "
        "installed wheel's (development validation).",
    )
)


def registry() -> dict[str, EnvVar]:
    """All registered variables, by name."""
    return dict(_REGISTRY)


def get(name: str) -> Any:
    """Current parsed value of ``name`` (read from the environment now)."""
    try:
        var = _REGISTRY[name]
    except KeyError:
        raise KeyError(f"{name} is not a FastVideo environment variable; known: {', '.join(_REGISTRY)}") from None
    return var.parse(os.environ.get(name))


@contextlib.contextmanager
def override(**values: str | None) -> Iterator[None]:
    """Temporarily set (or with ``None`` unset) variables; restores the previous environment on exit."""
    for name in values:
        if name not in _REGISTRY:
            raise KeyError(f"{name} is not a FastVideo environment variable; known: {', '.join(_REGISTRY)}")
    saved = {name: os.environ.get(name) for name in values}
    try:
        for name, value in values.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
