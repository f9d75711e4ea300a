#!/usr/bin/env python3
"""One-GPU smoke of the real NCCL path through ``NativeTransport``: a 1-rank communicator.

Runs every construction step (comm init with nranks=1, ncclMemAlloc window, symmetric
registration, device communicator with 144 LSA barriers), reports LSA coverage and topology,
executes the fused kernel with P=1 (every share is the rank's own, so the output equals the input;
the kernel still opens its LSA barrier sessions and syncs them for every chunk) through the
original and tuned plans and across a stream change, checks that bad plans are refused with a message,
exercises abort after a partial construction, and destroys collectively.

Run it on the test library (``FASTVIDEO_KERNEL_LIBRARY=.../libfastvideo_ulysses_a2a_testing.so``, what
scripts/device_kernel_check.sh does): the communicator then also runs the test library's launches, the
epoch-checked launch on uneven plans (no violation, output exact) and the fabric copy of both engines
(followed by an exact call: it is ordered with the calls). On the product library those are reported as not
run, and the product library's refusal of the epoch-checked launch, naming the test library, is checked
instead. Exits non-zero on any failure. Multi-rank LSA needs 2+ GPUs: tests/distributed/check_ulysses_h3_native.py.
"""

from __future__ import annotations

import ctypes
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
try:
    import fastvideo_kernel
except ImportError:
    sys.path.insert(0, str(REPO / "fastvideo-kernel"))
    import fastvideo_kernel
import torch  # noqa: E402
from fastvideo_kernel import testing as kernel_testing  # noqa: E402

from fastvideo.distributed.ulysses.native import NativeKernelError, NativeTransport  # noqa: E402
from fastvideo.distributed.ulysses.policy import ORIGINAL_CTAS, Geometry, Plan  # noqa: E402
from fastvideo.distributed.ulysses.transport import ConstructionContext  # noqa: E402
from tests.kernel import native_testing  # noqa: E402

failures: list[str] = []


def check(ok: bool, what: str) -> None:
    print(f"{'PASS' if ok else 'FAIL'} {what}", flush=True)
    if not ok:
        failures.append(what)


def context(device: torch.device, window_bytes: int) -> ConstructionContext:
    # One rank: sharing an object with "every rank" is returning it.
    return ConstructionContext(rank=0, world_size=1, device=device, window_bytes=window_bytes, max_ctas=144,
                               device_group=None, all_gather_object=lambda obj: [obj])


def report_local_throughput(transport: NativeTransport, device: torch.device, window: int) -> None:
    """Informational: the P=1 kernel's copy rate (all shares local: HBM, not NVLink) beside torch's.

    It shows what the addressing and the per-chunk barriers cost on one GPU; it is no NVLink number.
    """
    x = torch.randn(1, 65536, 32, 128, device=device).to(torch.bfloat16)  # 512 MiB
    geom = Geometry.from_input(x.shape, 0, 1, x.dtype)
    rows = window // geom.row_bytes
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def rate(fn, iters: int = 10) -> float:
        fn()
        start.record()
        for _ in range(iters):
            fn()
        stop.record()
        stop.synchronize()
        seconds = start.elapsed_time(stop) / 1e3 / iters
        return 2 * x.numel() * x.element_size() / seconds / 1e9  # bytes read + written

    lines = [f"torch clone: {rate(x.clone):.0f} GB/s"]
    for ctas in (36, 144):
        plan = Plan(ctas, 1, rows, tuned=True)
        lines.append(f"fused P=1 {ctas} CTAs, {plan.num_chunks(geom)} chunks of {rows} rows: "
                     f"{rate(lambda plan=plan: transport.execute(x, geom, plan)):.0f} GB/s")
    print("local copy throughput (informational):", "; ".join(lines), flush=True)


def test_library_launches(transport: NativeTransport, lib, device: torch.device, gen: torch.Generator) -> None:
    """The test library's launches on this communicator, or (on the product library) its refusal of them."""
    if not kernel_testing.is_testing_library(lib):
        print("not run: the epoch-checked launch and the fabric copy (the transport runs the product library; "
              "run this on the test library for them)", flush=True)
        try:
            native_testing.debug_execute(transport, torch.zeros(1, 8, 4, 8, device=device),
                                         Geometry.from_input((1, 8, 4, 8), 0, 1, torch.float32), Plan(36, 1, 3, True))
            check(False, "the product transport refuses the epoch-checked launch")
        except native_testing.TestingUnavailable as exc:
            check(kernel_testing.TESTING_LIBRARY_NAME in str(exc), f"the product library refuses it: {exc}")
        return
    for dtype, shape, plan in ((torch.bfloat16, (3, 257, 8, 128), Plan(36, 2, 100, tuned=True)),
                               (torch.float32, (2, 99, 4, 3), Plan(7, 1, 40, tuned=True))):
        x = torch.randn(shape, generator=gen, device=device).to(dtype)
        geom = Geometry.from_input(x.shape, 0, 1, dtype)
        out, report = native_testing.debug_execute(transport, x, geom, plan)
        torch.cuda.synchronize()
        check(report[0] == 0 and torch.equal(out.view(torch.uint8), x.view(torch.uint8)),
              f"epoch-checked {dtype} {plan.describe(geom)}: {report[0]} violations, P=1 output equals input")
    x = torch.randn(2, 64, 8, 128, generator=gen, device=device).to(torch.bfloat16)
    geom = Geometry.from_input(x.shape, 0, 1, x.dtype)
    for engine in (kernel_testing.FABRIC_COPY_ENGINE, kernel_testing.FABRIC_SM):
        native_testing.fabric_copy(transport, 1 << 20, engine=engine, ctas=132)
        out = transport.execute(x, geom, Plan(144, 1, 20, tuned=True))  # ordered after the fabric copy
        torch.cuda.synchronize()
        check(torch.equal(out.view(torch.uint8), x.view(torch.uint8)), f"fabric copy engine {engine}, then a call")


