"""Loader for the fastvideo-kernel native library (the Ulysses fused all-to-all, a plain C ABI).

    import fastvideo_kernel
    lib = fastvideo_kernel.load()      # ctypes.CDLL with argtypes declared, probed once; imports torch first
    fastvideo_kernel.probe(lib)        # Probe(abi, offerings, problem): what this build offers, from its ABI
    fastvideo_kernel.info()            # path, sha256, ABI, offerings, NCCL build/runtime versions

``FASTVIDEO_KERNEL_LIBRARY`` points at a development build instead of the packaged one. ``load()``
imports torch before opening the library so that the ``libnccl.so.2`` torch already mapped is the
one the kernel binds to (the NCCL device API is header-inline: the runtime must be the same
major.minor as the build, and there must be exactly one copy in the process).

What a build offers follows from its ABI version alone (``OFFERINGS``), checked once at load against the
symbols it exports (``probe``); callers ask the probe, never the symbols. The test library
(``libfastvideo_ulysses_a2a_testing.so``: the product plus the simulated ranks, the host checks, the
epoch-checked launch and the fabric copy) has its own loader, ``fastvideo_kernel.testing``.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
from pathlib import Path
from typing import NamedTuple

__all__ = [
    "ABI_VERSION",
    "CALL_CAPTURE",
    "CALL_DEBUG",
    "CALL_DEBUG_MOVING_LAYOUT",
    "CAPTURE",
    "CE",
    "CE_CAPTURE",
    "ENV_LIBRARY",
    "KIND_CE",
    "KIND_SM",
    "LAUNCH",
    "LIBRARY_NAME",
    "LIFECYCLE",
    "NEEDS",
    "OFFERINGS",
    "OLDEST_ABI",
    "ORIGINAL",
    "RELAX_CAPTURE",
    "SIGNATURES",
    "STAGE_EXCHANGE_FAILED",
    "STAGE_LAUNCHED",
    "STAGE_NOT_LAUNCHED",
    "STAGE_REFUSED",
    "TUNED",
    "UNEVEN",
    "VOTE",
    "VOTED",
    "VOTE_SYMBOLS",
    "Call",
    "KernelUnavailable",
    "Probe",
    "Vote",
    "describe",
    "info",
    "last_error",
    "library_path",
    "load",
    "nccl_version_tuple",
    "open_library",
    "probe",
    "split_table",
]

LIBRARY_NAME = "libfastvideo_ulysses_a2a.so"
ENV_LIBRARY = "FASTVIDEO_KERNEL_LIBRARY"

# ------------------------------------------------------------------ what a build offers, by ABI

ORIGINAL = "original"  # the 36-CTA whole-operand SM plan
TUNED = "tuned"  # SM plans of any CTA count and chunking
CE = "ce"  # the copy-engine plan kind
CAPTURE = "capture"  # SM plans captured into a CUDA graph
CE_CAPTURE = "ce_capture"  # copy-engine plans captured into a CUDA graph
UNEVEN = "uneven"  # uneven sequence and head splits (fvk_call's split tables), both plan kinds
LAUNCH = "launch"  # the one launch entry, fvk_launch, with its call description (fvk_call)
VOTE = "vote"  # the same-host shared-memory vote (fvk_vote_*)
VOTED = "voted"  # the vote and the launch in one call (fvk_launch with an fvk_vote)
RELAX_CAPTURE = "relax_capture"  # fvk_relax_capture_mode, for the helper's watchdog thread

ABI_VERSION = 5  # the newest ABI this loader knows (ulysses_a2a.h's FVK_ABI_VERSION)
# ABI 1 (before 2026-11-29) laid chunks out in the window at the current chunk's stride: wrong data whenever a
# plan's chunks differ in size (found on 2x H200). Such a build must never run.
OLDEST_ABI = 2
# ABI -> what this code drives in a build of it. Builds older than ABI 4 are driven only through
# fvk_a2a_original (upstream's contract: an older wheel keeps the original 36-CTA path); their other launch
# entries had per-entry signatures that ABI 4's one entry replaced.
OFFERINGS: dict[int, frozenset[str]] = {
    2: frozenset({ORIGINAL, VOTE}),
    3: frozenset({ORIGINAL, VOTE, RELAX_CAPTURE}),
    4: frozenset({ORIGINAL, TUNED, CE, CAPTURE, CE_CAPTURE, LAUNCH, VOTE, VOTED, RELAX_CAPTURE}),
    5: frozenset({ORIGINAL, TUNED, CE, CAPTURE, CE_CAPTURE, UNEVEN, LAUNCH, VOTE, VOTED, RELAX_CAPTURE}),
}
# The functions every supported build exports (identity, topology, construction, teardown), and those each
# offering needs on top.
LIFECYCLE = ("fvk_abi_version", "fvk_nccl_build_version", "fvk_nccl_runtime_version", "fvk_last_error",
             "fvk_max_ctas", "fvk_coresident_ctas", "fvk_pci_bus_id", "fvk_nvlink_p2p", "fvk_unique_id_bytes",
             "fvk_get_unique_id", "fvk_create", "fvk_comm_init", "fvk_window_alloc", "fvk_window_register",
             "fvk_devcomm_create", "fvk_lsa_info", "fvk_destroy", "fvk_abort")
VOTE_SYMBOLS = ("fvk_vote_open", "fvk_vote_exchange", "fvk_vote_unlink", "fvk_vote_close")
NEEDS: dict[str, tuple[str, ...]] = {
    ORIGINAL: ("fvk_a2a_original",),
    TUNED: ("fvk_launch",),
    CE: ("fvk_launch",),
    CAPTURE: ("fvk_launch",),
    CE_CAPTURE: ("fvk_launch",),
    UNEVEN: ("fvk_launch",),
    LAUNCH: ("fvk_launch",),
    VOTE: VOTE_SYMBOLS,
    VOTED: ("fvk_launch", "fvk_vote_would_run", *VOTE_SYMBOLS),
    RELAX_CAPTURE: ("fvk_relax_capture_mode",),
}

# ------------------------------------------------------------------ the C ABI (ulysses_a2a.h)

KIND_SM, KIND_CE = 0, 1  # fvk_call.kind
CALL_CAPTURE, CALL_DEBUG, CALL_DEBUG_MOVING_LAYOUT = 1, 2, 4  # fvk_call.flags
STAGE_REFUSED, STAGE_EXCHANGE_FAILED, STAGE_NOT_LAUNCHED, STAGE_LAUNCHED = -1, 0, 1, 2  # fvk_vote.stage

_VOIDP, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_INT_P = ctypes.POINTER(ctypes.c_int)


class Call(ctypes.Structure):
    """``fvk_call``: one call's description (plan kind, flags, geometry, split tables, plan), built once per
    signature. ``seq_split`` / ``head_split`` hold the addresses of ``split_table`` arrays (None: even); the
    caller keeps those arrays alive while the description is used."""

    _fields_ = [("size", ctypes.c_uint32), ("flags", ctypes.c_uint32), ("kind", ctypes.c_int32),
                ("mode", ctypes.c_int32), ("dtype", ctypes.c_int32), ("ctas", ctypes.c_int32),
                ("B", _I64), ("S", _I64), ("H", _I64), ("D", _I64),
                ("planes_per_chunk", _I64), ("rows_per_chunk", _I64),
                ("seq_split", _VOIDP), ("head_split", _VOIDP), ("debug_report", _VOIDP)]


def split_table(shares) -> ctypes.Array | None:
    """``shares`` (one int per rank) as an ``fvk_call`` split table (``int64_t[P]``), or None for None (the even
    split). Pass ``ctypes.addressof`` of it in the description, and keep it alive as long as the description."""
    return None if shares is None else (ctypes.c_int64 * len(shares))(*shares)


class Vote(ctypes.Structure):
    """``fvk_vote``: the voted form's vote (handle and buffers in; stage and the exchange's duration out)."""

    _fields_ = [("size", ctypes.c_uint32), ("stage", ctypes.c_int32), ("handle", _VOIDP), ("fields", _VOIDP),
                ("votes", _VOIDP), ("timeout_ns", _I64), ("vote_ns", _I64)]


# Every function ulysses_a2a.h exports and its ctypes signature (tests/kernel/test_abi_table.py checks this
# table against the header, both ways). A typed data pointer may be declared c_void_p: callers pass tensor
# addresses (``data_ptr()``), which ctypes takes as they are only for c_void_p.
SIGNATURES: dict[str, tuple[type | None, list]] = {
    "fvk_abi_version": (_INT, []),
    "fvk_nccl_build_version": (_INT, []),
    "fvk_nccl_runtime_version": (_INT, [_INT_P]),
    "fvk_last_error": (ctypes.c_char_p, []),
    "fvk_max_ctas": (_INT, []),
    "fvk_coresident_ctas": (_INT, [_INT, _INT_P]),
    "fvk_relax_capture_mode": (_INT, []),
    "fvk_pci_bus_id": (_INT, [_INT, ctypes.c_char_p, _INT]),
    "fvk_nvlink_p2p": (_INT, [ctypes.c_char_p, ctypes.c_char_p, _INT_P]),
    "fvk_unique_id_bytes": (_INT, []),
    "fvk_get_unique_id": (_INT, [_VOIDP, ctypes.c_size_t]),
    "fvk_create": (_INT, [_INT, ctypes.POINTER(_VOIDP)]),
    "fvk_comm_init": (_INT, [_VOIDP, _VOIDP, ctypes.c_size_t, _INT, _INT]),
    "fvk_window_alloc": (_INT, [_VOIDP, ctypes.c_size_t]),
    "fvk_window_register": (_INT, [_VOIDP]),
    "fvk_devcomm_create": (_INT, [_VOIDP]),
    "fvk_lsa_info": (_INT, [_VOIDP, _INT_P, _INT_P, _INT_P, _INT_P]),
    "fvk_launch": (_INT, [_VOIDP, ctypes.POINTER(Call), _VOIDP, _VOIDP, _VOIDP, ctypes.POINTER(Vote)]),
    "fvk_a2a_original": (_INT, [_VOIDP, _VOIDP, _VOIDP, _INT, _INT, _I64, _I64, _I64, _I64, _VOIDP]),
    "fvk_destroy": (_INT, [_VOIDP]),
    "fvk_abort": (_INT, [_VOIDP]),
    "fvk_vote_open": (_INT, [ctypes.c_char_p, _INT, _INT, _INT, ctypes.POINTER(_VOIDP)]),
    "fvk_vote_exchange": (_INT, [_VOIDP, _VOIDP, _VOIDP, _I64]),
    "fvk_vote_unlink": (_INT, [_VOIDP]),
    "fvk_vote_close": (_INT, [_VOIDP, _INT]),
    "fvk_vote_would_run": (_INT, [ctypes.POINTER(_I64), _INT, ctypes.POINTER(_I64)]),
}


class KernelUnavailable(RuntimeError):
    """The native library is missing or cannot be loaded; the message says which path and why."""


class Probe(NamedTuple):
    """What a loaded build offers: its ABI, the offerings of ``OFFERINGS[abi]``, and ``problem`` ("" when the
    build is usable: its ABI is one this loader knows and it exports every function those offerings need)."""

    abi: int
    offerings: frozenset[str]
    problem: str


_LOADED: dict[str, ctypes.CDLL] = {}
_PROBES: dict[str, Probe] = {}


def library_path() -> Path:
    """``$FASTVIDEO_KERNEL_LIBRARY`` if set, else the library packaged in this wheel."""
    override = os.environ.get(ENV_LIBRARY)
    if override:
        return Path(override)
    return Path(__file__).resolve().parent / "lib" / LIBRARY_NAME


def open_library(path: Path, signatures: dict[str, tuple[type | None, list]], how_to_build: str) -> ctypes.CDLL:
    """Open ``path`` once (cached by path), declare every function of ``signatures`` it exports, and probe it.

    Raises ``KernelUnavailable`` when the file is missing or the dynamic loader rejects it."""
    key = str(path)
    if key in _LOADED:
        return _LOADED[key]
    if not path.is_file():
        raise KernelUnavailable(f"no kernel library at {path}; {how_to_build}")
    import torch  # noqa: F401  - maps torch's libnccl.so.2 first, so the kernel binds to that copy

    try:
        lib = ctypes.CDLL(key)
    except OSError as exc:
        raise KernelUnavailable(f"cannot load kernel library {path}: {exc}") from exc
    if not hasattr(lib, "fvk_abi_version") or not hasattr(lib, "fvk_last_error"):
        raise KernelUnavailable(f"{path} is not a fastvideo-kernel library (no fvk_abi_version/fvk_last_error)")
    # Every function kept its signature across the supported ABIs (a changed one got a new name), so a name the
    # table knows is declared with the table's signature whatever the build's ABI.
    for name, (restype, argtypes) in signatures.items():
        if hasattr(lib, name):
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes
    _PROBES[key] = _probe(lib)
    _LOADED[key] = lib
    return lib


def load() -> ctypes.CDLL:
    """Open the product library (``library_path()``; once per path) with its signatures declared, probed once.

    Raises ``KernelUnavailable`` when the file is missing or the dynamic loader rejects it; a build this code
    cannot drive loads, and says so in ``probe(lib).problem``."""
    # Where the variable names the library, the wheel's is not what loads: point it at a build, or unset it.
    hint = (f"it comes from ${ENV_LIBRARY}: point it at a built library (scripts/build_kernel.sh writes one), or "
            "unset it to load the installed wheel's" if os.environ.get(ENV_LIBRARY) else "it comes from the "
            "fastvideo-kernel wheel: build it with `pip install --no-build-isolation --no-deps ./fastvideo-kernel`")
    return open_library(library_path(), SIGNATURES, hint)


def _probe(lib) -> Probe:
    abi = int(lib.fvk_abi_version())
    if abi < OLDEST_ABI:
        return Probe(abi, frozenset(), f"kernel ABI {abi} is older than the oldest supported ({OLDEST_ABI}): ABI 1 "
                                       "builds move wrong data with uneven chunks; rebuild fastvideo-kernel")
    if abi not in OFFERINGS:
        return Probe(abi, frozenset(), f"kernel ABI {abi} is newer than this loader knows (up to {ABI_VERSION}): "
                                       "use the fastvideo_kernel package of the same checkout")
    offerings = OFFERINGS[abi]
    needed = set(LIFECYCLE).union(*(NEEDS[o] for o in offerings))
    missing = sorted(s for s in needed if not hasattr(lib, s))
    if missing:
        return Probe(abi, frozenset(), f"kernel ABI {abi} build lacks {missing}: a broken or foreign build, rebuild")
    return Probe(abi, offerings, "")


def probe(lib) -> Probe:
    """What ``lib`` offers (``OFFERINGS`` for its ABI, checked against its exports): the probe ``load()`` made,
    or a fresh one for a library it did not open."""
    name = getattr(lib, "_name", None)
    return _PROBES[name] if name is not None and _LOADED.get(name) is lib else _probe(lib)


def nccl_version_tuple(code: int) -> tuple[int, int, int]:
    """NCCL_VERSION_CODE -> (major, minor, patch); 22809 -> (2, 28, 9)."""
    if code >= 10000:  # NCCL >= 2.9: major * 10000 + minor * 100 + patch
        return code // 10000, code // 100 % 100, code % 100
    return code // 1000, code // 100 % 10, code % 100


def last_error(lib: ctypes.CDLL) -> str:
    return (lib.fvk_last_error() or b"").decode(errors="replace")


def describe(path: Path, lib_loader) -> dict:
    """Identity of the library at ``path`` as ``lib_loader()`` opens it: sha256, ABI, offerings, NCCL versions.
    Never raises for a missing library: ``error`` says why it is unavailable."""
    result: dict = {"path": str(path), "exists": path.is_file()}
    if path.is_file():
        result["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    try:
        lib = lib_loader()
    except KernelUnavailable as exc:
        result["error"] = str(exc)
        return result
    found = probe(lib)
    result["abi_version"] = found.abi
    result["offerings"] = sorted(found.offerings)
    if found.problem:
        result["problem"] = found.problem
        return result
    result["nccl_build"] = lib.fvk_nccl_build_version()
    runtime = ctypes.c_int(0)
    if lib.fvk_nccl_runtime_version(ctypes.byref(runtime)) == 0:
        result["nccl_runtime"] = runtime.value
    else:
        result["nccl_runtime_error"] = last_error(lib)
    result["max_ctas"] = lib.fvk_max_ctas()
    return result


def info() -> dict:
    """Identity of the product library that would be used (``describe`` of ``library_path()``)."""
    return describe(library_path(), load)
