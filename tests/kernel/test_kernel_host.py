"""CPU tests of the kernel's host side: loader, probe, NativeTransport's probing, and the built libraries' ABI.

No GPU needed. The built-library tests use ``build/kernel/`` (what ``scripts/build_kernel.sh`` produces:
the product library and the test library beside it; ``FASTVIDEO_KERNEL_TEST_BUILD`` overrides) and skip,
saying why, when they are absent or cannot be loaded on this machine (under ``CI=true`` they fail).
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from fastvideo.distributed.ulysses.contract import DeclineReason
from fastvideo.distributed.ulysses.native import NativeTransport
from fastvideo.distributed.ulysses.nccl_runtime import nccl_libraries_mapped, nccl_mismatch
from fastvideo.distributed.ulysses.policy import Geometry, Plan
from tests.kernel.built import BUILT, BUILT_TESTING, REPO, fastvideo_kernel, kernel_testing

CSRC = REPO / "csrc" / "ulysses_a2a"
# Test and measurement code by name: none of it may appear in the product sources or the product library.
TEST_CODE = re.compile(r"sim_kernel|SimEnv|epoch_(?:store|load)|checked_a2a|CheckedLsaEnv|flat_push|fabric|"
                       r"fvk_sim_a2a|fvk_check_|StampArea|Checker")


def code_of(path: Path) -> str:
    """A C/C++/CUDA source without its comments (which may name the test code they point to)."""
    return re.sub(r"//[^\n]*", "", re.sub(r"/\*.*?\*/", "", path.read_text(), flags=re.S))


def test_importing_native_loads_no_library():
    code = ("import sys, fastvideo.distributed.ulysses.native as n; "
            "assert 'fastvideo_kernel' not in sys.modules, 'loader imported at import time'; print('ok')")
    env = {**os.environ, "FASTVIDEO_KERNEL_LIBRARY": "/nonexistent/lib.so", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr


def test_missing_library_is_a_decline_not_an_error(monkeypatch):
    monkeypatch.setenv(fastvideo_kernel.ENV_LIBRARY, "/nonexistent/dir/libfastvideo_ulysses_a2a.so")
    assert fastvideo_kernel.library_path() == Path("/nonexistent/dir/libfastvideo_ulysses_a2a.so")
    with pytest.raises(fastvideo_kernel.KernelUnavailable, match="no kernel library at /nonexistent/dir") as raised:
        fastvideo_kernel.load()
    # The variable names the library: the advice is about it (installing the wheel would not change what loads).
    assert "point it at a built library" in str(raised.value) and "pip install" not in str(raised.value)
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


def test_the_product_sources_hold_no_test_code():
    """The product library's sources (csrc/ulysses_a2a/, not testing/) name no simulation, epoch checker, host
    model or fabric copy; the same pattern finds them in testing/ (the check can fail)."""
    product = [p for p in CSRC.iterdir() if p.is_file()]
    testing = list((CSRC / "testing").iterdir())
    assert len(product) >= 8 and len(testing) >= 7
    found = {p.name: TEST_CODE.findall(code_of(p)) for p in product}
    assert not {name: hits for name, hits in found.items() if hits}
    assert all(TEST_CODE.search(code_of(p)) for p in testing if p.suffix in (".cu", ".cpp"))
    build = (REPO / "fastvideo-kernel" / "build_lib.py").read_text()
    assert all(f'"{p.name}"' in build for p in product if p.suffix in (".cu", ".cpp"))  # every product source built
    assert all(f'"testing/{p.name}"' in build for p in testing if p.suffix in (".cu", ".cpp"))


def test_the_probe_maps_the_abi_to_its_offerings_and_checks_the_symbols():
    """``fastvideo_kernel.probe`` decides from the ABI's row of OFFERINGS, never from which symbols happen to be
    there (an ABI 3 build exporting fvk_a2a_tuned offers no tuned plans), and a build missing a function its
    offerings need is a problem, not a smaller offering."""
    def lib(abi: int, *names: str):
        symbols = {name: object() for name in (*fastvideo_kernel.LIFECYCLE, *names)}
        return types.SimpleNamespace(**{**symbols, "fvk_abi_version": lambda: abi})

    votes = fastvideo_kernel.VOTE_SYMBOLS
    newest = lib(5, "fvk_a2a_original", "fvk_launch", "fvk_vote_would_run", "fvk_relax_capture_mode", *votes)
    assert fastvideo_kernel.probe(newest) == (5, fastvideo_kernel.OFFERINGS[5], "")
    four = lib(4, "fvk_a2a_original", "fvk_launch", "fvk_vote_would_run", "fvk_relax_capture_mode", *votes)
    assert fastvideo_kernel.probe(four) == (4, fastvideo_kernel.OFFERINGS[5] - {"uneven"}, "")
    three = lib(3, "fvk_a2a_original", "fvk_a2a_tuned", "fvk_a2a_ce", "fvk_a2a_captured", "fvk_relax_capture_mode",
                *votes)
    assert fastvideo_kernel.probe(three) == (3, frozenset({"original", "vote", "relax_capture"}), "")
    broken = lib(4, "fvk_a2a_original", "fvk_vote_would_run", "fvk_relax_capture_mode", *votes)
    found = fastvideo_kernel.probe(broken)
    assert found.offerings == frozenset() and "lacks ['fvk_launch']" in found.problem


# ---------------------------------------------------------------------- the built libraries, if present

def exported(path: Path) -> set[str]:
    if not shutil.which("nm"):
        pytest.skip("nm not installed")
    out = subprocess.run(["nm", "-D", "--defined-only", str(path)], capture_output=True, text=True, check=True).stdout
    return {line.split()[-1] for line in out.splitlines() if line.split()[-2:-1] == ["T"]}


def test_each_built_library_exports_exactly_its_abi(product_lib, testing_lib):
    product = exported(BUILT)
    assert product == set(fastvideo_kernel.SIGNATURES), product ^ set(fastvideo_kernel.SIGNATURES)
    assert exported(BUILT_TESTING) == product | set(kernel_testing.TESTING_SIGNATURES)


def test_the_product_library_holds_no_test_code(product_lib, testing_lib):
    """Every symbol of the product library, local ones included: none is test code; the test library's are
    found by the same pattern (the negative control)."""
    def symbols(path: Path) -> str:
        return subprocess.run(["nm", "-C", str(path)], capture_output=True, text=True, check=True).stdout

    if not shutil.which("nm"):
        pytest.skip("nm not installed")
    assert TEST_CODE.findall(symbols(BUILT)) == []
    assert {"sim_kernel", "checked_a2a", "flat_push", "fvk_sim_a2a"} <= set(TEST_CODE.findall(symbols(BUILT_TESTING)))


def call(**fields) -> fastvideo_kernel.Call:
    desc = fastvideo_kernel.Call(size=ctypes.sizeof(fastvideo_kernel.Call), kind=fastvideo_kernel.KIND_SM, mode=0,
                                 dtype=3, ctas=36, B=1, S=4, H=4, D=8, planes_per_chunk=1, rows_per_chunk=4)
    for name, value in fields.items():
        setattr(desc, name, value)
    return desc


def launch(lib, desc) -> tuple[int, str]:
    status = lib.fvk_launch(None, ctypes.byref(desc), None, None, None, None)
    return status, fastvideo_kernel.last_error(lib) if status else ""


def test_built_libraries_identity(product_lib, testing_lib):
    for lib in (product_lib, testing_lib):
        assert lib.fvk_abi_version() == fastvideo_kernel.ABI_VERSION == 5
        assert fastvideo_kernel.probe(lib) == (5, fastvideo_kernel.OFFERINGS[5], "")
        assert "uneven" in fastvideo_kernel.probe(lib).offerings
        assert fastvideo_kernel.nccl_version_tuple(lib.fvk_nccl_build_version())[:2] >= (2, 28)
        assert lib.fvk_max_ctas() == 144 and lib.fvk_unique_id_bytes() == 128
    assert kernel_testing.is_testing_library(testing_lib) and not kernel_testing.is_testing_library(product_lib)
    assert testing_lib.fvk_testing_abi_version() == kernel_testing.TESTING_ABI_VERSION


def test_the_call_description_is_checked_before_anything_else(product_lib, testing_lib):
    """fvk_launch's checks of the call description (no context needed), the same in both libraries; a valid
    description reaches the context check (the control)."""
    k = fastvideo_kernel
    cases = [
        (call(), 5, "constructed context"),
        (call(size=40), 1, "fvk_call.size 40"),
        (call(kind=2), 1, "kind 2"),
        (call(flags=8), 1, "unknown bits"),
        (call(flags=k.CALL_DEBUG_MOVING_LAYOUT), 1, "needs FVK_CALL_DEBUG"),
        (call(flags=k.CALL_DEBUG, kind=k.KIND_CE), 1, "eager SM-kind launch"),
        (call(flags=k.CALL_DEBUG | k.CALL_CAPTURE), 1, "eager SM-kind launch"),
        # Split tables are read with the geometry, after the context check (ABI 4 refused any non-null table here).
        (call(head_split=0x1000, seq_split=0x2000), 5, "constructed context"),
        (call(kind=k.KIND_CE, flags=k.CALL_CAPTURE), 5, "constructed context"),
    ]
    for lib in (product_lib, testing_lib):
        for desc, code, message in cases:
            status, error = launch(lib, desc)
            assert status == code and message in error, (desc.kind, desc.flags, error)
        assert lib.fvk_launch(None, None, None, None, None, None) == 1
        assert lib.fvk_a2a_original(None, None, None, 0, 3, 1, 4, 4, 8, None) == 5


def test_a_larger_call_description_is_read_up_to_what_the_library_knows(product_lib):
    """The size field versions fvk_call: a newer caller's description with zeros past this library's fields
    reads as the fields it knows; a non-zero byte there is refused, naming its offset."""
    size = ctypes.sizeof(fastvideo_kernel.Call)
    buf = (ctypes.c_char * (size + 16))()
    ctypes.memmove(buf, ctypes.byref(call()), size)
    ctypes.c_uint32.from_buffer(buf, 0).value = size + 16
    desc = fastvideo_kernel.Call.from_buffer(buf)
    assert launch(product_lib, desc) == (5, "execute needs a constructed context")
    buf[size + 3] = b"\x01"
    status, error = launch(product_lib, desc)
    assert status == 1 and f"byte {size + 3}" in error and "newer caller" in error


def test_debug_launches_are_the_test_library_s(product_lib, testing_lib):
    """The product library refuses FVK_CALL_DEBUG naming the test library; the test library takes it (its
    epoch-checked launch then needs a context like any launch)."""
    status, error = launch(product_lib, call(flags=fastvideo_kernel.CALL_DEBUG))
    assert status == 1 and "libfastvideo_ulysses_a2a_testing.so" in error
    status, error = launch(testing_lib, call(flags=fastvideo_kernel.CALL_DEBUG))
    assert status == 5 and "constructed context" in error
    moving = fastvideo_kernel.CALL_DEBUG | fastvideo_kernel.CALL_DEBUG_MOVING_LAYOUT
    status, error = launch(testing_lib, call(flags=moving))
    assert status == 5 and "constructed context" in error


def test_the_test_library_refuses_bad_simulations_and_fabric_copies(testing_lib, monkeypatch):
    lib = testing_lib
    sim = kernel_testing.SimCall(call=call(dtype=9))
    sim.x[0] = sim.x[1] = sim.out[0] = sim.out[1] = 1
    windows = (ctypes.c_void_p * 2)(1, 2)
    report = (ctypes.c_uint64 * 5)()
    status = lib.fvk_sim_a2a(2, 1, ctypes.byref(sim), windows, 1 << 20, 0, 0, 0, report, None)
    assert status == 1 and "dtype code 9" in fastvideo_kernel.last_error(lib)
    sim.call.dtype = 3
    status = lib.fvk_sim_a2a(2, 1, ctypes.byref(sim), windows, 16, 0, 0, 0, report, None)
    assert status == 1 and "window" in fastvideo_kernel.last_error(lib)
    status = lib.fvk_sim_a2a(2, 1, ctypes.byref(sim), windows, 1 << 20, 64, 0, 0, report, None)
    assert status == 1 and "unknown sim flags" in fastvideo_kernel.last_error(lib)
    status = lib.fvk_sim_a2a(2, 5, ctypes.byref(sim), windows, 1 << 20, 0, 0, 0, report, None)
    assert status == 1 and "ncalls=5" in fastvideo_kernel.last_error(lib)
    assert lib.fvk_fabric_copy(None, 16, 0, 1, None) == 5
    assert "constructed context" in fastvideo_kernel.last_error(lib)
    monkeypatch.setenv(kernel_testing.ENV_TESTING_LIBRARY, str(BUILT_TESTING))
    info = kernel_testing.info()
    assert info["abi_version"] == 5 and len(info["sha256"]) == 64 and info["path"] == str(BUILT_TESTING)


def test_built_library_reports_cuda_errors_without_aborting(product_lib):
    if torch.cuda.is_available():
        pytest.skip("checks the no-GPU error path")
    handle = ctypes.c_void_p()
    status = product_lib.fvk_create(0, ctypes.byref(handle))
    assert status == 2 and "cudaGetDeviceCount" in fastvideo_kernel.last_error(product_lib)


def test_native_capture_decline_names_the_fix_and_refuses_unknown_plan_kinds():
    """No library needed: a build that does not offer capture declines it naming the rebuild; with it, a known
    plan can be frozen (the control) and a plan word with bits this code does not know (another plan kind,
    which may need host work per call) cannot."""
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
    # The copy-engine kind: refused, naming the rebuild, by a build that does not offer ce_capture; frozen with it.
    ce = Plan(66, 1, 16, True, engine="ce")
    assert "'ce_capture'" in new.capture_decline(geom, ce) and "rebuild" in new.capture_decline(geom, ce)
    both = NativeTransport()
    both._entries = frozenset({"original", "tuned", "ce", "capture", "ce_capture"})
    assert both.capture_decline(geom, ce) is None and both.capture_decline(geom, tuned) is None
    ce_other = types.SimpleNamespace(ctas=66, planes_per_chunk=1, rows_per_chunk=16, tuned=True, engine="ce",
                                     word=ce.word | 1 << 63)
    assert "not one this transport can freeze" in both.capture_decline(geom, ce_other)