def main() -> int:
    if not torch.cuda.is_available():
        print("smoke_native_single_rank: no CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    print("library:", json.dumps(fastvideo_kernel.info()))
    print("test library:", json.dumps(kernel_testing.info()))
    transport = NativeTransport()
    cap = transport.capability()
    print("capability:", cap)
    check(cap.present, f"capability present ({cap.detail})")
    if not cap.present:
        return 1
    lib = fastvideo_kernel.load()  # the library the transport loaded (the same path, opened once)
    coresident = ctypes.c_int(0)
    check(lib.fvk_coresident_ctas(0, ctypes.byref(coresident)) == 0 and coresident.value >= 144,
          f"144 CTAs co-resident (device holds {coresident.value})")

    window = 64 << 20
    for step in transport.construction_steps(context(device, window)):
        try:
            step.run()
            check(True, f"construction step {step.name} (collective={step.collective})")
        except Exception as exc:  # noqa: BLE001 - reported as a failure with its message
            check(False, f"construction step {step.name}: {exc}")
            transport.abort()
            return 1
    lsa = transport.lsa_info()
    print("lsa:", lsa)
    check(lsa["lsa_size"] == lsa["nranks"] == 1, f"LSA team covers the communicator: {lsa}")
    bus = transport._bus_id.encode()
    nvlink = ctypes.c_int(-1)
    status = lib.fvk_nvlink_p2p(bus, bus, ctypes.byref(nvlink))
    check(status in (0, 6), f"NVML query answers (GPU with itself, informational): status {status}, "
          f"nvlink={nvlink.value}, {fastvideo_kernel.last_error(lib) if status else 'ok'}")
    topo = transport.topology()
    check(topo.decline is None, f"topology (1 rank, no peers): decline={topo.decline} {topo.detail}")

    gen = torch.Generator(device=device).manual_seed(7)
    side = torch.cuda.Stream(device)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for mode in (0, 1):
            x = torch.randn(3, 257, 8, 128, generator=gen, device=device).to(dtype)
            geom = Geometry.from_input(x.shape, mode, 1, dtype)
            plans = {
                "original": Plan(ORIGINAL_CTAS, geom.B, geom.S, tuned=False),
                "tuned plane": Plan(144, 1, geom.S, tuned=True),
                "tuned rows": Plan(144, 1, 100, tuned=True),
                "tuned 7 ctas": Plan(7, 2, 64, tuned=True),
            }
            for name, plan in plans.items():
                out = transport.execute(x, geom, plan)
                torch.cuda.synchronize()
                check(torch.equal(out.view(torch.uint8), x.view(torch.uint8)),
                      f"{dtype} mode{mode} {name}: P=1 output equals input")
            with torch.cuda.stream(side):  # a stream change: the transport orders it after the last call
                out = transport.execute(x, geom, plans["tuned rows"])
            torch.cuda.synchronize()
            check(torch.equal(out.view(torch.uint8), x.view(torch.uint8)), f"{dtype} mode{mode}: side-stream call")
    odd = torch.randn(2, 9, 4, 3, generator=gen, device=device).to(torch.bfloat16)
    geom = Geometry.from_input(odd.shape, 0, 1, odd.dtype)
    out = transport.execute(odd, geom, Plan(144, 1, 4, tuned=True))
    torch.cuda.synchronize()
    check(torch.equal(out.view(torch.uint8), odd.view(torch.uint8)), "bf16 D=3 (element-wise path)")

    big = Geometry.from_input((4, 8192, 8, 128), 0, 1, torch.bfloat16)  # 64 MiB: exactly the window
    try:
        transport.execute(torch.empty((5, 8192, 8, 128), dtype=torch.bfloat16, device=device),
                          Geometry.from_input((5, 8192, 8, 128), 0, 1, torch.bfloat16),
                          Plan(144, 5, 8192, tuned=True))
        check(False, "a chunk larger than the window is refused")
    except NativeKernelError as exc:
        check("window" in str(exc), f"a chunk larger than the window is refused: {exc}")
    out = transport.execute(torch.ones((4, 8192, 8, 128), dtype=torch.bfloat16, device=device), big,
                            Plan(144, 4, 8192, tuned=True))
    torch.cuda.synchronize()
    check(bool((out == 1).all()), "a chunk of exactly the window size")
    bad = fastvideo_kernel.Call(size=ctypes.sizeof(fastvideo_kernel.Call), kind=fastvideo_kernel.KIND_SM, mode=0,
                                dtype=3, ctas=145, B=2, S=9, H=4, D=3, planes_per_chunk=1, rows_per_chunk=9)
    status = lib.fvk_launch(transport._handle, ctypes.byref(bad), odd.data_ptr(), out.data_ptr(),
                            torch.cuda.current_stream().cuda_stream, None)
    check(status != 0 and "ctas" in fastvideo_kernel.last_error(lib),
          f"ctas=145 refused: {fastvideo_kernel.last_error(lib)}")
    test_library_launches(transport, lib, device, gen)

    report_local_throughput(transport, device, window)

    try:
        transport.destroy()
        check(True, "destroy (devcomm, deregister, free, comm destroy)")
    except NativeKernelError as exc:
        check(False, f"destroy: {exc}")

    partial = NativeTransport()
    partial.capability()
    steps = partial.construction_steps(context(device, 1 << 20))
    for step in steps[:4]:  # up to the window allocation, then a local abort
        step.run()
    partial.abort()
    check(partial._handle is None, "abort after a partial construction")

    print(f"{'OK' if not failures else 'FAILED'}: {len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
