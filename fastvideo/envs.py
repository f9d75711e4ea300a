"""FastVideo's environment variables: upstream FastVideo 0.2.1's registry, and this package's typed settings.

Two kinds of variable, one module (it replaces upstream's ``fastvideo/envs.py`` in the overlay):

* **Upstream's** (``FASTVIDEO_ATTENTION_BACKEND``, ``FASTVIDEO_CONFIGURE_LOGGING``, ``LOCAL_RANK``, ...; their table
  is ``fastvideo/upstream_envs.py``): the same names, defaults and parsing as upstream's, read at each access
  (``envs.NAME``, ``environment_variables[NAME]()``), so no other module can tell the difference. Parsing is
  upstream's, errors included (``int("x")``'s ValueError); they are not validated ahead nor agreed across ranks,
  as upstream's are not.
* **This package's** (``EnvVar``, ``registry()``): typed, validated with an error that names the variable, the value
  and the choices, and the ``agreed`` ones agreed across the SP group at set points
  (``fastvideo/distributed/settings.py``), never re-read per call. ``docs/env_vars.md`` lists both kinds;
  ``tests/test_envs.py`` fails when they drift apart.

``FASTVIDEO_ULYSSES_A2A`` is both: upstream's name and default, this package's parsing (``" AUTO "`` reads as
``auto`` as upstream's does; a value other than ``off``/``auto`` raises where upstream's passes it through and
its readers treat it as ``off``; an empty value is ``off``). Ranks whose agreed settings differ decline together,
as upstream's do: each such setting takes its conservative value (the route ``off``), with a warning on every rank.

    >>> from fastvideo import envs
    >>> envs.get("FASTVIDEO_ULYSSES_A2A")
    'off'
    >>> with envs.override(FASTVIDEO_ULYSSES_A2A="auto"):
    ...     envs.get("FASTVIDEO_ULYSSES_A2A")
    'auto'
    >>> envs.FASTVIDEO_ULYSSES_A2A      # upstream FastVideo's spelling: the same parsed value, read now
    'off'
    >>> with envs.FASTVIDEO_ULYSSES_A2A_LONG_TRAINING.override("chunked"):   # upstream's idiom (upstream_envs.py)
    ...     envs.FASTVIDEO_ULYSSES_A2A_LONG_TRAINING
    'chunked'

An override sets this process's environment for the block; helpers follow the settings the SP group *agreed*, so
it reaches them only through a new agreement on every rank (``parallel_state.agree_ulysses_settings()``).

Assigning one of this package's variables (``envs.FASTVIDEO_ULYSSES_A2A = "auto"``) raises: upstream FastVideo
reads the environment on every use, so an assignment there is silently ignored by most readers; here the
settings are validated and agreed across the SP group when it is initialised, and an assignment cannot reach
that agreement. The error says how to change a setting (``ASSIGNMENT_HELP``). Upstream's other variables
assign as upstream's do (the stored attribute then answers ``envs.NAME``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

# Upstream's variables, and its helpers of the same names (its envs.py defines them; code may import them here).
from fastvideo import upstream_envs as _upstream_envs
from fastvideo.upstream_envs import VARIABLES as _UPSTREAM
from fastvideo.upstream_envs import get_default_cache_root, get_default_config_root, maybe_convert_int  # noqa: F401

if TYPE_CHECKING:  # what ``envs.NAME`` returns, for type checkers (the module answers them at run time)
    FASTVIDEO_TARGET_DEVICE: str
    MAX_JOBS: str | None
    NVCC_THREADS: str | None
    FASTVIDEO_USE_PRECOMPILED: bool
    CMAKE_BUILD_TYPE: str | None
    VERBOSE: bool
    FASTVIDEO_CONFIG_ROOT: str
    FASTVIDEO_CACHE_ROOT: str
    FASTVIDEO_HOST_IP: str
    FASTVIDEO_LOOPBACK_IP: str
    FASTVIDEO_RAY_PER_WORKER_GPUS: float
    FASTVIDEO_RINGBUFFER_WARNING_INTERVAL: int
    FASTVIDEO_NCCL_SO_PATH: str | None
    LD_LIBRARY_PATH: str | None
    FASTVIDEO_TEST_DYNAMO_FULLGRAPH_CAPTURE: bool
    LOCAL_RANK: int
    CUDA_VISIBLE_DEVICES: str | None
    FASTVIDEO_ENGINE_ITERATION_TIMEOUT_S: int
    FASTVIDEO_CONFIGURE_LOGGING: int
    FASTVIDEO_LOGGING_CONFIG_PATH: str | None
    FASTVIDEO_LOGGING_LEVEL: str
    FASTVIDEO_LOGGING_PREFIX: str
    FASTVIDEO_TRACE_FUNCTION: int
    FASTVIDEO_ATTENTION_BACKEND: str | None
    FASTVIDEO_FA4: bool
    FASTVIDEO_MINIMAX_H3_FA4_PACKED_VARLEN: bool
    FASTVIDEO_INFERENCE_TORCH_COMPILE: bool
    FASTVIDEO_VAE_PARALLEL_DECODE: bool
    FASTVIDEO_VAE_PARALLEL_ENCODE: bool
    FASTVIDEO_VAE_PARALLEL_DECODE_STRATEGY: str | None
    FASTVIDEO_MINIMAX_H3_FUSIONS: str
    FASTVIDEO_ULYSSES_A2A: str
    FASTVIDEO_WORKER_MULTIPROC_METHOD: str
    FASTVIDEO_NVTX_PROFILE: bool
    FASTVIDEO_TORCH_PROFILER_DIR: str | None
    FASTVIDEO_TORCH_PROFILER_RECORD_SHAPES: bool
    FASTVIDEO_TORCH_PROFILER_WITH_PROFILE_MEMORY: bool
    FASTVIDEO_TORCH_PROFILER_WITH_STACK: bool
    FASTVIDEO_TORCH_PROFILER_WITH_FLOPS: bool
    FASTVIDEO_TORCH_PROFILE_REGIONS: str
    FASTVIDEO_TRACE_ACTIVATIONS: bool
    FASTVIDEO_TRACE_LAYERS: str
    FASTVIDEO_TRACE_STATS: str
    FASTVIDEO_TRACE_OUTPUT: str
    FASTVIDEO_TRACE_STEPS: str
    FASTVIDEO_SERVER_DEV_MODE: bool
    FASTVIDEO_STAGE_LOGGING: bool
    FASTVIDEO_CFG_GATE_STEP: float
    FASTVIDEO_ULYSSES_A2A_LONG_TRAINING: str
    FASTVIDEO_ULYSSES_A2A_WINDOW_BYTES: int
    FASTVIDEO_ULYSSES_A2A_CHECKED: str
    FASTVIDEO_ULYSSES_A2A_VOTE_TIMEOUT_S: float
    FASTVIDEO_ULYSSES_A2A_WATCHDOG_TIMEOUT_S: float
    FASTVIDEO_ULYSSES_A2A_VOTED_LAUNCH: str
    FASTVIDEO_ULYSSES_A2A_HOT_PATH: str
    FASTVIDEO_KERNEL_LIBRARY: str
    FASTVIDEO_ULYSSES_A2A_OVERLAP: int


# ------------------------------------------------------------------------------------ this package's typed settings

@dataclass(frozen=True)
class EnvVar:
    """One variable: its name, how to parse it, its default and a one-line doc."""

    name: str
    default: Any  # its type is the kind of a variable without choices: int, float or str
    doc: str
    choices: tuple[str, ...] = ()
    minimum: float | None = None
    maximum: float | None = None
    # True: decides which collectives a rank runs (or the plans they carry), so every rank of an SP
    # group must hold the same value; agreed collectively (``fastvideo/distributed/settings.py``).
    agreed: bool = False

    @property
    def kind(self) -> str:
        """``choice`` (one of ``choices``), else the default's type: ``int``, ``float`` or ``str``."""
        return "choice" if self.choices else type(self.default).__name__

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
                raise self._invalid(raw, f"choose one of {', '.join(self.choices)}")
            return low
        cast: Callable[[str], Any] = int if self.kind == "int" else float
        try:
            number = cast(value)
        except ValueError:
            raise self._invalid(raw, "expected an integer" if self.kind == "int" else "expected a number") from None
        low, high = -float("inf") if self.minimum is None else self.minimum, self.maximum or float("inf")
        if not low <= number <= high:  # NaN too
            raise self._invalid(raw, f"must be >= {low:g}" + (f" and <= {high:g}" if self.maximum else ""))
        return number

    def _invalid(self, raw: str, what: str) -> ValueError:
        """The error for ``raw``: the variable, the value, ``what`` a valid one is, and the default."""
        return ValueError(f"{self.name}={raw!r} is not valid: {what} (default {self.default!r}).")


