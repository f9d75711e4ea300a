"""Loader for the fastvideo-kernel native library (the Ulysses fused all-to-all, a plain C ABI).

    import fastvideo_kernel
    lib = fastvideo_kernel.load()      # ctypes.CDLL with argtypes declared; imports torch first
    fastvideo_kernel.info()            # path, sha256, ABI, entry points, NCCL build/runtime versions

``FASTVIDEO_KERNEL_LIBRARY`` points at a development build instead of the packaged one. ``load()``
imports torch before opening the library so that the ``libnccl.so.2`` torch already mapped is the
one the kernel binds to (the NCCL device API is header-inline: the runtime must be the same
major.minor as the build, and there must be exactly one copy in the process).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
from pathlib import Path

__all__ = [
    "ENTRY_SYMBOLS",
    "ENV_LIBRARY",
    "LIBRARY_NAME",
    "KernelUnavailable",
    "SimCall",
    "entry_points",
    "info",
    "last_error",
    "library_path",
    "load",
    "nccl_version_tuple",
]

LIBRARY_NAME = "libfastvideo_ulysses_a2a.so"
ENV_LIBRARY = "FASTVIDEO_KERNEL_LIBRARY"
# Entry point name (as the Python transport knows it) -> exported symbol. Older builds may lack some.
ENTRY_SYMBOLS = {
    "original": "fvk_a2a_original",
    "tuned": "fvk_a2a_tuned",
    "ce": "fvk_a2a_ce",
    "fabric": "fvk_fabric_copy",
    "capture": "fvk_a2a_captured",  # the tuned entry point for CUDA-graph capture
    "ce_capture": "fvk_a2a_ce_captured",  # the copy-engine kind for CUDA-graph capture
    "debug": "fvk_a2a_debug",
    "sim": "fvk_sim_a2a",
    "sync_check": "fvk_check_window_sync",
    "ce_sync_check": "fvk_check_ce_sync",
    "ce_addressing_check": "fvk_check_ce_addressing",
}
SIM_SKEW, SIM_EPOCH_CHECK, SIM_LEGACY_LAYOUT = 1, 2, 4  # fvk_sim_a2a flags
# fvk_check_ce_sync negative controls (ce_plan.h's CeDrop): each drops one ordering of the schedule.
CE_DROP_WAIT_COPIED, CE_DROP_ENTRY_BARRIER, CE_DROP_LANDED_BARRIER, CE_DROP_FORK, CE_DROP_JOIN = 1, 2, 4, 8, 16
# fvk_check_ce_sync model options: every call on streams of its own, ordered only through the completion event
# (a replay, a stream change); and that model's negative control, the wait on the previous call's event dropped.
CE_MODEL_STREAM_PER_CALL, CE_DROP_DONE_WAIT = 32, 64
# An SM-kind call in fvk_check_ce_sync's call list, and the negative control of its entry barrier.
CE_SM_CALL, CE_DROP_SM_ENTRY_BARRIER = -1, 128
FABRIC_COPY_ENGINE, FABRIC_SM = 0, 1  # fvk_fabric_copy engines
CE_CHECK_SWAP_BUFFERS = 1  # fvk_check_ce_addressing negative control: copy-outs read the other buffer
DEBUG_EPOCH_CHECK, DEBUG_LEGACY_LAYOUT = 1, 2  # fvk_a2a_debug flags

_c_int_p = ctypes.POINTER(ctypes.c_int)


class SimCall(ctypes.Structure):
    """``fvk_sim_call``: one call of a simulated sequence (ulysses_a2a.h)."""

    _fields_ = [("mode", ctypes.c_int), ("dtype", ctypes.c_int), ("ctas", ctypes.c_int), ("reserved", ctypes.c_int),
                ("B", ctypes.c_int64), ("S", ctypes.c_int64), ("H", ctypes.c_int64), ("D", ctypes.c_int64),
                ("planes_per_chunk", ctypes.c_int64), ("rows_per_chunk", ctypes.c_int64),
                ("x", ctypes.c_void_p * 8), ("out", ctypes.c_void_p * 8)]


_VOIDP = ctypes.c_void_p
_I64 = ctypes.c_int64
# Every exported function and its ctypes signature; all return an int status except fvk_last_error.
_SIGNATURES: dict[str, tuple[type, list]] = {
    "fvk_abi_version": (ctypes.c_int, []),
    "fvk_nccl_build_version": (ctypes.c_int, []),
    "fvk_nccl_runtime_version": (ctypes.c_int, [_c_int_p]),
    "fvk_last_error": (ctypes.c_char_p, []),
    "fvk_max_ctas": (ctypes.c_int, []),
    "fvk_coresident_ctas": (ctypes.c_int, [ctypes.c_int, _c_int_p]),
    "fvk_relax_capture_mode": (ctypes.c_int, []),
    "fvk_pci_bus_id": (ctypes.c_int, [ctypes.c_int, ctypes.c_char_p, ctypes.c_int]),
    "fvk_nvlink_p2p": (ctypes.c_int, [ctypes.c_char_p, ctypes.c_char_p, _c_int_p]),
    "fvk_unique_id_bytes": (ctypes.c_int, []),
    "fvk_get_unique_id": (ctypes.c_int, [ctypes.c_char_p, ctypes.c_size_t]),
    "fvk_create": (ctypes.c_int, [ctypes.c_int, ctypes.POINTER(_VOIDP)]),
    "fvk_comm_init": (ctypes.c_int, [_VOIDP, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int]),
    "fvk_window_alloc": (ctypes.c_int, [_VOIDP, ctypes.c_size_t]),
    "fvk_window_register": (ctypes.c_int, [_VOIDP]),
    "fvk_devcomm_create": (ctypes.c_int, [_VOIDP]),
    "fvk_lsa_info": (ctypes.c_int, [_VOIDP, _c_int_p, _c_int_p, _c_int_p, _c_int_p]),
    "fvk_a2a_original": (ctypes.c_int, [_VOIDP, _VOIDP, _VOIDP, ctypes.c_int, ctypes.c_int, _I64, _I64, _I64, _I64,
                                        _VOIDP]),
    "fvk_a2a_tuned": (ctypes.c_int, [_VOIDP, _VOIDP, _VOIDP, ctypes.c_int, ctypes.c_int, _I64, _I64, _I64, _I64,
                                     ctypes.c_int, _I64, _I64, _VOIDP]),
    "fvk_a2a_ce": (ctypes.c_int, [_VOIDP, _VOIDP, _VOIDP, ctypes.c_int, ctypes.c_int, _I64, _I64, _I64, _I64,
                                  ctypes.c_int, _I64, _I64, _VOIDP]),
    "fvk_fabric_copy": (ctypes.c_int, [_VOIDP, _I64, ctypes.c_int, ctypes.c_int, _VOIDP]),
    "fvk_check_ce_sync": (ctypes.c_int, [ctypes.c_int, ctypes.c_int, ctypes.POINTER(_I64), ctypes.c_uint,
                                         ctypes.POINTER(_I64), ctypes.c_char_p, ctypes.c_int]),
    "fvk_a2a_captured": (ctypes.c_int, [_VOIDP, _VOIDP, _VOIDP, ctypes.c_int, ctypes.c_int, _I64, _I64, _I64, _I64,
                                        ctypes.c_int, _I64, _I64, _VOIDP]),
    "fvk_a2a_ce_captured": (ctypes.c_int, [_VOIDP, _VOIDP, _VOIDP, ctypes.c_int, ctypes.c_int, _I64, _I64, _I64,
                                           _I64, ctypes.c_int, _I64, _I64, _VOIDP]),
    "fvk_check_ce_addressing": (ctypes.c_int, [ctypes.c_int, ctypes.c_int, ctypes.c_int, _I64, _I64, _I64, _I64, _I64,
                                               _I64, ctypes.c_uint, ctypes.POINTER(_I64), ctypes.c_char_p,
                                               ctypes.c_int]),
    "fvk_a2a_debug": (ctypes.c_int, [_VOIDP, _VOIDP, _VOIDP, ctypes.c_int, ctypes.c_int, _I64, _I64, _I64, _I64,
                                     ctypes.c_int, _I64, _I64, ctypes.c_uint, _VOIDP, _VOIDP]),
    "fvk_sim_a2a": (ctypes.c_int, [ctypes.c_int, ctypes.c_int, ctypes.POINTER(SimCall), ctypes.POINTER(_VOIDP),
                                   ctypes.c_size_t, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint64,
                                   ctypes.POINTER(ctypes.c_uint64), _VOIDP]),
    "fvk_check_window_sync": (ctypes.c_int, [ctypes.c_int, ctypes.c_int, ctypes.POINTER(_I64), ctypes.c_size_t,
                                             ctypes.c_int, ctypes.c_int, ctypes.POINTER(_I64), ctypes.c_char_p,
                                             ctypes.c_int]),
    "fvk_destroy": (ctypes.c_int, [_VOIDP]),
    "fvk_abort": (ctypes.c_int, [_VOIDP]),
    # The same-host shared-memory vote (shm_vote.cpp); absent from older builds.
    "fvk_vote_open": (ctypes.c_int, [ctypes.c_char_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                     ctypes.POINTER(_VOIDP)]),
    "fvk_vote_exchange": (ctypes.c_int, [_VOIDP, _VOIDP, _VOIDP, _I64]),
    "fvk_vote_unlink": (ctypes.c_int, [_VOIDP]),
    "fvk_vote_close": (ctypes.c_int, [_VOIDP, ctypes.c_int]),
    # The vote and the launch in one call (ulysses_a2a.cu); absent from older builds.
    "fvk_vote_would_run": (ctypes.c_int, [ctypes.POINTER(_I64), ctypes.c_int, ctypes.POINTER(_I64)]),
    "fvk_voted_launch": (ctypes.c_int, [_VOIDP, _VOIDP, _VOIDP, _I64, ctypes.POINTER(ctypes.c_int),
                                        ctypes.POINTER(_I64), _VOIDP, ctypes.c_int, _VOIDP, _VOIDP, ctypes.c_int,
                                        ctypes.c_int, _I64, _I64, _I64, _I64, ctypes.c_int, _I64, _I64, _VOIDP]),
}

# ABI 1 exported fvk_sim_a2a with another signature (launch-separated phases): never drive it.
_CHANGED_IN_ABI2 = frozenset({"fvk_sim_a2a"})

_LOADED: dict[str, ctypes.CDLL] = {}


class KernelUnavailable(RuntimeError):
    """The native library is missing or cannot be loaded; the message says which path and why."""


def library_path() -> Path:
    """``$FASTVIDEO_KERNEL_LIBRARY`` if set, else the library packaged in this wheel."""
    override = os.environ.get(ENV_LIBRARY)
    if override:
        return Path(override)
    return Path(__file__).resolve().parent / "lib" / LIBRARY_NAME


def load() -> ctypes.CDLL:
    """Open the library (once per path) with every present function's signature declared.

    Raises ``KernelUnavailable`` when the file is missing or the dynamic loader rejects it.
    """
    path = library_path()
    key = str(path)
    if key in _LOADED:
        return _LOADED[key]
    if not path.is_file():
        source = f"${ENV_LIBRARY}" if os.environ.get(ENV_LIBRARY) else "the fastvideo-kernel wheel"
        raise KernelUnavailable(f"no kernel library at {path} (from {source}); build it with "
                                "`pip install --no-build-isolation --no-deps ./fastvideo-kernel`")
    import torch  # noqa: F401  - maps torch's libnccl.so.2 first, so the kernel binds to that copy

    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise KernelUnavailable(f"cannot load kernel library {path}: {exc}") from exc
    if not hasattr(lib, "fvk_abi_version") or not hasattr(lib, "fvk_last_error"):
        raise KernelUnavailable(f"{path} is not a fastvideo-kernel library (no fvk_abi_version/fvk_last_error)")
    lib.fvk_abi_version.restype, lib.fvk_abi_version.argtypes = ctypes.c_int, []
    abi = lib.fvk_abi_version()
    for name, (restype, argtypes) in _SIGNATURES.items():
        if hasattr(lib, name) and not (name in _CHANGED_IN_ABI2 and abi < 2):
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes
    _LOADED[key] = lib
    return lib


def entry_points(lib: ctypes.CDLL) -> frozenset[str]:
    """The entry points this build exports (the keys of ``ENTRY_SYMBOLS`` whose symbol it has: ``original``,
    ``tuned``, ``ce``, ``fabric``, ``capture``, ``ce_capture``, ``debug``, ``sim``, ``sync_check``,
    ``ce_sync_check``, ``ce_addressing_check``)."""
    abi = lib.fvk_abi_version()
    return frozenset(name for name, symbol in ENTRY_SYMBOLS.items()
                     if hasattr(lib, symbol) and not (symbol in _CHANGED_IN_ABI2 and abi < 2))


def nccl_version_tuple(code: int) -> tuple[int, int, int]:
    """NCCL_VERSION_CODE -> (major, minor, patch); 22809 -> (2, 28, 9)."""
    if code >= 10000:  # NCCL >= 2.9: major * 10000 + minor * 100 + patch
        return code // 10000, code // 100 % 100, code % 100
    return code // 1000, code // 100 % 10, code % 100


def last_error(lib: ctypes.CDLL) -> str:
    return (lib.fvk_last_error() or b"").decode(errors="replace")


def info() -> dict:
    """Identity of the library that would be used: path, sha256, ABI, entry points, NCCL versions.

    Never raises for a missing library: ``error`` says why it is unavailable.
    """
    path = library_path()
    result: dict = {"path": str(path), "exists": path.is_file()}
    if path.is_file():
        result["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    try:
        lib = load()
    except KernelUnavailable as exc:
        result["error"] = str(exc)
        return result
    result["abi_version"] = lib.fvk_abi_version()
    result["entry_points"] = sorted(entry_points(lib))
    result["nccl_build"] = lib.fvk_nccl_build_version()
    runtime = ctypes.c_int(0)
    if lib.fvk_nccl_runtime_version(ctypes.byref(runtime)) == 0:
        result["nccl_runtime"] = runtime.value
    else:
        result["nccl_runtime_error"] = last_error(lib)
    result["max_ctas"] = lib.fvk_max_ctas()
    return result
