"""Typed registry of FastVideo's environment variables.

Values are read from ``os.environ`` every time they are asked for (never frozen at import). The settings that
decide collectives are then agreed across the SP group at set points (``fastvideo/distributed/settings.py``),
never re-read per call. ``docs/env_vars.md`` lists the same
variables; ``tests/test_envs.py`` fails when the two drift apart.

Choices are case- and whitespace-insensitive (``" AUTO "`` reads as ``auto``); anything else outside
the choices is a ValueError naming the variable, the value and the choices. Variables marked
``agreed`` must be identical on every rank of an SP group: ``fastvideo/distributed/settings.py``
validates every variable and agrees those across the group, raising on every rank on a mismatch.

    >>> from fastvideo import envs
    >>> envs.get("FASTVIDEO_ULYSSES_A2A")
    'off'
    >>> with envs.override(FASTVIDEO_ULYSSES_A2A="auto"):
    ...     envs.get("FASTVIDEO_ULYSSES_A2A")
    'auto'
    >>> envs.FASTVIDEO_ULYSSES_A2A      # upstream FastVideo's spelling: the same parsed value, read now
    'off'

Assigning one (``envs.FASTVIDEO_ULYSSES_A2A = "auto"``) raises: upstream FastVideo reads the environment
on every use, so an assignment there is silently ignored by most readers; here the settings are validated
and agreed across the SP group when it is initialised, and an assignment cannot reach that agreement. The
error says how to change a setting (``ASSIGNMENT_HELP``).
"""

from __future__ import annotations

