"""A build of the oldest supported ABI keeps working on the original 36-CTA path (CPU, no GPU).

A stub library of ABI 2 (``OLDEST_ABI``) is compiled here with the host compiler: it exports that ABI's
construction, teardown and vote functions, ``fvk_a2a_original`` (which records its arguments and copies the
input's bytes to the output, so the test sees what reached it) and ABI 2's ``fvk_a2a_tuned`` (which must
never be reached: the loader drives ABI 2 through the original entry alone). Loaded as the kernel library,
it must probe as ``{original, vote}``, give a ``NativeTransport`` whose capability offers ``ENTRY_ORIGINAL``
only, make the helper's planner plan the original plan for a geometry whose tuned row the newest build
would take (the control), run that plan through ``fvk_a2a_original`` with the call's arguments, and refuse
everything else by name. Variants: ABI 1 (declined as too old), ABI 2 without the vote (a broken build:
declined), ABI 5 (newer than the loader: declined).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from fastvideo.distributed.ulysses import native, planner
from fastvideo.distributed.ulysses.contract import DeclineReason, dtype_code
from fastvideo.distributed.ulysses.native import NativeKernelError, NativeTransport
from fastvideo.distributed.ulysses.policy import CAPTURE_ENGINES, TUNED_TABLE, Geometry, Plan, choose_plan
from fastvideo.distributed.ulysses.transport import ENTRY_ORIGINAL, ConstructionContext
from tests.ci import ci
from tests.kernel.built import fastvideo_kernel

STUB = r"""
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#define API __attribute__((visibility("default")))
static char g_log[8192];
static int g_ctx;
static void note(const char* line) { strncat(g_log, line, sizeof(g_log) - strlen(g_log) - 1); }

API const char* stub_log(void) { return g_log; }
API int fvk_abi_version(void) { return STUB_ABI; }
API int fvk_nccl_build_version(void) { return 22809; }
API int fvk_nccl_runtime_version(int* v) { *v = 22809; return 0; }
API const char* fvk_last_error(void) { return "stub"; }
API int fvk_max_ctas(void) { return 144; }
API int fvk_coresident_ctas(int device, int* ctas) { *ctas = 264; return 0; }
API int fvk_pci_bus_id(int device, char* buf, int len) { snprintf(buf, len, "0000:%02x:00.0", device); return 0; }
API int fvk_nvlink_p2p(const char* a, const char* b, int* nvlink) { *nvlink = 1; return 0; }
API int fvk_unique_id_bytes(void) { return 128; }
API int fvk_get_unique_id(void* out, size_t len) { memset(out, 7, len); return 0; }
API int fvk_create(int device, void** out) { *out = &g_ctx; note("create;"); return 0; }
API int fvk_comm_init(void* ctx, const void* uid, size_t len, int nranks, int rank) { note("comm_init;"); return 0; }
API int fvk_window_alloc(void* ctx, size_t bytes) { note("window_alloc;"); return 0; }
API int fvk_window_register(void* ctx) { note("window_register;"); return 0; }
API int fvk_devcomm_create(void* ctx) { note("devcomm_create;"); return 0; }
API int fvk_lsa_info(void* ctx, int* n, int* r, int* s, int* lr) { *n = 2; *r = 0; *s = 2; *lr = 0; return 0; }
API int fvk_destroy(void* ctx) { note("destroy;"); return 0; }
API int fvk_abort(void* ctx) { note("abort;"); return 0; }
API int fvk_a2a_original(void* ctx, const void* x, void* out, int mode, int dtype, int64_t B, int64_t S,
                         int64_t H, int64_t D, void* stream) {
  char line[160];
  snprintf(line, sizeof(line), "original %d %d %lld %lld %lld %lld %p;", mode, dtype, (long long)B,
           (long long)S, (long long)H, (long long)D, stream);
  note(line);
  memcpy(out, x, (size_t)(B * S * H * D * (dtype == 1 ? 4 : 2)));
  return ctx == &g_ctx ? 0 : 1;
}
API int fvk_a2a_tuned(void* ctx, const void* x, void* out, int mode, int dtype, int64_t B, int64_t S, int64_t H,
                      int64_t D, int ctas, int64_t planes, int64_t rows, void* stream) {
  note("tuned;");
  return 1;
}
#ifndef STUB_NO_VOTE
API int fvk_vote_open(const char* name, int world, int rank, int create, void** handle) { return 6; }
API int fvk_vote_exchange(void* h, const int64_t* f, int64_t* out, int64_t timeout) { return 5; }
API int fvk_vote_unlink(void* h) { return 5; }
API int fvk_vote_close(void* h, int unlink) { return 5; }
#endif
"""


def compiler() -> str:
    found = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not found:
        if ci():
            pytest.fail("CI must have a host C compiler (nvcc needs one too)")
        pytest.skip("no host C compiler (cc, gcc)")
    return found


def stub(tmp_path: Path, abi: int, *defines: str) -> Path:
    src, lib = tmp_path / "stub.c", tmp_path / f"libstub_abi{abi}{'_'.join(defines)}.so"
    src.write_text(STUB)
    subprocess.run([compiler(), "-shared", "-fPIC", "-fvisibility=hidden", f"-DSTUB_ABI={abi}",
                    *(f"-D{d}" for d in defines), str(src), "-o", str(lib)], check=True, capture_output=True)
    return lib


@pytest.fixture
def use(monkeypatch):
    """Point the loader at a library, and let the capability's NCCL checks pass on this CPU machine (one
    libnccl mapped, the stub's versions): what is under test is the probe."""
    monkeypatch.setattr(native, "nccl_libraries_mapped", lambda text: {"/site/nvidia/nccl/lib/libnccl.so.2"})

    def point(lib: Path) -> ctypes.CDLL:
        monkeypatch.setenv(fastvideo_kernel.ENV_LIBRARY, str(lib))
        return fastvideo_kernel.load()

    return point


