"""The test library's launches on a ``NativeTransport``'s communicator: the epoch-checked launch (the GPU gate)
and the fabric copy (the benchmarks' fabric limit). Not product code: the product transport neither makes
nor offers them.

Both need the transport's library to be the test library (``libfastvideo_ulysses_a2a_testing.so``, which holds
the product code too): run the job with ``FASTVIDEO_KERNEL_LIBRARY`` pointing at it, so that the helper's
communicator is built through it. Otherwise they raise ``TestingUnavailable`` naming that fix, on every rank
alike (every rank runs the same library), before anything is enqueued.

    from tests.kernel.native_testing import debug_execute, fabric_copy
"""

from __future__ import annotations

import ctypes

import torch

from fastvideo.distributed.ulysses.launch import call_description
from fastvideo.distributed.ulysses.native import NativeKernelError, NativeTransport
from fastvideo.distributed.ulysses.policy import Geometry, Plan
from fastvideo.distributed.ulysses.transport import output_shape


class TestingUnavailable(RuntimeError):
    """The transport's library is not the test library (or there is no native transport)."""

    __test__ = False  # not a pytest class


def _test_library(transport, what: str):
    """(library, context handle, rank) of ``transport`` when its library is the test library, else raise."""
    if not isinstance(transport, NativeTransport):
        raise TestingUnavailable(f"{what} needs the native transport, not {type(transport).__name__}")
    import fastvideo_kernel
    from fastvideo_kernel import testing

    lib, handle, rank = transport.native_context()
    if not testing.is_testing_library(lib):
        raise TestingUnavailable(
            f"{what} is in the test library ({testing.TESTING_LIBRARY_NAME}), and this transport runs "
            f"{fastvideo_kernel.library_path()}: build it (python fastvideo-kernel/build_lib.py --out DIR --testing) "
            f"and export {fastvideo_kernel.ENV_LIBRARY}=DIR/{testing.TESTING_LIBRARY_NAME} on every rank")
    return lib, handle, rank


def _check(lib, status: int, what: str) -> None:
    if status != 0:
        import fastvideo_kernel

        raise NativeKernelError(f"{what}: {fastvideo_kernel.last_error(lib)} (status {status})")


def available(transport) -> bool:
    """Local: whether ``transport`` runs the test library (the epoch-checked launch and the fabric copy work)."""
    try:
        _test_library(transport, "the test library")
    except TestingUnavailable:
        return False
    return True


def debug_execute(transport: NativeTransport, x: torch.Tensor, geom: Geometry, plan: Plan, *,
                  moving: bool = False) -> tuple[torch.Tensor, list[int]]:
    """Collective, blocks the host (reads the report back), not capture-safe: the SM kind with the epoch checker
    (``fvk_launch`` with ``CALL_DEBUG``) on the transport's communicator, bypassing the vote (every rank must
    call it with the same geometry and plan, in the same order).

    Returns the output and the report (violations, then the first violation's kind | rank << 8 | peer << 16,
    granule, stamp found, stamp written). ``moving`` runs the pre-fix window layout (a negative control: expect
    violations on uneven plans). The window must hold the plan's bytes plus 8 bytes of stamps per partition
    granule."""
    lib, handle, rank = _test_library(transport, "the epoch-checked launch")
    import fastvideo_kernel as fvk

    out = torch.empty(output_shape(geom, rank), dtype=x.dtype, device=x.device)
    report = torch.zeros(5, dtype=torch.int64, device=x.device)
    flags = fvk.CALL_DEBUG | (fvk.CALL_DEBUG_MOVING_LAYOUT if moving else 0)
    call, tables = call_description(fvk, geom, x.dtype, kind=fvk.KIND_SM, ctas=plan.ctas,
                                    planes=plan.planes_per_chunk, rows=plan.rows_per_chunk, flags=flags)
    call.debug_report = report.data_ptr()
    stream = torch.cuda.current_stream(x.device)
    status = lib.fvk_launch(handle, ctypes.byref(call), x.data_ptr(), out.data_ptr(), stream.cuda_stream, None)
    del tables  # read by the launch (the kernel holds its own copy of the shares)
    _check(lib, status, "fvk_launch (epoch-checked)")
    return out, [int(v) for v in report.cpu().tolist()]


def fabric_copy(transport, nbytes: int, *, engine: int, ctas: int = 132) -> None:
    """Collective, enqueued on the current stream (does not block the host), not capture-safe: the benchmark's
    fabric limit (``fvk_fabric_copy``) on the transport's communicator. Barrier, every rank copies ``nbytes``
    (a multiple of 16, (P + 1) x nbytes <= the window) into every peer's window at once, barrier; ``engine`` 0
    the copy engines, 1 ``ctas`` CTAs of SM stores. Bypasses the vote: every rank must call it with the same
    arguments, in the same order. Raises ``TestingUnavailable`` (before anything is enqueued) when the
    transport does not run the test library."""
    lib, handle, _ = _test_library(transport, "the fabric copy")
    stream = torch.cuda.current_stream()
    _check(lib, lib.fvk_fabric_copy(handle, nbytes, engine, ctas, stream.cuda_stream), "fvk_fabric_copy")
