"""Loader for the test library (``libfastvideo_ulysses_a2a_testing.so``, csrc/ulysses_a2a/testing/).

The test library is the product library's sources plus the test and measurement code the product library
does not contain: the epoch-checked SM launch (``fvk_launch`` with ``CALL_DEBUG``), P simulated ranks on one
GPU (``fvk_sim_a2a``), the host property checks (``fvk_check_window_sync``, ``fvk_check_ce_sync``,
``fvk_check_addressing``; no GPU, each taking ``fastvideo_kernel.Call`` descriptions) and the benchmark's fabric
copy (``fvk_fabric_copy``). It exports the product ABI too, so a communicator built through it serves product
launches and test launches alike: a gate or a benchmark that needs the test launches points
``FASTVIDEO_KERNEL_LIBRARY`` at it. The wheel ships only the product library;
``python fastvideo-kernel/build_lib.py --out DIR --testing`` (or ``scripts/build_kernel.sh``) builds both.

    from fastvideo_kernel import testing
    lib = testing.load()   # the product and the test signatures declared
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

from fastvideo_kernel import ENV_LIBRARY, SIGNATURES, Call, KernelUnavailable, describe, library_path, open_library

__all__ = [
    "ENV_TESTING_LIBRARY",
    "TESTING_ABI_VERSION",
    "TESTING_LIBRARY_NAME",
    "SimCall",
    "info",
    "is_testing_library",
    "load",
    "testing_library_path",
]

TESTING_LIBRARY_NAME = "libfastvideo_ulysses_a2a_testing.so"
ENV_TESTING_LIBRARY = "FASTVIDEO_KERNEL_TESTING_LIBRARY"
TESTING_ABI_VERSION = 2  # testing/ulysses_a2a_testing.h's FVK_TESTING_ABI_VERSION

SIM_SKEW, SIM_EPOCH_CHECK, SIM_MOVING_LAYOUT = 1, 2, 4  # fvk_sim_a2a flags
# The host checks' and the simulation's layouts (FVK_LAYOUT_*): the kernels', the pre-fix one (regions that move
# with the block size) and the even-only one (the split tables ignored), the last two negative controls.
LAYOUT_STATIC, LAYOUT_MOVING, LAYOUT_EVEN_ONLY = 0, 1, 2
# fvk_check_window_sync: the kernel's barrier schedule and the negative controls without one of its barriers.
SYNC_NO_FIRST_ENTRY, SYNC_KERNEL, SYNC_NO_ENTRY, SYNC_NO_MIDDLE = 0, 1, 2, 3
# fvk_check_ce_sync negative controls (ce_plan.h's CeDrop): each drops one ordering of the schedule.
CE_DROP_WAIT_COPIED, CE_DROP_ENTRY_BARRIER, CE_DROP_LANDED_BARRIER, CE_DROP_FORK, CE_DROP_JOIN = 1, 2, 4, 8, 16
# fvk_check_ce_sync model options: every call on streams of its own, ordered only through the completion event
# (a replay, a stream change); and that model's negative control, the wait on the previous call's event dropped.
CE_MODEL_STREAM_PER_CALL, CE_DROP_DONE_WAIT = 32, 64
# The negative control of an SM-kind call's entry barrier, among copy-engine calls (fvk_check_ce_sync).
CE_DROP_SM_ENTRY_BARRIER = 128
CE_CHECK_SWAP_BUFFERS = 1  # fvk_check_addressing negative control: copy-outs read the other buffer
FABRIC_COPY_ENGINE, FABRIC_SM = 0, 1  # fvk_fabric_copy engines

_VOIDP, _I64, _INT, _UINT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_uint
_I64_P = ctypes.POINTER(_I64)


_CALL_P = ctypes.POINTER(Call)


class SimCall(ctypes.Structure):
    """``fvk_sim_call``: one call of a simulated sequence (testing/ulysses_a2a_testing.h): its description and
    every simulated rank's input and output."""

    _fields_ = [("call", Call), ("x", _VOIDP * 8), ("out", _VOIDP * 8)]


# Every function testing/ulysses_a2a_testing.h exports and its ctypes signature (checked against the header,
# both ways, by tests/kernel/test_abi_table.py); the test library exports fastvideo_kernel.SIGNATURES too.
TESTING_SIGNATURES: dict[str, tuple[type | None, list]] = {
    "fvk_testing_abi_version": (_INT, []),
    "fvk_sim_a2a": (_INT, [_INT, _INT, ctypes.POINTER(SimCall), ctypes.POINTER(_VOIDP), ctypes.c_size_t, _UINT,
                           _UINT, ctypes.c_uint64, ctypes.POINTER(ctypes.c_uint64), _VOIDP]),
    "fvk_check_window_sync": (_INT, [_INT, _INT, _CALL_P, ctypes.c_size_t, _INT, _INT, _I64_P, ctypes.c_char_p,
                                     _INT]),
    "fvk_check_ce_sync": (_INT, [_INT, _INT, _CALL_P, _INT, _UINT, _I64_P, ctypes.c_char_p, _INT]),
    "fvk_check_addressing": (_INT, [_INT, _CALL_P, _INT, _UINT, _I64_P, ctypes.c_char_p, _INT]),
    "fvk_fabric_copy": (_INT, [_VOIDP, _I64, _INT, _INT, _VOIDP]),
}


def testing_library_path() -> Path:
    """``$FASTVIDEO_KERNEL_TESTING_LIBRARY`` if set; else ``$FASTVIDEO_KERNEL_LIBRARY`` when it names a test
    library; else the test library beside the product library (a build directory holds both)."""
    override = os.environ.get(ENV_TESTING_LIBRARY)
    if override:
        return Path(override)
    product = library_path()
    return product if product.name == TESTING_LIBRARY_NAME else product.with_name(TESTING_LIBRARY_NAME)


def load() -> ctypes.CDLL:
    """Open the test library (``testing_library_path()``, once per path) with the product's and its own
    signatures declared. Raises ``KernelUnavailable`` when it is missing, cannot be loaded, or is not a test
    library of this loader's version."""
    lib = open_library(testing_library_path(), {**SIGNATURES, **TESTING_SIGNATURES},
                       f"build it with `python fastvideo-kernel/build_lib.py --out DIR --testing` (or "
                       f"scripts/build_kernel.sh), then set ${ENV_TESTING_LIBRARY} or ${ENV_LIBRARY} to it")
    if not is_testing_library(lib):
        raise KernelUnavailable(f"{testing_library_path()} is not a test library of testing ABI "
                                f"{TESTING_ABI_VERSION} (fvk_testing_abi_version)")
    return lib


def is_testing_library(lib) -> bool:
    """Whether ``lib`` is a test library this loader drives (so it offers the epoch-checked launch, the
    simulation, the host checks and the fabric copy besides the product ABI)."""
    return hasattr(lib, "fvk_testing_abi_version") and lib.fvk_testing_abi_version() == TESTING_ABI_VERSION


def info() -> dict:
    """Identity of the test library that would be used (as ``fastvideo_kernel.info`` for the product one)."""
    return describe(testing_library_path(), load)