class FakeEvent:
    def record(self, stream) -> None:
        pass


def built_transport(monkeypatch) -> NativeTransport:
    """A NativeTransport constructed over the stub (2 ranks, this one rank 0; the peer's exchange is faked)."""
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    t = NativeTransport()
    cap = t.capability()
    assert cap.present, cap.detail
    ctx = ConstructionContext(rank=0, world_size=2, device=torch.device("cpu", 0), window_bytes=1 << 30, max_ctas=144,
                              device_group=None, all_gather_object=lambda obj: [obj, obj])
    for step in t.construction_steps(ctx):
        step.run()
    t._current_raw = lambda x: (0, 0x5EED)  # type: ignore[method-assign]  - no CUDA stream here
    t._stream = lambda index, raw: "the-stream"  # type: ignore[method-assign]
    return t


def test_the_oldest_abi_offers_the_original_plan_alone_and_runs_it(tmp_path, use, monkeypatch):
    lib = use(stub(tmp_path, fastvideo_kernel.OLDEST_ABI))
    probe = fastvideo_kernel.probe(lib)
    assert probe == (2, frozenset({fastvideo_kernel.ORIGINAL, fastvideo_kernel.VOTE}), "")
    assert fastvideo_kernel.info()["offerings"] == ["original", "vote"]
    t = built_transport(monkeypatch)
    cap = t.capability()
    assert cap.entry_points == frozenset({ENTRY_ORIGINAL}) and cap.abi_version == 2
    # The planner: the newest build would take the tuned copy-engine row for this geometry (the control);
    # this build's capability leaves the planner no rows, so it plans the original plan.
    x = torch.randn(1, 512, 56, 128).to(torch.bfloat16)
    geom = Geometry.from_input(x.shape, 0, 2, x.dtype)
    tuned = choose_plan(geom, gpu="NVIDIA H200", window_bytes=1 << 30, table=TUNED_TABLE).plan
    assert tuned is not None and tuned.tuned
    eager, capture = planner.tables(TUNED_TABLE, cap.entry_points, CAPTURE_ENGINES)
    assert eager == capture == ()
    plan = choose_plan(geom, gpu="NVIDIA H200", window_bytes=1 << 30, table=eager).plan
    assert plan == Plan(36, 1, 512, tuned=False)
    out = t.execute(x, geom, plan)
    log = lib.stub_log
    log.restype = ctypes.c_char_p
    assert log().decode().endswith(f"original 0 {dtype_code(x.dtype)} 1 512 56 128 0x5eed;")
    assert torch.equal(out.view(torch.int16).flatten(), x.view(torch.int16).flatten())  # the stub's byte copy
    # Everything else is refused by name, before the library: no tuned entry, no capture, no voted launch.
    with pytest.raises(NativeKernelError, match="needs the 'ce' offering"):
        t.execute(x, geom, tuned)
    with pytest.raises(NativeKernelError, match="needs the 'tuned' offering"):
        t.execute(x, geom, Plan(144, 1, 512, tuned=True))
    assert "rebuild fastvideo-kernel" in t.capture_decline(geom, plan)
    assert not t.fuses_vote(type("ShmLike", (), {"send_row": None})())
    t.watchdog_thread_setup()  # ABI 2 has no fvk_relax_capture_mode: nothing to call
    assert "tuned;" not in log().decode()
    t.destroy()
    assert log().decode().endswith("destroy;")


@pytest.mark.parametrize(("abi", "defines", "reason", "detail"), [
    (1, (), DeclineReason.TRANSPORT_TOO_OLD, "older than the oldest supported (2)"),
    (2, ("STUB_NO_VOTE",), DeclineReason.TRANSPORT_MISSING, "lacks ['fvk_vote_close'"),
    (fastvideo_kernel.ABI_VERSION + 1, (), DeclineReason.TRANSPORT_MISSING, "newer than this loader knows"),
])
def test_a_build_the_loader_cannot_drive_is_declined(tmp_path, use, abi, defines, reason, detail):
    lib = use(stub(tmp_path, abi, *defines))
    probe = fastvideo_kernel.probe(lib)
    assert probe.abi == abi and probe.offerings == frozenset() and detail in probe.problem
    cap = NativeTransport().capability()
    assert not cap.present and cap.decline is reason and detail in cap.detail
    assert cap.entry_points == frozenset()
