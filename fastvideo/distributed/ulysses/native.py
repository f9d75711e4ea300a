"""The native transport: the fused all-to-all kernel of ``fastvideo-kernel`` (NCCL device API).

Importing this module never loads the library and never fails: a missing or unusable kernel is a
``Capability`` with a decline reason, reported by ``capability()``.

Construction (``construction_steps``; the helper votes before each step, ``collective`` steps are
entered by every rank only when every rank succeeded so far):

==================  ==========  ==============================================================
step                collective  what
==================  ==========  ==============================================================
create              no          context on this rank's device; rank 0 makes the NCCL unique id
exchange            yes         share the unique id (from rank 0) and every rank's PCI bus id
comm_init           yes         ``ncclCommInitRank`` over exactly the SP group
window_alloc        no          ``ncclMemAlloc`` of the agreed window capacity
window_register     yes         ``ncclCommWindowRegister(NCCL_WIN_COLL_SYMMETRIC)``
devcomm_create      yes         ``ncclDevCommCreate`` with 144 LSA barriers (one per CTA)
==================  ==========  ==============================================================

``topology()`` then declines with ``NOT_LSA`` unless the LSA team covers the communicator, and
with ``NOT_NVLINK`` unless NVML reports NVLink P2P to every peer (a check it cannot make declines).
"""

from __future__ import annotations

import ctypes
import os
from typing import Any, NamedTuple

import torch

from fastvideo.distributed.ulysses.contract import DeclineReason, dtype_code
from fastvideo.distributed.ulysses.policy import ENGINE_CE, KERNEL_DTYPES, MAX_CTAS, ORIGINAL_CTAS, Geometry, Plan
from fastvideo.distributed.ulysses.transport import (
    ENTRY_CAPTURE,
    ENTRY_CE,
    ENTRY_CE_CAPTURE,
    ENTRY_ORIGINAL,
    ENTRY_TUNED,
    ENTRY_UNEVEN,
    Capability,
    ConstructionContext,
    Step,
    TopologyReport,
    Transport,
    VoteNotStarted,
    output_shape,
)

# ABI 1 (before 2026-11-29) laid chunks out in the window at the current chunk's stride: wrong data
# whenever a plan's chunks differ in size (found on 2x H200). Such a build must never run.
MIN_ABI_VERSION = 2
# Completion events recorded round-robin, one per call, for the helper's watchdog (created once, so
# the hot path allocates none). Reusing one re-records it for a later call, which completes no earlier:
# the watchdog then sees the older call late, never early.
EVENT_RING = 16


# The current stream's raw handle in one call (absent from CPU builds of torch: ``_current_stream`` then uses
# ``torch.cuda.current_stream``).
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


class _Launch(NamedTuple):
    """One signature's launch: the entry point's name and function, its fixed arguments, the output shape,
    its entry number for ``fvk_voted_launch``, and every argument of the tuned form (what ``fvk_voted_launch``
    and the captured entry points take after the pointers)."""

    name: str
    fn: Any
    args: tuple[int, ...]
    out_shape: tuple[int, ...]
    entry: int  # fvk_voted_launch: 0 original, 1 tuned, 2 copy engine
    tuned_args: tuple[int, ...]


class NativeKernelError(RuntimeError):
    """A native call failed; the message carries the library's CUDA/NCCL error text."""


def nccl_libraries_mapped(maps_text: str) -> set[str]:
    """Distinct ``libnccl.so*`` files mapped in a ``/proc/<pid>/maps`` text (by resolved path)."""
    paths = set()
    for line in maps_text.splitlines():
        fields = line.split(maxsplit=5)
        path = fields[5].strip() if len(fields) == 6 else ""
        if os.path.basename(path).startswith("libnccl.so"):
            paths.add(os.path.realpath(path))
    return paths


def nccl_mismatch(build: int, runtime: int) -> str | None:
    """Why a runtime NCCL cannot serve a build (the device API is header-inline), or None."""
    from fastvideo_kernel import nccl_version_tuple

    b, r = nccl_version_tuple(build), nccl_version_tuple(runtime)
    if b[:2] != r[:2]:
        return f"kernel built against NCCL {'.'.join(map(str, b))}, process runs NCCL {'.'.join(map(str, r))}"
    return None