import contextlib
import os
import sys
import types
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
    # True: decides which collectives a rank runs (or the plans they carry), so every rank of an SP
    # group must hold the same value; agreed collectively (``fastvideo/distributed/settings.py``).
    agreed: bool = False

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
        "Ulysses all-to-all transport: `off` always takes the NCCL route (no vote unless checked mode is on); "
        "`auto` votes on every call, on every route (FASTVIDEO_ULYSSES_A2A_CHECKED=0: the fused route's calls "
        "only), and takes the fused NCCL-device-API route where every rank agrees it can.",
        choices=("off", "auto"),
        agreed=True,
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
        agreed=True,
    )
)
_register(
    EnvVar(
        "FASTVIDEO_ULYSSES_A2A_WINDOW_BYTES",
        "int",
        1 << 30,
        "Registered symmetric window per rank, in bytes (agreed across ranks at construction).",
        minimum=1,
        agreed=True,
    )
)
_register(
    EnvVar(
        "FASTVIDEO_ULYSSES_A2A_CHECKED",
        "choice",
        "auto",
        "Checked mode: every call of the Ulysses all-to-all votes its 12-field contract whatever the route "
        "(`off`, a helper that declined at construction or a call that declined, fused, compiled), so ranks that "
        "pass different shapes, dtypes, modes, split tables or grad flags all raise instead of hanging or returning "
        "wrong data, and so does a rank that skips or repeats a tagged call (`tag=`; an untagged skip is not seen) "
        "or whose call fails before the exchange (invalid input on one rank); one vote per call. `1` on, `0` off "
        "(under `auto` only the fused route's own vote remains), `auto` on under FASTVIDEO_ULYSSES_A2A=auto and, "
        "under `off`, on when torch's distributed debug level is DETAIL (TORCH_DISTRIBUTED_DEBUG=DETAIL).",
        choices=("auto", "0", "1"),
        agreed=True,
    )
)
_register(
    EnvVar(
        "FASTVIDEO_ULYSSES_A2A_VOTE_TIMEOUT_S",
        "float",
        0.0,
        "Seconds a settings agreement, a construction step or a per-call vote may wait for peers before it raises "
        "(the helper then disposes itself) instead of hanging; `0` follows the SP group's timeout, which is the "
        "default process group's (`init_process_group(timeout=...)`) unless `initialize_sequence_parallel` was given "
        "one.",
        minimum=0.0,
    )
)
_register(
    EnvVar(
        "FASTVIDEO_ULYSSES_A2A_WATCHDOG_TIMEOUT_S",
        "float",
        0.0,
        "Seconds a launched fused call may stay incomplete before the watchdog logs which call, plan and peers "
        "are stuck and ends the process; `0` uses FASTVIDEO_ULYSSES_A2A_VOTE_TIMEOUT_S.",
        minimum=0.0,
    )
)
_register(
    EnvVar(
        "FASTVIDEO_ULYSSES_A2A_VOTED_LAUNCH",
        "choice",
        "1",
        "`1`: a fused call over the same-host shared-memory vote exchanges its fields and launches in one kernel-"
        "library call where every rank proposed the same call (the verdict's one RUN case); `0`: the vote, the "
        "Python verdict, then the launch. Rank-local (both are the same exchange and verdict), read when the helper "
        "is built.",
        choices=("0", "1"),
    )
)
_register(
    EnvVar(
        "FASTVIDEO_ULYSSES_A2A_HOT_PATH",
        "choice",
        "1",
        "`1`: where the voted launch is one kernel-library call and the hot-path extension is built for this torch "
        "(`fastvideo-kernel/build_hot.py`), the later eager calls of a signature already launched fused make their "
        "host path to the launch in one native call; `0`: every call takes the Python path. Rank-local (both make "
        "the same proposal, vote and verdict), read when the helper is built.",
        choices=("0", "1"),
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

_register(
    EnvVar(
        "FASTVIDEO_ULYSSES_A2A_OVERLAP",
        "int",
        0,
        "Head groups `DistributedAttention` pipelines its all-to-alls over (each group's exchanges in flight on the "
        "communication stream under its neighbours' attention; the same result): `0` or `1` off (default), `N` "
        "groups (capped at the layer's heads). A layer's own `overlap_chunks` wins. Agreed across the SP group.",
        minimum=0,
        agreed=True,
    )
)


def registry() -> dict[str, EnvVar]:
    """All registered variables, by name."""
    return dict(_REGISTRY)


def agreed_names() -> tuple[str, ...]:
    """The variables every rank of an SP group must set identically (``EnvVar.agreed``), in registry order."""
    return tuple(name for name, var in _REGISTRY.items() if var.agreed)


def raw(names: tuple[str, ...]) -> tuple[str | None, ...]:
    """The unparsed strings of ``names`` (None when unset): for cheap change detection, never for decisions."""
    return tuple(map(os.environ.get, names))


def snapshot(names: tuple[str, ...]) -> tuple[object, ...]:
    """An opaque value of ``names``'s current raw values: equal snapshots mean unchanged values (what a settings
    agreement records, to name a later change). For change detection only (``raw`` gives the strings)."""
    return raw(names)


def read_all() -> tuple[dict[str, Any], list[str]]:
    """Every registered variable parsed now: ``(values, errors)``. Never raises.

    An invalid value is left out of ``values`` and its error (naming the variable, the value and the
    choices) is in ``errors``, so callers can exchange errors across ranks before raising together.
    """
    values: dict[str, Any] = {}
    errors: list[str] = []
    for name, var in _REGISTRY.items():
        try:
            values[name] = var.parse(os.environ.get(name))
        except ValueError as exc:
            errors.append(str(exc))
    return values, errors


def validate_all() -> dict[str, Any]:
    """Parse every registered variable; one ValueError listing every invalid value, else the values."""
    values, errors = read_all()
    if errors:
        raise ValueError("Invalid FastVideo environment: " + " ".join(errors))
    return values


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


# ---------------------------------------------------------------------------------------- module attributes

# Read as upstream FastVideo reads it (``envs.LOCAL_RANK``): torchrun's variable, not a FastVideo setting.
_PROCESS_VARS: dict[str, Callable[[], Any]] = {"LOCAL_RANK": lambda: int(os.environ.get("LOCAL_RANK", "0"))}

ASSIGNMENT_HELP = (
    "Set {name} in the environment before the SP groups are initialised (initialize_sequence_parallel, or "
    "maybe_init_distributed_environment_and_model_parallel), where every rank's value is validated and agreed; "
    "or change it on every rank with `with envs.override({name}=...):` and then call "
    "fastvideo.distributed.parallel_state.agree_ulysses_settings() (collective) inside the block."
)


class _EnvsModule(types.ModuleType):
    """This module, with upstream FastVideo's attribute access: ``envs.NAME`` is ``get(NAME)``, read now;
    assigning or deleting a registered name raises (see the module docstring)."""

    def __getattr__(self, name: str) -> Any:  # only for names the module itself does not define
        if name in _REGISTRY:
            return get(name)
        if name in _PROCESS_VARS:
            return _PROCESS_VARS[name]()
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}; the FastVideo environment variables "
                             f"are {', '.join(_REGISTRY)} (and {', '.join(_PROCESS_VARS)})")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _REGISTRY or name in _PROCESS_VARS:
            raise AttributeError(f"envs.{name} cannot be assigned: it is read from the environment, and assigning "
                                 "the attribute would change nothing the SP group agreed on. "
                                 + ASSIGNMENT_HELP.format(name=name))
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        if name in _REGISTRY or name in _PROCESS_VARS:
            raise AttributeError(f"envs.{name} cannot be deleted. " + ASSIGNMENT_HELP.format(name=name))
        super().__delattr__(name)

    def __dir__(self) -> list[str]:
        return sorted({*super().__dir__(), *_REGISTRY, *_PROCESS_VARS})


sys.modules[__name__].__class__ = _EnvsModule
