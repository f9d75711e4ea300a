"""``NativeTransport.execute`` on the CPU, against a stand-in library: which entry point a plan reaches, with
which arguments, and that the per-signature launch cache (``_launch_for``) and the per-stream cache
(``_current_stream``) change neither.

The arguments are checked against the formula ``execute`` used before the caches (every argument built on
every call), so a cached launch cannot drift from what the library expects. A GPU runs the real library
through the same method (``tests/kernel/smoke_native_single_rank.py``, ``benchmarks/measure_launch_host.py``).
"""

from __future__ import annotations

import pytest
import torch

from fastvideo.distributed.ulysses.contract import dtype_code
from fastvideo.distributed.ulysses.native import EVENT_RING, NativeKernelError, NativeTransport
from fastvideo.distributed.ulysses.policy import ENGINE_CE, MAX_CTAS, ORIGINAL_CTAS, Geometry, Plan
from fastvideo.distributed.ulysses.transport import (
    ENTRY_CE,
    ENTRY_ORIGINAL,
    ENTRY_TUNED,
    ConstructionContext,
    output_shape,
)

HANDLE, RAW_STREAM = 0x5EED, 0xC0DE


class FakeLib:
    """Records each entry point's arguments and succeeds."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple]] = []
        for name in ("fvk_a2a_original", "fvk_a2a_tuned", "fvk_a2a_ce", "fvk_a2a_captured", "fvk_a2a_ce_captured"):
            setattr(self, name, self._entry(name))

    def _entry(self, name: str):
        def call(*args):
            self.calls.append((name, args))
            return 0
        return call


class FakeEvent:
    def __init__(self) -> None:
        self.recorded_on: list[object] = []

    def record(self, stream) -> None:
        self.recorded_on.append(stream)


def transport(world: int = 2, entries=(ENTRY_ORIGINAL, ENTRY_TUNED, ENTRY_CE)) -> tuple[NativeTransport, FakeLib]:
    t = NativeTransport()
    lib = FakeLib()
    t._lib, t._entries, t._handle = lib, frozenset(entries), HANDLE
    t._ctx = ConstructionContext(rank=0, world_size=world, device=torch.device("cpu"), window_bytes=1 << 20,
                                 max_ctas=MAX_CTAS, device_group=None, all_gather_object=lambda o: [o])
    t._events = [FakeEvent() for _ in range(EVENT_RING)]
    t._event = t._events[-1]
    t._current_stream = lambda device: (RAW_STREAM, "the-stream")  # type: ignore[method-assign]
    return t, lib


def expected(x: torch.Tensor, out: torch.Tensor, geom: Geometry, plan: Plan) -> tuple[str, tuple]:
    """The entry point and arguments as ``execute`` built them per call before the caches (its old body)."""
    whole = plan.planes_per_chunk >= geom.B and plan.rows_per_chunk >= geom.S
    args = (HANDLE, x.data_ptr(), out.data_ptr(), geom.mode, dtype_code(x.dtype), geom.B, geom.S, geom.H, geom.D)
    chunking = (plan.ctas, plan.planes_per_chunk, plan.rows_per_chunk)
    if plan.engine == ENGINE_CE:
        return "fvk_a2a_ce", (*args, *chunking, RAW_STREAM)
    if plan.ctas == ORIGINAL_CTAS and whole:
        return "fvk_a2a_original", (*args, RAW_STREAM)
    return "fvk_a2a_tuned", (*args, *chunking, RAW_STREAM)


def plans(geom: Geometry) -> list[Plan]:
    return [Plan(ORIGINAL_CTAS, geom.B, geom.S, tuned=False), Plan(ORIGINAL_CTAS, 1, geom.S, tuned=True),
            Plan(144, 1, 3, tuned=True), Plan(66, 1, 4, tuned=True, engine=ENGINE_CE),
            Plan(132, 2, geom.S, tuned=True, engine=ENGINE_CE)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mode", [0, 1])
def test_execute_reaches_the_entry_point_with_the_per_call_arguments(mode: int, dtype: torch.dtype) -> None:
    t, lib = transport()
    x = torch.randn(3, 8, 4, 16).to(dtype) if mode == 0 else torch.randn(3, 16, 2, 16).to(dtype)
    geom = Geometry.from_input(x.shape, mode, 2, dtype)
    for round_ in range(2):  # the second round runs from the caches
        for plan in plans(geom):
            out = t.execute(x, geom, plan)
            assert tuple(out.shape) == output_shape(geom) and out.dtype == dtype
            assert lib.calls[-1] == expected(x, out, geom, plan), (round_, plan)
    assert len(t._launches) == len(plans(geom))
    recorded = [s for e in t._events for s in e.recorded_on]
    assert recorded == ["the-stream"] * (2 * len(plans(geom)))  # one completion event per call, on its stream


def test_a_new_signature_gets_its_own_launch() -> None:
    t, lib = transport()
    a, b = torch.randn(1, 8, 4, 16), torch.randn(1, 8, 4, 32)
    plan = Plan(144, 1, 8, tuned=True)
    for x in (a, b, a):
        geom = Geometry.from_input(x.shape, 0, 2, x.dtype)
        out = t.execute(x, geom, plan)
        assert lib.calls[-1] == expected(x, out, geom, plan)
    assert len(t._launches) == 2


def test_refusals_name_the_problem_and_are_not_cached() -> None:
    t, _ = transport(entries=(ENTRY_ORIGINAL, ENTRY_TUNED))
    x = torch.randn(1, 8, 4, 16)
    geom = Geometry.from_input(x.shape, 0, 2, x.dtype)
    with pytest.raises(NativeKernelError, match="copy-engine entry point"):
        t.execute(x, geom, Plan(66, 1, 8, tuned=True, engine=ENGINE_CE))
    with pytest.raises(NativeKernelError, match="communicator has 2"):
        t.execute(x, Geometry.from_input(x.shape, 0, 4, x.dtype), Plan(144, 1, 8, tuned=True))
    original_only, _ = transport(entries=(ENTRY_ORIGINAL,))
    with pytest.raises(NativeKernelError, match="tuned entry point"):
        original_only.execute(x, geom, Plan(144, 1, 8, tuned=True))
    assert not t._launches and not original_only._launches


def test_execute_before_construction_raises() -> None:
    with pytest.raises(NativeKernelError, match="before construction"):
        NativeTransport().execute(torch.randn(1, 8, 4, 16), Geometry.from_input((1, 8, 4, 16), 0, 2, torch.float32),
                                  Plan(144, 1, 8, tuned=True))


def test_current_stream_is_looked_up_once_per_device_and_handle(monkeypatch):
    """``_current_stream``: one ``torch.cuda.current_stream`` per (device, raw handle), then the kept Stream;
    the default streams of two devices (both raw handle 0) stay apart; a new handle is looked up."""
    from fastvideo.distributed.ulysses import native

    current = {0: 0, 1: 0}  # device index -> raw handle of its current stream
    lookups = []

    class FakeStream:
        def __init__(self, index: int, raw: int) -> None:
            self.index, self.cuda_stream = index, raw

    def current_stream(device):
        lookups.append(device.index)
        return FakeStream(device.index, current[device.index])

    monkeypatch.setattr(native, "_raw_stream", lambda index: current[index])
    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    t = NativeTransport()
    dev0, dev1 = torch.device("cuda", 0), torch.device("cuda", 1)
    raw, s0 = t._current_stream(dev0)
    assert (raw, s0.index) == (0, 0) and t._current_stream(dev0)[1] is s0 and lookups == [0]
    raw, s1 = t._current_stream(dev1)  # the same raw handle 0 on another device: its own Stream
    assert (raw, s1.index) == (0, 1) and s1 is not s0 and lookups == [0, 1]
    current[0] = 0xABC  # device 0 switched streams
    raw, s2 = t._current_stream(dev0)
    assert raw == 0xABC and s2.cuda_stream == 0xABC and lookups == [0, 1, 0]
    assert t._current_stream(dev0)[1] is s2 and t._current_stream(dev1)[1] is s1 and lookups == [0, 1, 0]


def test_voted_launch_needs_the_shared_memory_vote_and_the_library_entry():
    """The voted launch is offered only over the shared-memory vote (whose exchange the library runs) and by a
    build with ``fvk_voted_launch``; over the gloo vote the helper votes and launches as before."""
    from fastvideo.distributed.ulysses.vote import GlooVote, ShmVote

    t, lib = transport()
    shm, gloo = ShmVote.__new__(ShmVote), GlooVote.__new__(GlooVote)  # the type is what matters here
    assert not t.fuses_vote(shm)  # this build (the stand-in) has no fvk_voted_launch
    lib.fvk_voted_launch = lambda *args: 0
    assert t.fuses_vote(shm) and not t.fuses_vote(gloo)
    assert not NativeTransport().fuses_vote(shm)  # no library loaded


@pytest.mark.parametrize("mode", [0, 1])
def test_a_captured_execute_takes_the_tuned_form_of_each_plan(monkeypatch, mode):
    """The captured entries get what the captured execute built per call before it shared ``_launch_for``:
    the tuned form, with the original plan as 36 CTAs over (B, S), the copy-engine kind its own entry."""
    class Stream:
        cuda_stream = RAW_STREAM

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    t, lib = transport(entries=(ENTRY_ORIGINAL, ENTRY_TUNED, ENTRY_CE, "capture", "ce_capture"))
    x = torch.randn(3, 8, 4, 16) if mode == 0 else torch.randn(3, 16, 2, 16)
    geom = Geometry.from_input(x.shape, mode, 2, x.dtype)
    for plan in plans(geom):
        out = t.execute(x, geom, plan, capture=True)
        whole = plan.planes_per_chunk >= geom.B and plan.rows_per_chunk >= geom.S
        ctas, planes, rows = (ORIGINAL_CTAS, geom.B, geom.S) if (
            plan.engine != ENGINE_CE and plan.ctas == ORIGINAL_CTAS and whole) else (
            plan.ctas, plan.planes_per_chunk, plan.rows_per_chunk)
        name = "fvk_a2a_ce_captured" if plan.engine == ENGINE_CE else "fvk_a2a_captured"
        assert lib.calls[-1] == (name, (HANDLE, x.data_ptr(), out.data_ptr(), geom.mode, dtype_code(x.dtype), geom.B,
                                        geom.S, geom.H, geom.D, ctas, planes, rows, RAW_STREAM)), plan
        assert tuple(out.shape) == output_shape(geom)
