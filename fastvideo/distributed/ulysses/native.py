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
from typing import Any

import torch

from fastvideo.distributed.ulysses import hot
from fastvideo.distributed.ulysses.caches import bounded_put
from fastvideo.distributed.ulysses.contract import DeclineReason, Field
from fastvideo.distributed.ulysses.launch import Launch, build_launch, refusal
from fastvideo.distributed.ulysses.nccl_runtime import nccl_libraries_mapped, nccl_mismatch
from fastvideo.distributed.ulysses.policy import ENGINE_CE, KERNEL_DTYPES, Geometry, Plan
from fastvideo.distributed.ulysses.transport import (
    ENTRIES,
    ENTRY_CAPTURE,
    ENTRY_CE_CAPTURE,
    Capability,
    ConstructionContext,
    Step,
    TopologyReport,
    Transport,
    VoteNotStarted,
)

# Completion events recorded round-robin, one per call, for the helper's watchdog (created once, so
# the hot path allocates none). Reusing one re-records it for a later call, which completes no earlier:
# the watchdog then sees the older call late, never early.
EVENT_RING = 16
_SEQ = int(Field.SEQ)  # the send row's SEQ word, written on every voted launch


# The current stream's raw handle in one call (absent from CPU builds of torch: ``_current_raw`` then uses
# ``torch.cuda.current_stream``).
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


class NativeKernelError(RuntimeError):
    """A native call failed; the message carries the library's CUDA/NCCL error text."""


