"""CPU tests of the kernel's host side: loader, NativeTransport's probing, and a built library's ABI.

No GPU needed. The built-library tests use ``build/kernel/libfastvideo_ulysses_a2a.so`` (what
``scripts/build_kernel.sh`` produces; ``FASTVIDEO_KERNEL_TEST_BUILD`` overrides) and skip, saying
why, when it is absent or cannot be loaded on this machine.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fastvideo.distributed.ulysses.contract import DeclineReason
from fastvideo.distributed.ulysses.native import (
    NativeKernelError,
    NativeTransport,
    nccl_libraries_mapped,
    nccl_mismatch,
)
from fastvideo.distributed.ulysses.policy import Geometry, Plan

REPO = Path(__file__).resolve().parents[2]
try:
    import fastvideo_kernel
except ImportError:  # the loader is pure Python: use it from the source tree
    sys.path.insert(0, str(REPO / "fastvideo-kernel"))
    import fastvideo_kernel

BUILT = Path(os.environ.get("FASTVIDEO_KERNEL_TEST_BUILD")
             or REPO / "build" / "kernel" / fastvideo_kernel.LIBRARY_NAME)
EXPECTED_SYMBOLS = {
    "fvk_abi_version", "fvk_nccl_build_version", "fvk_nccl_runtime_version", "fvk_last_error", "fvk_max_ctas",
    "fvk_coresident_ctas", "fvk_relax_capture_mode", "fvk_pci_bus_id", "fvk_nvlink_p2p", "fvk_unique_id_bytes",
    "fvk_get_unique_id",
    "fvk_create", "fvk_comm_init", "fvk_window_alloc", "fvk_window_register", "fvk_devcomm_create", "fvk_lsa_info",
    "fvk_a2a_original", "fvk_a2a_tuned", "fvk_a2a_ce", "fvk_fabric_copy", "fvk_a2a_captured", "fvk_a2a_ce_captured",
    "fvk_a2a_debug",
    "fvk_sim_a2a", "fvk_check_window_sync", "fvk_check_ce_sync", "fvk_check_ce_addressing", "fvk_destroy",
    "fvk_abort", "fvk_vote_would_run", "fvk_voted_launch",
}


def test_importing_native_loads_no_library():
    code = ("import sys, fastvideo.distributed.ulysses.native as n; "
            "assert 'fastvideo_kernel' not in sys.modules, 'loader imported at import time'; print('ok')")
    env = {**os.environ, "FASTVIDEO_KERNEL_LIBRARY": "/nonexistent/lib.so", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr


def test_missing_library_is_a_decline_not_an_error(monkeypatch):
    monkeypatch.setenv(fastvideo_kernel.ENV_LIBRARY, "/nonexistent/dir/libfastvideo_ulysses_a2a.so")
    assert fastvideo_kernel.library_path() == Path("/nonexistent/dir/libfastvideo_ulysses_a2a.so")
    with pytest.raises(fastvideo_kernel.KernelUnavailable, match="no kernel library at /nonexistent/dir"):
        fastvideo_kernel.load()
    cap = NativeTransport().capability()
    assert not cap.present and cap.decline is DeclineReason.TRANSPORT_MISSING
    assert "/nonexistent/dir" in cap.detail
    info = fastvideo_kernel.info()
    assert info["exists"] is False and "no kernel library" in info["error"]


def test_unloadable_file_is_a_decline(monkeypatch, tmp_path):
    bogus = tmp_path / "libfastvideo_ulysses_a2a.so"
    bogus.write_bytes(b"not an ELF file")
    monkeypatch.setenv(fastvideo_kernel.ENV_LIBRARY, str(bogus))
    with pytest.raises(fastvideo_kernel.KernelUnavailable, match="cannot load kernel library"):
        fastvideo_kernel.load()
    cap = NativeTransport().capability()
    assert not cap.present and cap.decline is DeclineReason.TRANSPORT_MISSING and str(bogus) in cap.detail


def test_capability_on_this_machine_never_raises(monkeypatch):
    monkeypatch.delenv(fastvideo_kernel.ENV_LIBRARY, raising=False)
    cap = NativeTransport().capability()
    if not cap.present:
        assert cap.decline in (DeclineReason.TRANSPORT_MISSING, DeclineReason.TRANSPORT_TOO_OLD,
                               DeclineReason.NCCL_RUNTIME_MISMATCH)
        assert cap.detail


def test_execute_before_construction_raises():
    x = torch.zeros(1, 2, 4, 8)
    with pytest.raises(NativeKernelError, match="before construction"):
        NativeTransport().execute(x, Geometry.from_input(x.shape, 0, 2, x.dtype), Plan(36, 1, 2, tuned=False))


def test_nccl_libraries_mapped_counts_distinct_files():
    maps = "\n".join([
        "7f0000000000-7f0000001000 r-xp 00000000 08:01 1 /site/nvidia/nccl/lib/libnccl.so.2",
        "7f0000001000-7f0000002000 r--p 00001000 08:01 1 /site/nvidia/nccl/lib/libnccl.so.2",
        "7f0000003000-7f0000004000 rw-p 00000000 00:00 0",
        "7f0000005000-7f0000006000 r-xp 00000000 08:01 2 /usr/lib/libncclnet.so",
    ])
    assert nccl_libraries_mapped(maps) == {os.path.realpath("/site/nvidia/nccl/lib/libnccl.so.2")}
    second = maps + "\n7f0000007000-7f0000008000 r-xp 00000000 08:01 3 /opt/nccl/lib/libnccl.so.2.28.9"
    assert len(nccl_libraries_mapped(second)) == 2


def test_nccl_versions():
    assert fastvideo_kernel.nccl_version_tuple(22809) == (2, 28, 9)
    assert fastvideo_kernel.nccl_version_tuple(23007) == (2, 30, 7)
    assert nccl_mismatch(22809, 22805) is None
    assert "2.28.9" in nccl_mismatch(22809, 23007) and "2.30.7" in nccl_mismatch(22809, 23007)


# ---------------------------------------------------------------------- a built library, if present

@pytest.fixture
def built(monkeypatch):
    if not BUILT.is_file():
        pytest.skip(f"no built library at {BUILT} (run scripts/build_kernel.sh 2.28.9)")
    monkeypatch.setenv(fastvideo_kernel.ENV_LIBRARY, str(BUILT))
    return BUILT


def test_built_library_exports_the_abi(built):
    if not shutil.which("nm"):
        pytest.skip("nm not installed")
    out = subprocess.run(["nm", "-D", "--defined-only", str(built)], capture_output=True, text=True, check=True).stdout
    exported = {line.split()[-1] for line in out.splitlines() if line.split()[-2:-1] == ["T"]}
    assert EXPECTED_SYMBOLS <= exported, f"missing: {sorted(EXPECTED_SYMBOLS - exported)}"
    assert not {s for s in exported if not s.startswith("fvk_")}, "only the C ABI is exported (visibility=hidden)"


def test_built_library_abi_query(built):
    try:
        lib = fastvideo_kernel.load()
    except fastvideo_kernel.KernelUnavailable as exc:
        pytest.skip(f"the built library cannot be loaded on this machine (e.g. its libnccl.so.2 is absent): {exc}")
    assert lib.fvk_abi_version() == 3
    assert fastvideo_kernel.entry_points(lib) == {"original", "tuned", "ce", "fabric", "capture", "ce_capture", "debug",
                                                  "sim", "sync_check", "ce_sync_check", "ce_addressing_check"}
    assert fastvideo_kernel.nccl_version_tuple(lib.fvk_nccl_build_version())[:2] >= (2, 28)
    assert lib.fvk_max_ctas() == 144
    assert lib.fvk_unique_id_bytes() == 128
    # Argument checks answer with a code and a message, before touching CUDA.
    call = fastvideo_kernel.SimCall(mode=0, dtype=9, ctas=36, B=1, S=4, H=4, D=8, planes_per_chunk=1,
                                    rows_per_chunk=4)
    call.x[0] = call.x[1] = call.out[0] = call.out[1] = 1
    windows = (ctypes.c_void_p * 2)(1, 2)
    report = (ctypes.c_uint64 * 5)()
    status = lib.fvk_sim_a2a(2, 1, ctypes.byref(call), windows, 1 << 20, 0, 0, 0, report, None)
    assert status == 1 and "dtype code 9" in fastvideo_kernel.last_error(lib)
    call.dtype = 3
    status = lib.fvk_sim_a2a(2, 1, ctypes.byref(call), windows, 16, 0, 0, 0, report, None)
    assert status == 1 and "window" in fastvideo_kernel.last_error(lib)
    status = lib.fvk_sim_a2a(2, 1, ctypes.byref(call), windows, 1 << 20, 64, 0, 0, report, None)
    assert status == 1 and "unknown sim flags" in fastvideo_kernel.last_error(lib)
    status = lib.fvk_sim_a2a(2, 5, ctypes.byref(call), windows, 1 << 20, 0, 0, 0, report, None)
    assert status == 1 and "ncalls=5" in fastvideo_kernel.last_error(lib)
    status = lib.fvk_a2a_tuned(None, None, None, 0, 3, 1, 4, 4, 8, 36, 1, 4, None)
    assert status == 5 and "constructed context" in fastvideo_kernel.last_error(lib)
    status = lib.fvk_a2a_debug(None, None, None, 0, 3, 1, 4, 4, 8, 36, 1, 4, 1, None, None)
    assert status == 1 and "report buffer" in fastvideo_kernel.last_error(lib)
    status = lib.fvk_a2a_captured(None, None, None, 0, 3, 1, 4, 4, 8, 36, 1, 4, None)
    assert status == 5 and "constructed context" in fastvideo_kernel.last_error(lib)
    status = lib.fvk_a2a_debug(None, None, None, 0, 3, 1, 4, 4, 8, 36, 1, 4, 1 << 31, 1, None)  # the capture flag
    assert status == 1 and "cannot be captured" in fastvideo_kernel.last_error(lib)
    info = fastvideo_kernel.info()
    assert info["abi_version"] == 3 and len(info["sha256"]) == 64


def test_built_library_reports_cuda_errors_without_aborting(built):
    if torch.cuda.is_available():
        pytest.skip("checks the no-GPU error path")
    try:
        lib = fastvideo_kernel.load()
    except fastvideo_kernel.KernelUnavailable as exc:
        pytest.skip(f"the built library cannot be loaded on this machine: {exc}")
    handle = ctypes.c_void_p()
    status = lib.fvk_create(0, ctypes.byref(handle))
    assert status == 2 and "cudaGetDeviceCount" in fastvideo_kernel.last_error(lib)


def test_native_capture_decline_names_the_fix_and_refuses_unknown_plan_kinds():
    """No library needed: a build without ``fvk_a2a_captured`` declines capture naming the rebuild; with it, a
    known plan can be frozen (the control) and a plan word with bits this code does not know (another plan
    kind, which may need host work per call) cannot."""
    import types

    geom = Geometry.from_input((3, 16, 12, 8), 0, 2, torch.bfloat16)
    tuned, original = Plan(144, 1, 16, True), Plan(36, 3, 16, False)
    old = NativeTransport()
    old._entries = frozenset({"original", "tuned"})
    assert "rebuild fastvideo-kernel" in old.capture_decline(geom, tuned)
    new = NativeTransport()
    new._entries = frozenset({"original", "tuned", "capture"})
    assert new.capture_decline(geom, tuned) is None and new.capture_decline(geom, original) is None
    other_kind = types.SimpleNamespace(ctas=144, planes_per_chunk=1, rows_per_chunk=16, tuned=True, engine="sm",
                                       word=tuned.word | 1 << 63)
    assert "not one this transport can freeze" in new.capture_decline(geom, other_kind)
    # The copy-engine kind: refused, naming the rebuild, by a build without fvk_a2a_ce_captured; frozen with it.
    ce = Plan(66, 1, 16, True, engine="ce")
    assert "fvk_a2a_ce_captured" in new.capture_decline(geom, ce) and "rebuild" in new.capture_decline(geom, ce)
    both = NativeTransport()
    both._entries = frozenset({"original", "tuned", "ce", "capture", "ce_capture"})
    assert both.capture_decline(geom, ce) is None and both.capture_decline(geom, tuned) is None
    ce_other = types.SimpleNamespace(ctas=66, planes_per_chunk=1, rows_per_chunk=16, tuned=True, engine="ce",
                                     word=ce.word | 1 << 63)
    assert "not one this transport can freeze" in both.capture_decline(geom, ce_other)


def test_loader_reports_the_capture_entry_only_when_exported():
    """An older build without ``fvk_a2a_captured`` loads and lacks the ``capture`` entry point (a decline reason
    under capture, never an import error); the control has it."""
    import types

    base = {"fvk_abi_version": lambda: 2, "fvk_a2a_original": object(), "fvk_a2a_tuned": object()}
    assert "capture" not in fastvideo_kernel.entry_points(types.SimpleNamespace(**base))
    assert "capture" in fastvideo_kernel.entry_points(types.SimpleNamespace(**base, fvk_a2a_captured=object()))