_REGISTRY: dict[str, EnvVar] = {var.name: var for var in (
    EnvVar(
        "FASTVIDEO_ULYSSES_A2A",
        "off",
        "Ulysses all-to-all transport: `off` always takes the NCCL route (no vote unless checked mode is on); "
        "`auto` votes on every call, on every route (FASTVIDEO_ULYSSES_A2A_CHECKED=0: the fused route's calls "
        "only), and takes the fused NCCL-device-API route where every rank agrees it can. Agreed across the SP "
        "group: ranks that differ decline together to `off` (exact, over NCCL), each warning with every rank's "
        "value, as upstream's ranks decline; the next agreement on which they agree restores it.",
        choices=("off", "auto"),
        agreed=True,
    ),
    EnvVar(
        "FASTVIDEO_ULYSSES_A2A_LONG_TRAINING",
        "auto",
        "Grad-tracked operands with planes over 512 MiB: `auto` keeps the original (untuned) policy; "
        "`chunked` lets them use tuned chunks.",
        choices=("auto", "chunked"),
        agreed=True,
    ),
    EnvVar(
        "FASTVIDEO_ULYSSES_A2A_WINDOW_BYTES",
        1 << 30,
        "Registered symmetric window per rank, in bytes (agreed across ranks at construction).",
        minimum=1,
        agreed=True,
    ),
    EnvVar(
        "FASTVIDEO_ULYSSES_A2A_CHECKED",
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
    ),
    EnvVar(
        "FASTVIDEO_ULYSSES_A2A_VOTE_TIMEOUT_S",
        0.0,
        "Seconds a settings agreement, a construction step or a per-call vote may wait for peers before it raises "
        "(the helper then disposes itself) instead of hanging; `0` follows the SP group's timeout, which is the "
        "default process group's (`init_process_group(timeout=...)`) unless `initialize_sequence_parallel` was given "
        "one. At most a week.",
        minimum=0.0, maximum=7 * 24 * 3600.0,  # a week: a bound that any timedelta holds
    ),
    EnvVar(
        "FASTVIDEO_ULYSSES_A2A_WATCHDOG_TIMEOUT_S",
        0.0,
        "Seconds a launched fused call may stay incomplete before the watchdog logs which call, plan and peers "
        "are stuck and ends the process; `0` uses FASTVIDEO_ULYSSES_A2A_VOTE_TIMEOUT_S.",
        minimum=0.0,
    ),
    EnvVar(
        "FASTVIDEO_ULYSSES_A2A_VOTED_LAUNCH",
        "1",
        "`1`: a fused call over the same-host shared-memory vote exchanges its fields and launches in one kernel-"
        "library call where every rank proposed the same call (the verdict's one RUN case); `0`: the vote, the "
        "Python verdict, then the launch. Rank-local (both are the same exchange and verdict), read when the helper "
        "is built.",
        choices=("0", "1"),
    ),
    EnvVar(
        "FASTVIDEO_ULYSSES_A2A_HOT_PATH",
        "1",
        "`1`: where the voted launch is one kernel-library call and the hot-path extension is built for this torch "
        "(`fastvideo-kernel/build_hot.py`), the later eager calls of a signature already launched fused make their "
        "host path to the launch in one native call; `0`: every call takes the Python path. Rank-local (both make "
        "the same proposal, vote and verdict), read when the helper is built.",
        choices=("0", "1"),
    ),
    EnvVar(
        "FASTVIDEO_KERNEL_LIBRARY",
        "",
        "Path of a separately built fastvideo-kernel communication library to load instead of the "
        "installed wheel's (development validation).",
    ),
    EnvVar(
        "FASTVIDEO_ULYSSES_A2A_OVERLAP",
        0,
        "Head groups `DistributedAttention` pipelines its all-to-alls over (each group's exchanges in flight on the "
        "communication stream under its neighbours' attention; the same output: docs/overlap.md): `0` or `1` off "
        "(default), `N` groups (capped at its heads); a layer's `overlap_chunks` wins. Agreed across the SP group.",
        minimum=0,
        agreed=True,
    ),
)}


