"""Upstream FastVideo 0.2.1's environment variables: their names, parsers and defaults, reimplemented (upstream
reads each with a lambda of ``os.environ``; these are the same readings as functions of the name), and the values
``envs.NAME`` returns: each with upstream's ``.override(value)``. ``fastvideo.envs`` serves them beside this
package's typed settings; nothing else imports this module.

``.override(value)`` sets the variable in this process for the block (``None`` unsets it, a bool is ``1`` / ``0``)
and restores it on exit, also on an exception (``envs.override``). The value is a ``str``, ``int``, ``float`` or,
for a bool (which Python cannot subclass), an ``int`` that prints as ``True`` / ``False``; pickled or copied it is
the plain value. None (unset, no default) has no ``.override``: use ``envs.override(NAME=...)``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any


def get_default_cache_root() -> str:
    """``$XDG_CACHE_HOME``, else ``~/.cache`` (upstream's helper of the same name)."""
    return os.getenv("XDG_CACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache"))


def get_default_config_root() -> str:
    """``$XDG_CONFIG_HOME``, else ``~/.config`` (upstream's helper of the same name)."""
    return os.getenv("XDG_CONFIG_HOME", os.path.join(os.path.expanduser("~"), ".config"))


def maybe_convert_int(value: str | None) -> int | None:
    """``int(value)``, or None for None (upstream's helper of the same name)."""
    return None if value is None else int(value)


# Upstream's parsers, as functions of the variable's name. Each reproduces upstream's reading exactly: an empty
# value is a value (not "unset"), nothing is stripped, and a value a cast refuses raises its ValueError.
Reader = Callable[[str], Any]


def _text(default: str | None = None) -> Reader:
    """The raw string, ``default`` when unset."""
    return lambda name: os.environ.get(name, default)


def _number(cast: Callable[[str], Any], default: str) -> Reader:
    """``cast`` of the raw string (``default`` when unset)."""
    return lambda name: cast(os.environ.get(name, default))


def _not_zero(default: str = "0") -> Reader:
    """True unless the raw string (``default`` when unset) is exactly ``"0"`` (so ``""`` and ``"false"`` are True)."""
    return lambda name: os.environ.get(name, default) != "0"


_int_flag = _number(lambda value: bool(int(value)), "0")  # ``bool(int(raw))``, False when unset


def _under(root: Callable[[], str]) -> Reader:
    """The raw path (``root()/fastvideo`` when unset), ``~`` expanded."""
    return lambda name: os.path.expanduser(os.environ.get(name, os.path.join(root(), "fastvideo")))


def _optional_path(name: str) -> str | None:
    """The raw path with ``~`` expanded, None when unset."""
    value = os.environ.get(name)
    return None if value is None else os.path.expanduser(value)


def _precompiled(name: str) -> bool:
    """Set (non-empty), or a precompiled wheel's location is."""
    return bool(os.environ.get(name)) or bool(os.environ.get("FASTVIDEO_PRECOMPILED_WHEEL_LOCATION"))