class NativeTransport(Transport):
    """The fused route on CUDA: one window, one device communicator, one call at a time."""

    name = "native"

    def __init__(self) -> None:
        self._lib: Any = None
        self._fvk: Any = None  # the fastvideo_kernel loader module, once capability() imported it
        self._offerings: frozenset[str] = frozenset()  # what the loaded build offers (fastvideo_kernel.probe)
        self._entries: frozenset[str] = frozenset()  # the launch offerings among them (transport.ENTRIES)
        self._bus_id = ""
        self._bus_ids: list[str] = []
        self._calls = 0
        self._hot: hot.HotPath | None = None  # the hot signatures' table (hot_path), built after the first
        self._reset()  # what a construction builds, empty

    # ------------------------------------------------------------------ probing (local)

    def capability(self) -> Capability:
        """Local (no collective), host-only, never raises: what this rank's kernel build offers. The loader's probe
        (``fastvideo_kernel.probe``: the offerings of its ABI), then the NCCL runtime checks; a missing or
        unusable build is a decline with its reason."""
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
        found = fastvideo_kernel.probe(lib)
        # ENTRY_UNEVEN where the build offers it (ABI 5 and later); without it uneven calls decline uneven_splits.
        entries = found.offerings & ENTRIES
        known: dict[str, Any] = {"abi_version": found.abi, "entry_points": entries}
        if found.abi < fastvideo_kernel.OLDEST_ABI:
            return declined(DeclineReason.TRANSPORT_TOO_OLD, found.problem, **known)
        if found.problem:
            return declined(DeclineReason.TRANSPORT_MISSING, found.problem, **known)
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
        self._lib, self._fvk, self._offerings, self._entries = lib, fastvideo_kernel, found.offerings, entries
        return Capability(self.name, True, dtypes=KERNEL_DTYPES, supports_unaligned=True,
                          detail=f"{fastvideo_kernel.library_path()}", **known)

    # ------------------------------------------------------------------ construction

    def _check(self, status: int, what: str) -> None:
        if status != 0:
            raise NativeKernelError(f"{what}: {self._fvk.last_error(self._lib)} (status {status})")

    def construction_steps(self, ctx: ConstructionContext) -> list[Step]:
        if self._lib is None:
            cap = self.capability()
            if not cap.present:
                raise NativeKernelError(f"kernel unavailable: {cap.detail}")
        lib = self._lib
        self._reset()  # what was built for another communicator (its world size) is dropped
        self._ctx = ctx
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
        if lsa["lsa_size"] != lsa["nranks"] or lsa["lsa_rank"] != lsa["rank"]:
            return TopologyReport(DeclineReason.NOT_LSA,
                                  f"LSA team of {lsa['lsa_size']} covers only part of the {lsa['nranks']} SP ranks")
        for peer, bus in enumerate(self._bus_ids):
            if bus == self._bus_id:
                continue
            nvlink = ctypes.c_int(0)
            status = self._lib.fvk_nvlink_p2p(self._bus_id.encode(), bus.encode(), ctypes.byref(nvlink))
            if status != 0 or not nvlink.value:
                return TopologyReport(DeclineReason.NOT_NVLINK, f"cannot verify NVLink to rank {peer} ({bus}): "
                                      f"{self._fvk.last_error(self._lib)}" if status != 0 else
                                      f"rank {peer} ({bus}) is reachable from {self._bus_id} only without NVLink")
        return TopologyReport()

    # ------------------------------------------------------------------ per call

    def _launch_for(self, geom: Geometry, plan: Plan, dtype: torch.dtype, capture: bool) -> Launch:
        """The library call and call description of ``plan`` on ``geom`` (everything but the pointers, the stream
        and the vote), built once per signature: a DiT's layers repeat a few signatures. Raises
        ``NativeKernelError`` (nothing cached) for a plan this build does not offer."""
        # First by the objects' identities: the planner hands every call of a signature the same Geometry and
        # Plan, and their dataclass hashes are Python calls. The entry holds both objects, so while it lives their
        # ids are theirs alone.
        by_object = (id(geom), id(plan), dtype, capture)
        held = self._by_object.get(by_object)
        if held is not None:
            return held[0]
        key = (geom, plan, dtype, capture)
        launch = self._launches.get(key)
        if launch is None:
            if geom.world_size != self._ctx.world_size:
                raise NativeKernelError(
                    f"geometry for SP size {geom.world_size}, communicator has {self._ctx.world_size}")
            try:
                launch = build_launch(self._fvk, self._lib, self._offerings, self._entries, geom, plan, dtype,
                                      capture, self._ctx.rank)
            except ValueError as exc:
                raise NativeKernelError(str(exc)) from None
            bounded_put(self._launches, key, launch, 1024)  # bounded: a pathological job re-builds
        bounded_put(self._by_object, by_object, (launch, geom, plan), 1024)
        return launch

    def _current_raw(self, x: torch.Tensor) -> tuple[int, int]:
        """(device index, raw cudaStream_t) of the current stream of ``x``'s device, before the launch: two calls.
        ``_stream`` finds its Stream object after it (the completion record needs one; the launch does not)."""
        index = x.get_device()
        if _raw_stream is not None:
            return index, _raw_stream(index)
        return index, torch.cuda.current_stream(index).cuda_stream

    def _stream(self, index: int, raw: int) -> torch.cuda.Stream:
        """The Stream object of raw handle ``raw`` on device ``index``: one ``torch.cuda.current_stream`` per (device,
        handle), then the one kept (``torch.cuda.current_stream`` builds a Stream object per call; a Stream resolves
        to its handle, so the one kept for a handle records on that same CUDA stream). Keyed by device too: every
        device's default stream has the raw handle 0."""
        stream = self._streams.get((index, raw))
        if stream is None:
            # The same thread's current stream on the same device as ``_current_raw`` read just before the launch,
            # nothing between them switching it: the Stream of ``raw``.
            stream = bounded_put(self._streams, (index, raw), torch.cuda.current_stream(index), 64)
        return stream

    def _vote_for(self, vote, fields: tuple[int, ...], seq: int) -> Any:
        """The ``fvk_vote`` (by reference) that points the library at ``vote``'s handle and buffers, built once per
        vote channel, with this call's send row: the vote's row for ``fields`` (looked up in ``ShmVote.send_rows``,
        made by ``ShmVote.send_row`` at a proposal's first call) with SEQ = ``seq`` written into it. Raises the
        vote's failure once it is destroyed (its handle is then gone)."""
        if vote is not self._vote_owner:
            self._close_hot()  # its table points at the previous vote's fvk_vote
            handle, recv, timeout = vote.native_channel()
            fvk = self._fvk
            self._vote = fvk.Vote(size=ctypes.sizeof(fvk.Vote), stage=fvk.STAGE_REFUSED, handle=handle.value,
                                  fields=0, votes=recv.value, timeout_ns=timeout.value)
            self._vote_ref, self._vote_owner = ctypes.byref(self._vote), vote
        if vote.destroyed:
            raise vote.failure(-1)
        row = vote.send_rows.get(fields) or vote.send_row(fields)
        row[0][_SEQ] = seq
        self._vote.fields = row[1]
        return self._vote_ref

    def fuses_vote(self, vote) -> bool:
        """Local, host-only. Whether ``execute`` can run the exchange and the launch in one library call (the voted
        form of ``fvk_launch``): where the per-call vote is the same-host shared-memory one (an object with
        ``send_row``) and this build offers it."""
        return self._fvk is not None and self._fvk.VOTED in self._offerings and hasattr(vote, "send_row")

    def execute(self, x: torch.Tensor, geom: Geometry, plan: Plan, *, capture: bool = False, vote=None,
                fields: tuple[int, ...] = (), seq: int = 0) -> torch.Tensor | None:
        """Collective; host-blocking only for a vote; capture-safe with ``capture`` (``Transport.execute``).

        One library call (``fvk_launch`` with the signature's cached call description; ``fvk_a2a_original`` on
        a build older than it). Eager calls share one window and one set of barrier slots; the library orders
        a call after the previous one when the stream changes (its own completion event), so nothing is waited
        for here. A captured call freezes the launch arguments (pointers, geometry, plan) into the graph and
        allocates the output from the graph's pool; the library orders replays against eager calls and each
        other through its completion event (ulysses_a2a.h). With ``vote``, the same call exchanges ``fields`` (with
        SEQ = ``seq``) and launches where every rank's fields equal these (``fvk_vote_would_run``)."""
        try:  # everything before the exchange: with a vote, a failure here leaves this rank unvoted
            if self._handle is None or self._event is None or self._ctx is None:
                raise NativeKernelError("execute before construction (or after destroy)")
            launch = self._launch_for(geom, plan, geom.dtype, capture)  # the geometry's dtype is the input's
            out = x.new_empty(launch.out_shape)  # x's dtype and device, positional: the cheapest allocation call
            index, raw = self._current_raw(x)
            vote_ref = self._vote_for(vote, fields, seq) if vote is not None else None
        except Exception as exc:
            if vote is None:
                raise
            raise VoteNotStarted(f"before the vote: {type(exc).__name__}: {exc}") from exc
        status = launch.fn(self._handle, launch.call, x.data_ptr(), out.data_ptr(), raw, vote_ref)
        return self._finish(out, status, vote, launch, plan, index, raw, capture)

    def _finish(self, out: torch.Tensor, status: int, vote, launch: Launch, plan: Plan, index: int, raw: int,
                capture: bool = False) -> torch.Tensor | None:
        """After the library call: the voted form's stage (a refusal, a failed exchange, no launch: None), the
        status, the completion record. The same for ``execute`` and the hot path."""
        if vote is not None:
            stage = self._vote.stage
            vote.last_s = self._vote.vote_ns * 1e-9
            if stage == self._fvk.STAGE_REFUSED:
                raise VoteNotStarted(f"the voted launch refused before the vote: {self._fvk.last_error(self._lib)}")
            if stage == self._fvk.STAGE_EXCHANGE_FAILED:
                raise vote.failure(status)
            if stage == self._fvk.STAGE_NOT_LAUNCHED:
                return None  # exchanged, not launched: the helper decides from vote.rows
        if status != 0:  # the message is built only on failure: the hot path formats nothing
            self._check(status, f"fvk_launch ({launch.entry} plan {plan})")
        if not capture:  # nothing runs at capture: no completion to watch
            # The call's completion event, round-robin from the ring, for the watchdog.
            event = self._events[self._calls % EVENT_RING]
            self._calls += 1
            event.record(self._stream(index, raw))
            self._event = event
        return out

    # ------------------------------------------------------------------ the hot path (hot.py)

    def hot_decline(self) -> str:
        """Local, never raises. Why this transport cannot keep hot signatures (the extension's load), or ""."""
        if self._fvk is None or self._fvk.VOTED not in self._offerings:
            return "this kernel build has no voted launch"
        return hot.load(self._fvk.library_path().parent)[1]

    def hot_path(self, vote) -> hot.HotPath | None:
        """Local. The hot-path table for ``vote`` (built after its first voted launch), or None where none."""
        if self._hot is None and vote is self._vote_owner and self._vote is not None:
            module = hot.load(self._fvk.library_path().parent)[0]
            if module is not None:
                self._hot = hot.HotPath(module, ctypes.cast(self._lib.fvk_launch, ctypes.c_void_p).value,
                                        self._handle.value or 0, ctypes.addressof(self._vote), self._launch_for,
                                        self._finish)
        return self._hot

    def _close_hot(self) -> None:
        table, self._hot = self._hot, None
        if table is not None:
            table.close()

    def capture_decline(self, geom: Geometry, plan: Plan) -> str | None:
        """Local, host-only. None when ``plan`` can be frozen into the graph being captured: a plan word this code
        knows (CTAs, planes and rows per chunk, tuned, engine: any other plan kind is refused until it is shown
        to need no host work per call), and this build's capture offering for its engine (``capture`` for the
        fused kernel, ``ce_capture`` for the copy-engine kind)."""
        if Plan(plan.ctas, plan.planes_per_chunk, plan.rows_per_chunk, plan.tuned, plan.engine).word != plan.word:
            return f"plan word {plan.word:#x} is not one this transport can freeze"
        return refusal(plan, geom, self._entries, ENTRY_CE_CAPTURE if plan.engine == ENGINE_CE else ENTRY_CAPTURE)

    def native_context(self) -> tuple[Any, ctypes.c_void_p, int]:
        """Local. The loaded library, the context handle and this rank, for the test library's launches on the same
        communicator (tests/kernel/native_testing.py). Raises before construction or after destroy."""
        if self._handle is None or self._ctx is None:
            raise NativeKernelError("no context: before construction (or after destroy)")
        return self._lib, self._handle, self._ctx.rank

    def watchdog_thread_setup(self) -> None:
        """Run in the helper's watchdog thread: relax that thread's CUDA stream-capture mode, so its event
        queries never invalidate a graph capture begun in another thread (torch's NCCL watchdog does the
        same). A build that does not offer it (ABI 2) leaves the mode as it is."""
        if self._fvk is not None and self._fvk.RELAX_CAPTURE in self._offerings:
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
        handle = self._handle
        self._reset()  # idempotent: a second destroy (or one before construction) only finds it empty
        if handle is not None:
            self._check(self._lib.fvk_destroy(handle), "fvk_destroy")

    def _reset(self) -> None:
        """What a construction builds (and a call caches from it), empty: before construction, after ``abort`` and
        ``destroy``."""
        self._close_hot()
        self._handle: ctypes.c_void_p | None = None
        self._ctx: ConstructionContext | None = None
        self._unique_id: bytes | None = None
        self._event: torch.cuda.Event | None = None  # the last call's completion event
        self._events: list[torch.cuda.Event] = []
        self._launches: dict[tuple, Launch] = {}  # per (geometry, plan, dtype, capture): see _launch_for
        self._by_object: dict[tuple, tuple[Launch, Geometry, Plan]] = {}  # the same, by the objects' ids
        self._vote: Any = None  # the fvk_vote of the voted form, built once per vote channel (_vote_for)
        self._vote_ref: Any = None
        self._vote_owner: Any = None  # the vote channel it was built for
        self._streams: dict[tuple[int, int], torch.cuda.Stream] = {}  # (device, raw handle) -> Stream