def get(name: str) -> Any:
    """Current value of ``name`` (read from the environment now): parsed and validated for this package's
    variables, parsed as upstream parses it for upstream's."""
    var = _REGISTRY.get(name)
    if var is not None:
        return var.parse(os.environ.get(name))
    reader = environment_variables.get(name)
    if reader is None:
        raise KeyError(_unknown(name))
    return reader()


def env_or_default(name: str) -> Any:
    """The current value of this package's variable ``name``, or its default when invalid: for reads that must
    not raise on one rank alone (a collective exchange then reports the invalid value on every rank)."""
    try:
        return get(name)
    except ValueError:
        return _REGISTRY[name].default


# ------------------------------------------------------------------------------------------- upstream's variables


# name -> reader of its value now: upstream's meaning (what Ray copies to its workers), upstream's variables in
# upstream's order, then this package's. Readers added here are answered by ``envs.NAME`` too, as upstream's.
environment_variables: dict[str, Callable[[], Any]] = {name: functools.partial(read or get, name)
                                                       for name, read, _ in _UPSTREAM}
environment_variables |= {name: functools.partial(get, name) for name in _REGISTRY if name not in environment_variables}


def upstream_names() -> tuple[str, ...]:
    """Upstream FastVideo 0.2.1's variable names, in its order (``FASTVIDEO_ULYSSES_A2A`` among them)."""
    return tuple(name for name, _, _ in _UPSTREAM)