# Upstream FastVideo 0.2.1's variables in its order: (name, parser, what it controls). The Ulysses route's parser
# is None: it is this package's typed setting (``fastvideo.envs``).
VARIABLES: tuple[tuple[str, Reader | None, str], ...] = (
    ("FASTVIDEO_TARGET_DEVICE", _text("cuda"), "Device family the install targets."),
    ("MAX_JOBS", _text(), "Parallel compile jobs for source builds (None: one per CPU)."),
    ("NVCC_THREADS", _text(), "nvcc threads per compile job for source builds."),
    ("FASTVIDEO_USE_PRECOMPILED", _precompiled,
     "Install precompiled binaries (also true when FASTVIDEO_PRECOMPILED_WHEEL_LOCATION is set)."),
    ("CMAKE_BUILD_TYPE", _text(), "CMake build type of source builds (Debug, Release, RelWithDebInfo)."),
    ("VERBOSE", _int_flag, "Verbose install logs (an integer, 0 off)."),
    ("FASTVIDEO_CONFIG_ROOT", _under(get_default_config_root), "Configuration directory."),
    ("FASTVIDEO_CACHE_ROOT", _under(get_default_cache_root), "Cache directory."),
    ("FASTVIDEO_HOST_IP", _text(""), "This node's IP address for distributed set-up (multi-NIC hosts)."),
    ("FASTVIDEO_LOOPBACK_IP", _text(""), "Forces the loopback IP address."),
    ("FASTVIDEO_RAY_PER_WORKER_GPUS", _number(float, "1.0"), "GPUs per Ray worker (a fraction co-locates actors)."),
    ("FASTVIDEO_RINGBUFFER_WARNING_INTERVAL", _number(int, "60"), "Seconds between full-ring-buffer warnings."),
    ("FASTVIDEO_NCCL_SO_PATH", _text(), "Path of the NCCL library to load."),
    ("LD_LIBRARY_PATH", _text(), "Where the NCCL library is searched when FASTVIDEO_NCCL_SO_PATH is unset."),
    ("FASTVIDEO_TEST_DYNAMO_FULLGRAPH_CAPTURE", _not_zero("1"), "Dynamo full-graph capture in tests (internal)."),
    ("LOCAL_RANK", _number(int, "0"), "torchrun's local rank: the GPU index of this process."),
    ("CUDA_VISIBLE_DEVICES", _text(), "CUDA's visible devices."),
    ("FASTVIDEO_ENGINE_ITERATION_TIMEOUT_S", _number(int, "60"), "Seconds one engine iteration may take."),
    ("FASTVIDEO_CONFIGURE_LOGGING", _number(int, "1"),
     "1: FastVideo configures logging (FASTVIDEO_LOGGING_CONFIG_PATH or its default); 0: it leaves logging alone."),
    ("FASTVIDEO_LOGGING_CONFIG_PATH", _text(), "A logging configuration file (JSON dictConfig)."),
    ("FASTVIDEO_LOGGING_LEVEL", _text("INFO"), "Default logging level."),
    ("FASTVIDEO_LOGGING_PREFIX", _text(""), "Prefix of every log message."),
    ("FASTVIDEO_TRACE_FUNCTION", _number(int, "0"), "1: trace function calls (debugging)."),
    ("FASTVIDEO_ATTENTION_BACKEND", _text(),
     "Attention backend override (TORCH_SDPA, FLASH_ATTN, VIDEO_SPARSE_ATTN, SAGE_ATTN, ...); None: the platform's."),
    ("FASTVIDEO_FA4", _not_zero(), "FLASH_ATTN runs FlashAttention-4 (opt-in)."),
    ("FASTVIDEO_MINIMAX_H3_FA4_PACKED_VARLEN", _not_zero(),
     "MiniMax-H3 self-attention through FA4's packed-varlen entry (inference, changes reduction order)."),
    ("FASTVIDEO_INFERENCE_TORCH_COMPILE", _not_zero(), "Regional torch.compile of the DiT at inference."),
    ("FASTVIDEO_VAE_PARALLEL_DECODE", _not_zero(), "MiniMax-H3 VAE decode spread over the SP ranks."),
    ("FASTVIDEO_VAE_PARALLEL_ENCODE", _not_zero(), "MiniMax-H3 reference-video encode spread over the SP ranks."),
    ("FASTVIDEO_VAE_PARALLEL_DECODE_STRATEGY", _text(), "Collective of the parallel VAE: gather or all_gather."),
    ("FASTVIDEO_MINIMAX_H3_FUSIONS", _text(""), "MiniMax-H3 inference Triton fusions: all, 1, or a comma list."),
    ("FASTVIDEO_ULYSSES_A2A", None, "Ulysses all-to-all transport (this package's parsing: see the registry)."),
    ("FASTVIDEO_WORKER_MULTIPROC_METHOD", _text("spawn"), "Start method of worker processes."),
    ("FASTVIDEO_NVTX_PROFILE", _not_zero(), "Emit NVTX ranges for external profilers."),
    ("FASTVIDEO_TORCH_PROFILER_DIR", _optional_path, "Directory of torch profiler traces (None: profiler off)."),
    ("FASTVIDEO_TORCH_PROFILER_RECORD_SHAPES", _not_zero(), "torch profiler records shapes."),
    ("FASTVIDEO_TORCH_PROFILER_WITH_PROFILE_MEMORY", _not_zero(), "torch profiler profiles memory."),
    ("FASTVIDEO_TORCH_PROFILER_WITH_STACK", _not_zero(), "torch profiler captures stacks."),
    ("FASTVIDEO_TORCH_PROFILER_WITH_FLOPS", _not_zero(), "torch profiler counts flops."),
    ("FASTVIDEO_TORCH_PROFILE_REGIONS", _text(""), "Regions the torch profiler covers."),
    ("FASTVIDEO_TRACE_ACTIVATIONS", _not_zero(), "Activation trace hooks."),
    ("FASTVIDEO_TRACE_LAYERS", _text(""), "Regex of the traced module names (empty: all)."),
    ("FASTVIDEO_TRACE_STATS", _text("abs_mean,sum"), "Activation statistics to trace, comma-separated."),
    ("FASTVIDEO_TRACE_OUTPUT", _text("/tmp/fv_trace_<pid>.jsonl"), "Activation trace file (<pid> replaced)."),
    ("FASTVIDEO_TRACE_STEPS", _text(""), "Denoising steps to trace, comma-separated (empty: all)."),
    ("FASTVIDEO_SERVER_DEV_MODE", _int_flag, "Server development endpoints (an integer, 0 off)."),
    ("FASTVIDEO_STAGE_LOGGING", _int_flag, "Log each pipeline stage's time (an integer, 0 off)."),
    ("FASTVIDEO_CFG_GATE_STEP", _number(float, "1.0"),
     "Fraction of denoising steps that run the unconditional pass (1.0: every step, exact CFG)."),
)


