"""``NativeTransport.execute`` on the CPU, against a stand-in library: the one library call a plan makes, with
which call description, and that the per-signature launch cache (``_launch_for``) and the per-stream cache
(``_stream``) change neither.

Every call must reach ``fvk_launch`` once, with a call description equal to the one the per-call formula
gives (plan kind, flags, geometry, plan; the original plan as 36 CTAs over (B, S)), eager and captured, for
both kinds and modes, from a fresh cache and from a warm one, so a cached description cannot drift from what
the library expects; an uneven call's description points at its split tables (every rank's shares, read as the
library reads them, at the call), none where a table is even, and needs the build's ``uneven`` offering; the
voted form passes the vote's handle and buffers and acts on the stage the library reports. A GPU runs the real
library through the same method (``tests/kernel/smoke_native_single_rank.py``,
``benchmarks/measure_launch_host.py``); a build older than ``fvk_launch`` is ``tests/kernel/test_oldest_abi.py``.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from fastvideo.distributed.ulysses.contract import dtype_code, with_seq
from fastvideo.distributed.ulysses.launch import call_description
from fastvideo.distributed.ulysses.native import EVENT_RING, NativeKernelError, NativeTransport
from fastvideo.distributed.ulysses.policy import ENGINE_CE, MAX_CTAS, ORIGINAL_CTAS, Geometry, Plan
from fastvideo.distributed.ulysses.transport import ENTRIES, ConstructionContext, VoteNotStarted, output_shape
from tests.kernel.built import fastvideo_kernel as fvk

HANDLE, RAW_STREAM = 0x5EED, 0xC0DE
ALL = fvk.OFFERINGS[fvk.ABI_VERSION]
FIELDS = ("size", "flags", "kind", "mode", "dtype", "ctas", "B", "S", "H", "D", "planes_per_chunk", "rows_per_chunk",
          "seq_split", "head_split", "debug_report")


def read_table(address: int | None, world: int) -> tuple[int, ...] | None:
    """The ``int64_t[world]`` a split-table pointer points at, as the library reads it (None for null)."""
    return None if not address else tuple(ctypes.cast(address, ctypes.POINTER(ctypes.c_int64))[:world])


class FakeLib:
    """Records what each ``fvk_launch`` received (the call description read through its pointer, and the split
    tables through theirs, as the C library reads them at the call) and answers as the test sets: a status, and
    for the voted form the stage."""

    def __init__(self, world: int = 2) -> None:
        self.calls: list[tuple] = []
        self.world = world
        self.status, self.stage, self.vote_ns = 0, fvk.STAGE_LAUNCHED, 1500

    def fvk_launch(self, ctx, call, x, out, stream, vote):
        desc = call._obj  # what the pointer points at (ctypes.byref's object)
        seen = {"ctx": ctx.value, "x": x, "out": out, "stream": stream, "vote": None,
                "call": {name: getattr(desc, name) for name in FIELDS},
                "tables": (read_table(desc.seq_split, self.world), read_table(desc.head_split, self.world))}
        if vote is not None:
            v = vote._obj
            seen["vote"] = (v.size, v.handle, v.fields, v.votes, v.timeout_ns)
            v.stage, v.vote_ns = self.stage, self.vote_ns
        self.calls.append(seen)
        return self.status

    def fvk_last_error(self):
        return b"the stand-in's error"


class FakeEvent:
    def __init__(self) -> None:
        self.recorded_on: list[object] = []

    def record(self, stream) -> None:
        self.recorded_on.append(stream)


def transport(world: int = 2, offerings=ALL, rank: int = 0) -> tuple[NativeTransport, FakeLib]:
    t = NativeTransport()
    lib = FakeLib(world)
    t._lib, t._fvk, t._handle = lib, fvk, ctypes.c_void_p(HANDLE)
    t._offerings = frozenset(offerings)
    t._entries = t._offerings & ENTRIES  # what capability() keeps
    t._ctx = ConstructionContext(rank=rank, world_size=world, device=torch.device("cpu"), window_bytes=1 << 20,
                                 max_ctas=MAX_CTAS, device_group=None, all_gather_object=lambda o: [o])
    t._events = [FakeEvent() for _ in range(EVENT_RING)]
    t._event = t._events[-1]
    t._current_raw = lambda x: (0, RAW_STREAM)  # type: ignore[method-assign]
    t._stream = lambda index, raw: "the-stream" if (index, raw) == (0, RAW_STREAM) else None  # type: ignore
    return t, lib


def expected(x: torch.Tensor, out: torch.Tensor, geom: Geometry, plan: Plan, capture: bool = False) -> dict:
    """What ``fvk_launch`` must receive for ``plan``: the per-call formula, written out."""
    ce = plan.engine == ENGINE_CE
    original = not ce and plan.ctas == ORIGINAL_CTAS and plan.planes_per_chunk >= geom.B \
        and plan.rows_per_chunk >= geom.S
    ctas, planes, rows = (ORIGINAL_CTAS, geom.B, geom.S) if original else (plan.ctas, plan.planes_per_chunk,
                                                                          plan.rows_per_chunk)
    call = {"size": ctypes.sizeof(fvk.Call), "flags": fvk.CALL_CAPTURE if capture else 0,
            "kind": fvk.KIND_CE if ce else fvk.KIND_SM, "mode": geom.mode, "dtype": dtype_code(x.dtype),
            "ctas": ctas, "B": geom.B, "S": geom.S, "H": geom.H, "D": geom.D, "planes_per_chunk": planes,
            "rows_per_chunk": rows, "seq_split": None, "head_split": None, "debug_report": None}
    return {"ctx": HANDLE, "x": x.data_ptr(), "out": out.data_ptr(), "stream": RAW_STREAM, "vote": None,
            "call": call, "tables": (geom.seq_splits, geom.head_splits)}


def plans(geom: Geometry) -> list[Plan]:
    return [Plan(ORIGINAL_CTAS, geom.B, geom.S, tuned=False), Plan(ORIGINAL_CTAS, 1, geom.S, tuned=True),
            Plan(144, 1, 3, tuned=True), Plan(66, 1, 4, tuned=True, engine=ENGINE_CE),
            Plan(132, 2, geom.S, tuned=True, engine=ENGINE_CE)]


@pytest.mark.parametrize("capture", [False, True], ids=["eager", "captured"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mode", [0, 1])
def test_execute_makes_one_library_call_with_the_per_call_description(mode: int, dtype: torch.dtype, capture: bool):
    t, lib = transport()
    x = torch.randn(3, 8, 4, 16).to(dtype) if mode == 0 else torch.randn(3, 16, 2, 16).to(dtype)
    geom = Geometry.from_input(x.shape, mode, 2, dtype)
    for round_ in range(2):  # the second round runs from the caches
        for plan in plans(geom):
            out = t.execute(x, geom, plan, capture=capture)
            assert tuple(out.shape) == output_shape(geom) and out.dtype == dtype
            assert lib.calls[-1] == expected(x, out, geom, plan, capture), (round_, plan)
    assert len(lib.calls) == 2 * len(plans(geom)) and len(t._launches) == len(plans(geom))
    recorded = [s for e in t._events for s in e.recorded_on]
    # One completion event per eager call, on its stream; a capture runs nothing, so it records none.
    assert recorded == ([] if capture else ["the-stream"] * (2 * len(plans(geom))))


UNEVEN = [((5, 0, 3), (2, 4, 1)), ((5, 0, 3), None), (None, (2, 4, 1))]  # P = 3: both tables, seq only, heads only


@pytest.mark.parametrize("capture", [False, True], ids=["eager", "captured"])
@pytest.mark.parametrize("tables", UNEVEN, ids=["both", "seq", "heads"])
@pytest.mark.parametrize("rank", [0, 1, 2])
@pytest.mark.parametrize("mode", [0, 1])
def test_an_uneven_call_passes_its_split_tables(mode: int, rank: int, tables, capture: bool):
    """The description of an uneven call is the even formula's (geometry in the largest share's terms) with
    pointers to every rank's shares, read at the call, from a fresh cache and a warm one (the cached launch keeps
    its tables alive); this rank's input and output have its own shares' shapes (rank 1's are empty where its
    sequence share is 0)."""
    seq, heads = tables
    geom = Geometry(mode, torch.bfloat16, 2, 5, 7 if heads else 6, 16, 3, seq, heads)
    t, lib = transport(world=3, rank=rank)
    inverse = Geometry(1 - mode, geom.dtype, 2, 5, geom.H, 16, 3, seq, heads)
    x = torch.randn(output_shape(inverse, rank)).to(geom.dtype)  # this rank's input: the inverse call's output
    for round_ in range(2):
        for plan in plans(geom):
            out = t.execute(x, geom, plan, capture=capture)
            assert tuple(out.shape) == output_shape(geom, rank) and out.dtype == geom.dtype
            # Everything but the call's fields as expected, the tables' values included; then the fields but the
            # table pointers (addresses of the launch's own arrays).
            assert lib.calls[-1] == expected(x, out, geom, plan, capture) | {"call": lib.calls[-1]["call"]}
            seen = lib.calls[-1]["call"]
            assert {k: v for k, v in seen.items() if k not in ("seq_split", "head_split")} == {
                k: v for k, v in expected(x, out, geom, plan, capture)["call"].items()
                if k not in ("seq_split", "head_split")}, (round_, plan)
    assert len(t._launches) == len(plans(geom))


def test_an_uneven_call_needs_the_offering_and_an_even_one_does_not():
    """A build without ``uneven`` (ABI 4) refuses an uneven plan before the library is called (the planner never
    plans one there: its capability lacks ``ENTRY_UNEVEN``); the same build runs the even call."""
    t, lib = transport(world=3, offerings=fvk.OFFERINGS[4])
    geom = Geometry(0, torch.float32, 1, 5, 6, 16, 3, (5, 0, 3), None)
    with pytest.raises(NativeKernelError, match="needs the 'uneven' offering"):
        t.execute(torch.randn(1, 5, 6, 16), geom, Plan(144, 1, 3, tuned=True))
    assert not lib.calls and not t._launches
    even = Geometry(0, torch.float32, 1, 5, 6, 16, 3)
    t.execute(torch.randn(1, 5, 6, 16), even, Plan(144, 1, 3, tuned=True))
    assert lib.calls[-1]["tables"] == (None, None)


def test_call_description_points_at_the_tables_it_returns():
    """``call_description``: the tables as ``int64_t[P]`` arrays the description holds the addresses of; null
    pointers for even tables; the rest of the description as the launch formula gives it."""
    geom = Geometry(1, torch.float16, 3, 9, 10, 8, 4, (9, 0, 2, 9), (1, 2, 3, 4))
    desc, (seq, heads) = call_description(fvk, geom, geom.dtype, kind=fvk.KIND_CE, ctas=66, planes=2, rows=4,
                                          flags=fvk.CALL_CAPTURE)
    assert desc.seq_split == ctypes.addressof(seq) and desc.head_split == ctypes.addressof(heads)
    assert read_table(desc.seq_split, 4) == (9, 0, 2, 9) and read_table(desc.head_split, 4) == (1, 2, 3, 4)
    assert (desc.size, desc.flags, desc.kind, desc.mode, desc.dtype, desc.ctas) == (
        ctypes.sizeof(fvk.Call), fvk.CALL_CAPTURE, fvk.KIND_CE, 1, dtype_code(torch.float16), 66)
    assert (desc.B, desc.S, desc.H, desc.D, desc.planes_per_chunk, desc.rows_per_chunk) == (3, 9, 10, 8, 2, 4)
    even, none = call_description(fvk, Geometry(0, torch.float32, 1, 4, 8, 8, 4), torch.float32, kind=fvk.KIND_SM,
                                  ctas=36, planes=1, rows=4)
    assert none == (None, None) and even.seq_split is None and even.head_split is None


def test_the_cached_description_is_the_formula_s_negative_control():
    """The comparison sees a description that drifted: the cached call of one signature altered in place."""
    t, lib = transport()
    x = torch.randn(1, 8, 4, 16)
    geom = Geometry.from_input(x.shape, 0, 2, x.dtype)
    plan = Plan(144, 1, 3, tuned=True)
    t.execute(x, geom, plan)
    next(iter(t._launches.values())).desc.rows_per_chunk = 4
    out = t.execute(x, geom, plan)
    assert lib.calls[-1] != expected(x, out, geom, plan) and lib.calls[-1]["call"]["rows_per_chunk"] == 4


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
    t, lib = transport(offerings=ALL - {"ce", "ce_capture"})
    x = torch.randn(1, 8, 4, 16)
    geom = Geometry.from_input(x.shape, 0, 2, x.dtype)
    with pytest.raises(NativeKernelError, match="needs the 'ce' offering"):
        t.execute(x, geom, Plan(66, 1, 8, tuned=True, engine=ENGINE_CE))
    with pytest.raises(NativeKernelError, match="needs the 'ce_capture' offering"):
        t.execute(x, geom, Plan(66, 1, 8, tuned=True, engine=ENGINE_CE), capture=True)
    with pytest.raises(NativeKernelError, match="communicator has 2"):
        t.execute(x, Geometry.from_input(x.shape, 0, 4, x.dtype), Plan(144, 1, 8, tuned=True))
    original_only, _ = transport(offerings={"original"})
    with pytest.raises(NativeKernelError, match="needs the 'tuned' offering"):
        original_only.execute(x, geom, Plan(144, 1, 8, tuned=True))
    assert not t._launches and not original_only._launches and not lib.calls


def test_a_failed_library_call_raises_with_its_message() -> None:
    t, lib = transport()
    lib.status = 5
    x = torch.randn(1, 8, 4, 16)
    with pytest.raises(NativeKernelError, match="the stand-in's error"):
        t.execute(x, Geometry.from_input(x.shape, 0, 2, x.dtype), Plan(144, 1, 8, tuned=True))
    assert not any(e.recorded_on for e in t._events)  # no completion recorded for a call that failed


def test_execute_before_construction_raises() -> None:
    with pytest.raises(NativeKernelError, match="before construction"):
        NativeTransport().execute(torch.randn(1, 8, 4, 16), Geometry.from_input((1, 8, 4, 16), 0, 2, torch.float32),
                                  Plan(144, 1, 8, tuned=True))


class FakeVote:
    """The shared-memory vote's side of the voted form, as ``ShmVote`` has it: ``native_channel`` returns the same
    (handle, receive, timeout) every call; ``send_row`` makes the row kept in ``send_rows`` for a proposal's fields
    (a real int64 array, so the SEQ the transport writes into it can be read back, and a stand-in address, one per
    distinct fields), counting how often it is asked."""

    ROW_BASE = 0xB0

    def __init__(self) -> None:
        self.channel = (ctypes.c_void_p(0xA0), ctypes.c_void_p(0xC0), ctypes.c_int64(7 * 10**9))
        self.channels = 0
        self.send_rows: dict[tuple[int, ...], tuple[np.ndarray, int]] = {}
        self.asked = 0
        self.last_s = 0.0
        self.destroyed = False

    def native_channel(self):
        self.channels += 1
        return self.channel

    def send_row(self, fields):
        self.asked += 1
        rows = self.send_rows
        if tuple(fields) not in rows:
            rows[tuple(fields)] = (np.array(fields, dtype=np.int64), self.ROW_BASE + 0x100 * len(rows))
        return rows[tuple(fields)]

    def sent(self, fields) -> list[int]:
        """The row the library would read for ``fields`` now."""
        return self.send_rows[tuple(fields)][0].tolist()

    def failure(self, status: int) -> RuntimeError:
        return RuntimeError(f"vote failed with {status}")


@pytest.mark.parametrize("stage", [fvk.STAGE_LAUNCHED, fvk.STAGE_NOT_LAUNCHED, fvk.STAGE_EXCHANGE_FAILED,
                                   fvk.STAGE_REFUSED])
def test_the_voted_form_passes_the_vote_and_acts_on_the_stage(stage):
    t, lib = transport()
    vote = FakeVote()
    assert t.fuses_vote(vote) and not t.fuses_vote(object())
    x = torch.randn(1, 8, 4, 16)
    geom = Geometry.from_input(x.shape, 0, 2, x.dtype)
    plan = Plan(144, 1, 3, tuned=True)
    lib.stage = stage
    fields = tuple(range(12))
    if stage == fvk.STAGE_LAUNCHED:
        out = t.execute(x, geom, plan, vote=vote, fields=fields, seq=5)
        assert lib.calls[-1] == {**expected(x, out, geom, plan), "vote": (ctypes.sizeof(fvk.Vote), 0xA0, 0xB0, 0xC0,
                                                                          7 * 10**9)}
        assert t._events[0].recorded_on == ["the-stream"]
    elif stage == fvk.STAGE_NOT_LAUNCHED:
        assert t.execute(x, geom, plan, vote=vote, fields=fields, seq=5) is None  # the helper decides from vote.rows
    else:
        error = VoteNotStarted if stage == fvk.STAGE_REFUSED else RuntimeError
        with pytest.raises(error, match="refused before the vote" if stage == fvk.STAGE_REFUSED else "vote failed"):
            t.execute(x, geom, plan, vote=vote, fields=fields, seq=5)
    assert vote.sent(fields) == with_seq(fields, 5) and vote.last_s == pytest.approx(1.5e-6)
    first, lib.stage = t._vote, fvk.STAGE_LAUNCHED
    t.execute(x, geom, plan, vote=vote, fields=fields[::-1], seq=6)
    # one fvk_vote per vote channel, reused; each call points it at its own proposal's row
    assert t._vote is first and vote.channels == 1 and vote.sent(fields[::-1]) == with_seq(fields[::-1], 6)
    assert lib.calls[-1]["vote"] == (ctypes.sizeof(fvk.Vote), 0xA0, 0x1B0, 0xC0, 7 * 10**9)
    # a proposal's row is asked of the vote once and kept: a later call only writes its SEQ into it
    t.execute(x, geom, plan, vote=vote, fields=fields, seq=7)
    assert vote.asked == 2 and vote.sent(fields) == with_seq(fields, 7) and lib.calls[-1]["vote"][2] == 0xB0
    vote.destroyed = True  # its handle is gone: no library call may use it
    with pytest.raises(RuntimeError, match="vote failed with -1"):
        t.execute(x, geom, plan, vote=vote, fields=fields, seq=8)


def test_a_failure_before_the_voted_exchange_is_vote_not_started():
    """With a vote, anything that fails before the library call (here a plan this build does not offer) leaves
    this rank unvoted: VoteNotStarted, and the library is not called."""
    t, lib = transport(offerings=ALL - {"ce"})
    x = torch.randn(1, 8, 4, 16)
    with pytest.raises(VoteNotStarted, match="needs the 'ce' offering"):
        t.execute(x, Geometry.from_input(x.shape, 0, 2, x.dtype), Plan(66, 1, 8, tuned=True, engine=ENGINE_CE),
                  vote=FakeVote(), fields=(0,) * 12)
    assert not lib.calls


def test_the_voted_form_needs_the_shared_memory_vote_and_the_offering():
    """Offered only over the shared-memory vote (whose exchange the library runs) and by a build that offers
    it; over the gloo vote the helper votes and launches as before."""
    from fastvideo.distributed.ulysses.vote import GlooVote, ShmVote

    shm, gloo = ShmVote.__new__(ShmVote), GlooVote.__new__(GlooVote)  # the type is what matters here
    full, _ = transport()
    assert full.fuses_vote(shm) and not full.fuses_vote(gloo)
    older, _ = transport(offerings=ALL - {"voted"})
    assert not older.fuses_vote(shm)
    assert not NativeTransport().fuses_vote(shm)  # no library loaded


def test_the_stream_object_is_looked_up_once_per_device_and_handle(monkeypatch):
    """``_current_raw`` before the launch: the raw handle of the input's device's current stream, no Stream object;
    ``_stream`` after it: one ``torch.cuda.current_stream`` per (device, raw handle), then the kept Stream; the
    default streams of two devices (both raw handle 0) stay apart; a new handle is looked up."""
    from fastvideo.distributed.ulysses import native

    current = {0: 0, 1: 0}  # device index -> raw handle of its current stream
    lookups = []

    class FakeStream:
        def __init__(self, index: int, raw: int) -> None:
            self.index, self.cuda_stream = index, raw

    def current_stream(index):
        lookups.append(index)
        return FakeStream(index, current[index])

    class OnDevice:  # what _current_raw reads of a CUDA tensor
        def __init__(self, index: int) -> None:
            self.index = index

        def get_device(self) -> int:
            return self.index

    monkeypatch.setattr(native, "_raw_stream", lambda index: current[index])
    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    t = NativeTransport()
    assert t._current_raw(OnDevice(1)) == (1, 0) and lookups == []  # the raw handle alone: no Stream object
    s0 = t._stream(*t._current_raw(OnDevice(0)))
    assert (s0.index, s0.cuda_stream) == (0, 0) and t._stream(0, 0) is s0 and lookups == [0]
    s1 = t._stream(*t._current_raw(OnDevice(1)))  # the same raw handle 0 on another device: its own Stream
    assert s1.index == 1 and s1 is not s0 and lookups == [0, 1]
    current[0] = 0xABC  # device 0 switched streams
    index, raw = t._current_raw(OnDevice(0))
    s2 = t._stream(index, raw)
    assert raw == 0xABC and s2.cuda_stream == 0xABC and lookups == [0, 1, 0]
    assert t._stream(0, 0xABC) is s2 and t._stream(1, 0) is s1 and lookups == [0, 1, 0]
    monkeypatch.setattr(native, "_raw_stream", None)  # a torch without the one-call query: through the Stream
    assert t._current_raw(OnDevice(0)) == (0, 0xABC) and lookups == [0, 1, 0, 0]