def describe(name: str) -> str:
    """The one-line description of any FastVideo variable (upstream's or this package's)."""
    docs = {upstream_name: doc for upstream_name, _, doc in _UPSTREAM} | {n: var.doc for n, var in _REGISTRY.items()}
    if name not in docs:
        raise KeyError(_unknown(name))
    return docs[name]


def _unknown(name: str) -> str:
    return (f"{name} is not a FastVideo environment variable; known: this package's {', '.join(_REGISTRY)}, and "
            "upstream FastVideo's (envs.environment_variables)")



def registry() -> dict[str, EnvVar]:
    """This package's typed variables, by name (upstream's are ``environment_variables``)."""
    return dict(_REGISTRY)


def agreed_names() -> tuple[str, ...]:
    """The variables every rank of an SP group must set identically (``EnvVar.agreed``), in registry order."""
    return tuple(name for name, var in _REGISTRY.items() if var.agreed)


def raw(names: tuple[str, ...]) -> tuple[str | None, ...]:
    """The unparsed strings of ``names`` (None when unset): for cheap change detection, never for decisions."""
    return tuple(map(os.environ.get, names))


# What a settings agreement records of its variables, to name a later change: equal snapshots, unchanged values.
snapshot = raw


def read_all() -> tuple[dict[str, Any], list[str]]:
    """Every one of this package's typed variables parsed now: ``(values, errors)``. Never raises.

    An invalid value is left out of ``values`` and its error (naming the variable, the value and the
    choices) is in ``errors``, so callers can exchange errors across ranks before raising together.
    Upstream's variables are not read: upstream parses them where they are used, and so does this module.
    """
    values: dict[str, Any] = {}
    errors: list[str] = []
    for name, var in _REGISTRY.items():
        try:
            values[name] = var.parse(os.environ.get(name))
        except ValueError as exc:
            errors.append(str(exc))
    return values, errors


@contextlib.contextmanager
def override(**values: str | None) -> Iterator[None]:
    """Temporarily set (or with ``None`` unset) variables; restores the previous environment on exit."""
    for name in values:
        if name not in environment_variables:  # this package's variables are among them
            raise KeyError(_unknown(name))
    saved = {name: os.environ.get(name) for name in values}
    try:
        _set_environ(values)
        yield
    finally:
        _set_environ(saved)


def _set_environ(values: dict[str, str | None]) -> None:
    """Set each variable of ``values`` in this process's environment, unsetting the ``None`` ones."""
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


# ---------------------------------------------------------------------------------------- module attributes


ASSIGNMENT_HELP = (
    "Set {name} in the environment before the SP groups are initialised (initialize_sequence_parallel, or "
    "maybe_init_distributed_environment_and_model_parallel), where every rank's value is validated and agreed; "
    "or change it on every rank with `with envs.override({name}=...):` and then call "
    "fastvideo.distributed.parallel_state.agree_ulysses_settings() (collective) inside the block."
)


class _EnvsModule(types.ModuleType):
    """This module, with upstream FastVideo's attribute access: ``envs.NAME`` is ``environment_variables[NAME]()``,
    read now, with ``.override``; assigning or deleting one of this package's variables raises (see the module
    docstring)."""

    def __getattr__(self, name: str) -> Any:  # only for names the module itself does not define
        reader = environment_variables.get(name)
        if reader is not None:
            return _upstream_envs.with_override(name, reader(), override)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}; the FastVideo environment variables "
                             f"are this package's {', '.join(_REGISTRY)} and upstream's {', '.join(upstream_names())}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _REGISTRY:
            raise AttributeError(f"envs.{name} cannot be assigned: it is read from the environment, and assigning "
                                 "the attribute would change nothing the SP group agreed on. "
                                 + ASSIGNMENT_HELP.format(name=name))
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        if name in _REGISTRY:
            raise AttributeError(f"envs.{name} cannot be deleted. " + ASSIGNMENT_HELP.format(name=name))
        super().__delattr__(name)

    def __dir__(self) -> list[str]:
        return sorted({*super().__dir__(), *environment_variables})


sys.modules[__name__].__class__ = _EnvsModule