# ------------------------------------------------------------------------------------- the values envs.NAME returns


class _Overridable:
    """What ``envs.NAME``'s values add to the plain value: upstream's ``.override(value)``."""

    name: str
    _plain: type
    _set: Callable[..., AbstractContextManager[None]]  # envs.override

    def override(self, value: object) -> AbstractContextManager[None]:
        """Local: set this variable to ``value`` (None unsets it; a bool is 1 or 0) in this process for the block,
        restored on exit and on an exception. The SP group's agreed settings change only at a new agreement."""
        text = None if value is None else str(int(value)) if isinstance(value, bool) else str(value)
        return self._set(**{self.name: text})

    def __reduce__(self) -> tuple:  # pickled (Ray, multiprocessing) or copied: the plain value
        return self._plain, (self._plain(self),)


class EnvFlag(_Overridable, int):
    """A bool value (``bool`` cannot be subclassed): an int 0 or 1 that prints as ``False`` / ``True``."""

    _plain = bool

    def __repr__(self) -> str:
        return repr(bool(self))

    __str__ = __repr__


# A str, int or float value as a subclass of its type (EnvStr, EnvInt, EnvFloat); a bool as EnvFlag.
_WRAPPERS: dict[type, type] = {t: type(f"Env{t.__name__.capitalize()}", (_Overridable, t), {"_plain": t})
                               for t in (str, int, float)} | {bool: EnvFlag}


def with_override(name: str, value: Any, override: Callable[..., AbstractContextManager[None]]) -> Any:
    """``value`` (read from ``name``) with ``.override`` (by ``override``, ``envs.override``); None and values of
    other types as they are."""
    wrapper = _WRAPPERS.get(type(value))
    if wrapper is None:
        return value
    wrapped = wrapper(value)
    wrapped.name, wrapped._set = name, override
    return wrapped