class NativeTransport(Transport):
    """The fused route on CUDA: one window, one device communicator, one call at a time."""

    name = "native"

    def __init__(self) -> None:
        self._lib: Any = None
        self._entries: frozenset[str] = frozenset()
        self._handle: ctypes.c_void_p | None = None
        self._ctx: ConstructionContext | None = None
        self._unique_id: bytes | None = None
        self._bus_id = ""
        self._bus_ids: list[str] = []
        self._event: torch.cuda.Event | None = None  # the last call's completion event
        self._events: list[torch.cuda.Event] = []
        self._calls = 0
        self._launches: dict[tuple, _Launch] = {}  # per (geometry, plan, dtype): see _launch_for
        self._stage, self._vote_ns = ctypes.c_int(0), ctypes.c_int64(0)  # fvk_voted_launch's outputs
        self._stage_ref, self._vote_ns_ref = ctypes.byref(self._stage), ctypes.byref(self._vote_ns)
        self._streams: dict[tuple[int, int], torch.cuda.Stream] = {}  # (device, raw handle) -> Stream

    # ------------------------------------------------------------------ probing (local)

    def capability(self) -> Capability:
        def declined(reason: DeclineReason, detail: str, **known: Any) -> Capability:
            return Capability(self.name, False, decline=reason, detail=detail, **known)

        try:
            import fastvideo_kernel
        except ImportError as exc:
            return declined(DeclineReason.TRANSPORT_MISSING, f"fastvideo_kernel is not installed ({exc})")
        try:
            lib = fastvideo_kernel.load()
        except fastvideo_kernel.KernelUnavailable as exc:
            return declined(DeclineReason.TRANSPORT_MISSING, str(exc))
        abi = lib.fvk_abi_version()
        # Never offered uneven plans: the launches here pass no split tables (their kernels move even shares only),
        # so calls with uneven splits decline uneven_splits on every rank, whatever a build exports.
        entries = fastvideo_kernel.entry_points(lib) - {ENTRY_UNEVEN}
        known: dict[str, Any] = {"abi_version": abi, "entry_points": entries}
        if abi < MIN_ABI_VERSION or ENTRY_ORIGINAL not in entries:
            return declined(DeclineReason.TRANSPORT_TOO_OLD,
                            f"kernel ABI {abi} with entry points {sorted(entries)}; need ABI >= {MIN_ABI_VERSION} "
                            f"with '{ENTRY_ORIGINAL}' (ABI 1 builds move wrong data with uneven chunks: rebuild)",
                            **known)
        build = lib.fvk_nccl_build_version()
        runtime = ctypes.c_int(0)
        if lib.fvk_nccl_runtime_version(ctypes.byref(runtime)) != 0:
            return declined(DeclineReason.NCCL_RUNTIME_MISMATCH,
                            f"ncclGetVersion failed: {fastvideo_kernel.last_error(lib)}", **known)
        known.update(nccl_build=build, nccl_runtime=runtime.value)
        why = nccl_mismatch(build, runtime.value)
        if why:
            return declined(DeclineReason.NCCL_RUNTIME_MISMATCH, why, **known)
        try:
            with open("/proc/self/maps") as f:
                copies = nccl_libraries_mapped(f.read())
        except OSError as exc:
            return declined(DeclineReason.NCCL_RUNTIME_MISMATCH, f"cannot read /proc/self/maps: {exc}", **known)
        if len(copies) != 1:
            return declined(DeclineReason.NCCL_RUNTIME_MISMATCH,
                            f"expected exactly one libnccl.so mapped, found {sorted(copies)}", **known)
        self._lib, self._entries = lib, entries
        return Capability(self.name, True, abi_version=abi, entry_points=entries, nccl_build=build,
                          nccl_runtime=runtime.value, dtypes=KERNEL_DTYPES, supports_unaligned=True,
                          detail=f"{fastvideo_kernel.library_path()}")

    # ------------------------------------------------------------------ construction

    def _check(self, status: int, what: str) -> None:
        if status != 0:
            import fastvideo_kernel

            raise NativeKernelError(f"{what}: {fastvideo_kernel.last_error(self._lib)} (status {status})")

    def construction_steps(self, ctx: ConstructionContext) -> list[Step]:
        if self._lib is None:
            cap = self.capability()
            if not cap.present:
                raise NativeKernelError(f"kernel unavailable: {cap.detail}")
        lib = self._lib
        self._ctx = ctx
        self._launches.clear()  # built for another communicator's world size
        self._streams.clear()
        device = ctx.device.index if ctx.device.index is not None else torch.cuda.current_device()

        def create() -> None:
            handle = ctypes.c_void_p()
            self._check(lib.fvk_create(device, ctypes.byref(handle)), "fvk_create")
            self._handle = handle
            bus = ctypes.create_string_buffer(32)
            self._check(lib.fvk_pci_bus_id(device, bus, len(bus)), "fvk_pci_bus_id")
            self._bus_id = bus.value.decode()
            if ctx.rank == 0:
                uid = ctypes.create_string_buffer(lib.fvk_unique_id_bytes())
                self._check(lib.fvk_get_unique_id(uid, len(uid)), "fvk_get_unique_id")
                self._unique_id = uid.raw

        def exchange() -> None:
            gathered = ctx.all_gather_object((self._unique_id, self._bus_id))  # one exchange for both
            self._unique_id = gathered[0][0]  # rank 0's
            self._bus_ids = [bus for _, bus in gathered]

        def comm_init() -> None:
            uid = self._unique_id
            assert uid is not None
            self._check(lib.fvk_comm_init(self._handle, uid, len(uid), ctx.world_size, ctx.rank), "fvk_comm_init")

        def window_alloc() -> None:
            self._check(lib.fvk_window_alloc(self._handle, ctx.window_bytes), "fvk_window_alloc")

        def window_register() -> None:
            self._check(lib.fvk_window_register(self._handle), "fvk_window_register")

        def devcomm_create() -> None:
            if ctx.max_ctas > lib.fvk_max_ctas():
                raise NativeKernelError(f"helper wants {ctx.max_ctas} CTAs, the kernel reserves {lib.fvk_max_ctas()}")
            self._check(lib.fvk_devcomm_create(self._handle), "fvk_devcomm_create")
            self._events = [torch.cuda.Event() for _ in range(EVENT_RING)]
            self._event = self._events[-1]

        return [
            Step("create", create),
            Step("exchange", exchange, collective=True),
            Step("comm_init", comm_init, collective=True),
            Step("window_alloc", window_alloc),
            Step("window_register", window_register, collective=True),
            Step("devcomm_create", devcomm_create, collective=True),
        ]

    def lsa_info(self) -> dict[str, int]:
        """nranks, rank, lsa_size, lsa_rank of the device communicator."""
        values = [ctypes.c_int(0) for _ in range(4)]
        self._check(self._lib.fvk_lsa_info(self._handle, *(ctypes.byref(v) for v in values)), "fvk_lsa_info")
        return dict(zip(("nranks", "rank", "lsa_size", "lsa_rank"), (v.value for v in values), strict=True))

    def topology(self) -> TopologyReport:
        lsa = self.lsa_info()
        extras: dict[str, object] = {**lsa, "bus_ids": list(self._bus_ids)}
        if lsa["lsa_size"] != lsa["nranks"] or lsa["lsa_rank"] != lsa["rank"]:
            return TopologyReport(DeclineReason.NOT_LSA,
                                  f"LSA team of {lsa['lsa_size']} covers only part of the {lsa['nranks']} SP ranks",
                                  extras)
        for peer, bus in enumerate(self._bus_ids):
            if bus == self._bus_id:
                continue
            nvlink = ctypes.c_int(0)
            status = self._lib.fvk_nvlink_p2p(self._bus_id.encode(), bus.encode(), ctypes.byref(nvlink))
            if status != 0:
                import fastvideo_kernel

                return TopologyReport(DeclineReason.NOT_NVLINK,
                                      f"cannot verify NVLink to rank {peer} ({bus}): "
                                      f"{fastvideo_kernel.last_error(self._lib)}", extras)
            if not nvlink.value:
                return TopologyReport(DeclineReason.NOT_NVLINK,
                                      f"rank {peer} ({bus}) is reachable from {self._bus_id} only without NVLink",
                                      extras)
        return TopologyReport(None, "", extras)

    # ------------------------------------------------------------------ per call

    def _launch_for(self, geom: Geometry, plan: Plan, dtype: torch.dtype) -> _Launch:
        """The entry point and the fixed arguments of ``plan`` on ``geom`` (everything but the pointers and
        the stream), built once per signature: a DiT's layers repeat a few signatures."""
        key = (geom, plan, dtype)
        launch = self._launches.get(key)
        if launch is not None:
            return launch
        if geom.world_size != self._ctx.world_size:
            raise NativeKernelError(f"geometry for SP size {geom.world_size}, communicator has {self._ctx.world_size}")
        whole = plan.planes_per_chunk >= geom.B and plan.rows_per_chunk >= geom.S
        fixed = (geom.mode, dtype_code(dtype), geom.B, geom.S, geom.H, geom.D)
        chunking = (plan.ctas, plan.planes_per_chunk, plan.rows_per_chunk)
        shape = output_shape(geom)
        if plan.engine == ENGINE_CE:
            if ENTRY_CE not in self._entries:
                raise NativeKernelError(f"plan {plan} needs the copy-engine entry point, which this kernel build lacks")
            launch = _Launch("fvk_a2a_ce", self._lib.fvk_a2a_ce, fixed + chunking, shape, 2, fixed + chunking)
        elif plan.ctas == ORIGINAL_CTAS and whole and ENTRY_ORIGINAL in self._entries:
            launch = _Launch("fvk_a2a_original", self._lib.fvk_a2a_original, fixed, shape, 0,
                             (*fixed, ORIGINAL_CTAS, geom.B, geom.S))
        elif ENTRY_TUNED in self._entries:
            if plan.ctas > MAX_CTAS:
                raise NativeKernelError(f"plan asks for {plan.ctas} CTAs, at most {MAX_CTAS}")
            launch = _Launch("fvk_a2a_tuned", self._lib.fvk_a2a_tuned, fixed + chunking, shape, 1, fixed + chunking)
        else:
            raise NativeKernelError(f"plan {plan} needs the tuned entry point, which this kernel build lacks")
        if len(self._launches) >= 1024:  # bounded: a pathological job re-builds
            self._launches.clear()
        self._launches[key] = launch
        return launch

    def _current_stream(self, device: torch.device) -> tuple[int, torch.cuda.Stream]:
        """(raw cudaStream_t, its torch Stream) of ``device``'s current stream. ``torch.cuda.current_stream``
        builds a Stream object per call (about 3 us on the H200 host, measure_launch_host.py); the raw handle
        is one call, and a Stream object per handle is kept (a Stream resolves to its handle, so the one kept
        for a handle records on that same CUDA stream)."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        raw = _raw_stream(index) if _raw_stream is not None else None
        # Keyed by device too: every device's default stream has the raw handle 0.
        stream = self._streams.get((index, raw)) if raw is not None else None
        if stream is None:
            stream = torch.cuda.current_stream(device)
            raw = stream.cuda_stream
            if len(self._streams) >= 64:
                self._streams.clear()
            self._streams[(index, raw)] = stream
        return raw, stream

    def fuses_vote(self, vote) -> bool:
        """The library runs the exchange and the launch in one call (``fvk_voted_launch``) where the per-call
        vote is the same-host shared-memory one (an object with ``native_args``) and this build has it."""
        return self._lib is not None and hasattr(self._lib, "fvk_voted_launch") and hasattr(vote, "native_args")

    def execute(self, x: torch.Tensor, geom: Geometry, plan: Plan, *, capture: bool = False, vote=None,
                fields: list[int] | None = None) -> torch.Tensor | None:
        """``Transport.execute`` on the kernel library. Eager calls share one window and one set of barrier
        slots; the library orders a call after the previous one when the stream changes (its own completion
        event), so nothing is waited for here. A captured call freezes the launch arguments (pointers, geometry,
        plan) into the graph and allocates the output from the graph's pool; the library orders replays against
        eager calls and each other through its completion event (ulysses_a2a.h). With ``vote``, one library
        call exchanges ``fields`` and launches where every rank's fields equal these (``fvk_vote_would_run``)."""
        try:  # everything before the exchange: with a vote, a failure here leaves this rank unvoted
            if self._handle is None or self._event is None or self._ctx is None:
                raise NativeKernelError("execute before construction (or after destroy)")
            launch = self._launch_for(geom, plan, x.dtype)
            out = torch.empty(launch.out_shape, dtype=x.dtype, device=x.device)
            if capture:
                name = "fvk_a2a_ce_captured" if launch.entry == 2 else "fvk_a2a_captured"
                stream = torch.cuda.current_stream(x.device)
                self._check(getattr(self._lib, name)(self._handle, x.data_ptr(), out.data_ptr(), *launch.tuned_args,
                                                     stream.cuda_stream), name)
                return out  # nothing runs at capture: no completion to watch
            raw, stream = self._current_stream(x.device)
            if vote is not None:
                handle, send, recv, timeout = vote.native_args(fields)
        except Exception as exc:
            if vote is None:
                raise
            raise VoteNotStarted(f"before the vote: {type(exc).__name__}: {exc}") from exc
        if vote is None:
            self._check(launch.fn(self._handle, x.data_ptr(), out.data_ptr(), *launch.args, raw), launch.name)
        else:
            status = self._lib.fvk_voted_launch(handle, send, recv, timeout, self._stage_ref, self._vote_ns_ref,
                                                self._handle, launch.entry, x.data_ptr(), out.data_ptr(),
                                                *launch.tuned_args, raw)
            stage = self._stage.value
            vote.last_s = self._vote_ns.value * 1e-9
            if stage < 0:
                import fastvideo_kernel

                raise VoteNotStarted(f"fvk_voted_launch refused before the vote: "
                                     f"{fastvideo_kernel.last_error(self._lib)}")
            if stage == 0:
                raise vote.failure(status)
            if stage == 1:
                return None  # exchanged, not launched: the helper decides from vote.rows
            self._check(status, f"fvk_voted_launch ({launch.name})")
        self._record_completion(stream)
        return out

    def capture_decline(self, geom: Geometry, plan: Plan) -> str | None:
        """None when ``plan`` can be frozen into the graph being captured: a plan word this code knows (CTAs,
        planes and rows per chunk, tuned, engine: any other plan kind is refused until it is shown to need
        no host work per call), and this build's capturable entry point for its engine (``fvk_a2a_captured``
        for the fused kernel, ``fvk_a2a_ce_captured`` for the copy-engine kind)."""
        entry, symbol = ((ENTRY_CE_CAPTURE, "fvk_a2a_ce_captured") if plan.engine == ENGINE_CE
                         else (ENTRY_CAPTURE, "fvk_a2a_captured"))
        if entry not in self._entries:
            return (f"this kernel build has no {symbol} (older than the capturable {plan.engine} kind): rebuild "
                    "fastvideo-kernel to capture it")
        if Plan(plan.ctas, plan.planes_per_chunk, plan.rows_per_chunk, plan.tuned, plan.engine).word != plan.word:
            return f"plan word {plan.word:#x} is not one this transport can freeze"
        if plan.ctas > MAX_CTAS:
            return f"plan asks for {plan.ctas} CTAs, at most {MAX_CTAS}"
        return None

    def debug_execute(self, x: torch.Tensor, geom: Geometry, plan: Plan, *, legacy: bool = False
                      ) -> tuple[torch.Tensor, list[int]]:
        """The fused kernel with the epoch checker (``fvk_a2a_debug``): collective, blocking, for gates only.

        Returns the output and the report (violations, then the first violation's kind | rank << 8 |
        peer << 16, granule, stamp found, stamp written). ``legacy`` runs the pre-fix window layout (a
        negative control: expect violations on uneven plans). The window must hold the plan's bytes
        plus 8 bytes of stamps per partition granule. Bypasses the vote: every rank must call it with
        the same geometry and plan, in the same order.
        """
        if self._handle is None or self._event is None:
            raise NativeKernelError("debug_execute before construction (or after destroy)")
        if "debug" not in self._entries:
            raise NativeKernelError("this kernel build has no fvk_a2a_debug")
        import fastvideo_kernel

        out = torch.empty(output_shape(geom), dtype=x.dtype, device=x.device)
        report = torch.zeros(5, dtype=torch.int64, device=x.device)
        stream = torch.cuda.current_stream(x.device)
        flags = fastvideo_kernel.DEBUG_EPOCH_CHECK | (fastvideo_kernel.DEBUG_LEGACY_LAYOUT if legacy else 0)
        status = self._lib.fvk_a2a_debug(self._handle, x.data_ptr(), out.data_ptr(), geom.mode, dtype_code(x.dtype),
                                         geom.B, geom.S, geom.H, geom.D, plan.ctas, plan.planes_per_chunk,
                                         plan.rows_per_chunk, flags, report.data_ptr(), stream.cuda_stream)
        self._check(status, "fvk_a2a_debug")
        self._record_completion(stream)
        return out, [int(v) for v in report.cpu().tolist()]

    def fabric_copy(self, nbytes: int, *, engine: int, ctas: int = 132) -> None:
        """The benchmark's fabric limit (``fvk_fabric_copy``): barrier, every rank copies ``nbytes`` into every
        peer's window at once, barrier; ``engine`` 0 the copy engines, 1 SM stores. Collective, enqueued on
        the current stream; every rank must call it with the same arguments. Bypasses the vote."""
        if self._handle is None or self._event is None:
            raise NativeKernelError("fabric_copy before construction (or after destroy)")
        if "fabric" not in self._entries:
            raise NativeKernelError("this kernel build has no fvk_fabric_copy")
        stream = torch.cuda.current_stream()
        self._check(self._lib.fvk_fabric_copy(self._handle, nbytes, engine, ctas, stream.cuda_stream),
                    "fvk_fabric_copy")
        self._record_completion(stream)

    def _record_completion(self, stream: torch.cuda.Stream) -> None:
        """After every launch: the call's completion event, round-robin from the ring, for the watchdog."""
        event = self._events[self._calls % EVENT_RING]
        self._calls += 1
        event.record(stream)
        self._event = event

    def watchdog_thread_setup(self) -> None:
        """Run in the helper's watchdog thread: relax that thread's CUDA stream-capture mode, so its event
        queries never invalidate a graph capture begun in another thread (torch's NCCL watchdog does the
        same). A build without ``fvk_relax_capture_mode`` leaves the mode as it is."""
        if self._lib is not None and hasattr(self._lib, "fvk_relax_capture_mode"):
            self._check(self._lib.fvk_relax_capture_mode(), "fvk_relax_capture_mode")

    def completion_marker(self) -> torch.cuda.Event | None:
        """The last call's completion event (``query()`` only; the helper's watchdog tracks it)."""
        return self._event

    # ------------------------------------------------------------------ teardown

    def abort(self) -> None:
        if self._handle is not None:
            # Local and best effort: peers may be anywhere after a failed step; errors are moot here.
            self._lib.fvk_abort(self._handle)
        self._reset()

    def destroy(self) -> None:
        if self._handle is None:
            return
        handle = self._handle
        self._reset()
        self._check(self._lib.fvk_destroy(handle), "fvk_destroy")

    def _reset(self) -> None:
        self._handle = None
        self._ctx = None
        self._launches.clear()
        self._streams.clear()
        self._event = None
        self._events = []
        self._unique_id = None
