"""Shared fixtures for the Ulysses CPU suites.

Ambient settings (``FASTVIDEO_ULYSSES_A2A``, ``..._LONG_TRAINING``) are handled suite-wide by
``tests/conftest.py``: a test whose code reads one unset carries ``@pytest.mark.ambient`` naming it
(``READS_LONG_TRAINING`` below) and CI runs it under each value; every other test sees them pinned to
the defaults (and the checked mode's switches pinned off).

``ranks`` runs a module-level function on N gloo ranks (``tests/distributed/mp.py``) and forwards
this test's values of those variables to the ranks (a forkserver child otherwise keeps the
environment the forkserver started with), so what the test sees is what the code under test sees.
"""

from __future__ import annotations

import contextlib

import pytest

from tests.distributed import mp

# The helper reads FASTVIDEO_ULYSSES_A2A_LONG_TRAINING on every call (plan_for) unless told: a test
# whose ranks call it without setting the variable depends on the shell's value.
READS_LONG_TRAINING = pytest.mark.ambient("FASTVIDEO_ULYSSES_A2A_LONG_TRAINING")


@pytest.fixture
def ranks(ulysses_ambient):
    """``ranks(world_size, fn, *args, env=..., timeout_s=...)``: run ``fn`` on gloo ranks, ambient env forwarded."""

    def run(world_size: int, fn, *args, env: dict[str, str | None] | None = None, timeout_s: float = 60.0, **kw):
        # run_ranks forwards os.environ's values of the two variables, which ulysses_ambient has set.
        return mp.run_ranks(world_size, fn, *args, env=env, timeout_s=timeout_s, **kw)

    return run


# ---------------------------------------------------------------------------------------------------
# Rank-side building blocks (imported by the test modules' module-level rank functions).

GPU_NAME = "NVIDIA T100"  # a made-up model: normalises to "T100", which only the fixture rows below name
FIXTURE_GPU = "T100"
VOTE_TIMEOUT_S = 10.0  # short enough that a hang fails fast, long enough for 4 ranks on 2 cores


def fixture_rows(world_sizes=(2, 3, 4), heads=(12,), head_dims=(8,), dtypes=None, *, ctas=144, planes_per_chunk=1,
                 engine="sm"):
    """Tuned rows for the test geometries only (the gate-style fixture: tuned and original plans differ)."""
    import torch

    from fastvideo.distributed.ulysses.policy import TunedRow

    dtypes = dtypes or (torch.float32, torch.bfloat16)
    return tuple(
        TunedRow(FIXTURE_GPU, p, dt, h, d, ctas=ctas, planes_per_chunk=planes_per_chunk, source="test fixture",
                 engine=engine)
        for p in world_sizes for dt in dtypes for h in heads for d in head_dims
    )


class CaptureSwitch:
    """A helper's ``capturing`` argument for CPU simulations (CPU has no CUDA graphs): a call counts as captured
    while ``on`` (a bool, or a callable of the input)."""

    def __init__(self) -> None:
        self.on = False

    def __call__(self, x) -> bool:
        return self.on(x) if callable(self.on) else self.on


def build_helper(*, window_bytes: int = 1 << 20, transport=None, tuned: bool = True, table=None,
                 vote_timeout_s: float = VOTE_TIMEOUT_S, **kw):
    """A UlyssesHelper on the SP group with the CPU plan transport, a small window, the fixture rows and a
    ``CaptureSwitch`` (``forced_capture``)."""
    from fastvideo.distributed.parallel_state import get_sp_group
    from fastvideo.distributed.ulysses.helper import UlyssesHelper
    from tests.plan_transport import GlooPlanTransport

    if table is None:
        table = fixture_rows() if tuned else ()
    switch = kw.pop("capturing", None) or CaptureSwitch()
    helper = UlyssesHelper(
        get_sp_group(),
        transport=transport if transport is not None else GlooPlanTransport(),
        window_bytes=window_bytes,
        vote_timeout_s=vote_timeout_s,
        gpu_name=GPU_NAME,
        tuned_table=table,
        capturing=switch,
        **kw,
    )
    _SWITCHES[helper.id] = switch
    return helper


_SWITCHES: dict = {}  # helper id -> the CaptureSwitch build_helper gave it


def capture_switch(helper) -> CaptureSwitch:
    """The ``CaptureSwitch`` ``build_helper`` built ``helper`` with."""
    return _SWITCHES[helper.id]


def stand_in_native_helper(rank: int, world_size: int, launch, hot: bool):
    """A shared-memory-vote helper on the native transport driving the stand-in library of
    ``tests/kernel/test_native_dispatch.py``: the transport's construction steps and topology check stand in
    (nothing to build on CPU), its completion events always complete, and ``launch(lib)`` (given the stand-in
    library) is its ``fvk_launch``. The helper is constructed on it as on a GPU, so construction decides the voted
    launch and the hot path (off unless ``hot``: ``FASTVIDEO_ULYSSES_A2A_HOT_PATH``). Returns ``(helper, native)``."""
    import os

    import torch

    from fastvideo.distributed.ulysses.runtime import stream_capturing
    from fastvideo.distributed.ulysses.transport import Capability, TopologyReport
    from tests.kernel.test_native_dispatch import transport as stand_in_transport

    class Event:  # the completion ring's stand-in: recorded, and always complete for the watchdog
        def record(self, stream) -> None:
            pass

        def query(self) -> bool:
            return True

    native, lib = stand_in_transport(world_size, rank=rank)
    native._events = [Event() for _ in native._events]
    lib.fvk_relax_capture_mode = lambda: 0
    lib.fvk_launch = launch(lib)
    native.capability = lambda: Capability("native", True, abi_version=9, entry_points=native._entries,
                                           dtypes=(torch.float32, torch.bfloat16), supports_unaligned=True)
    native.construction_steps = lambda ctx: []
    native.topology = TopologyReport
    native.destroy = lambda: None
    os.environ["FASTVIDEO_ULYSSES_A2A_HOT_PATH"] = "1" if hot else "0"
    try:  # the real capture check (the hot path serves only calls made with it)
        helper = build_helper(vote="shm", transport=native, capturing=stream_capturing)
    finally:
        del os.environ["FASTVIDEO_ULYSSES_A2A_HOT_PATH"]
    return helper, native


def construction_fault(rank: int, scenario: str, faulty_rank: int = 1):
    """``(transport, helper kwargs)`` that make helper construction decline in ``scenario`` as seen from
    ``rank``: ``missing`` (no kernel on ``faulty_rank``), ``abi`` (another ABI there), ``alloc`` (its window
    allocation fails), ``nvlink`` (its topology is PCIe only), ``window`` (every rank asks for another
    window), ``hosts`` / ``boot_id`` (every rank on another host / boot); anything else builds normally."""
    from fastvideo.distributed.ulysses.contract import DeclineReason
    from fastvideo.distributed.ulysses.transport import Capability, TopologyReport
    from tests.plan_transport import GlooPlanTransport

    kw: dict = {}
    transport = GlooPlanTransport()
    faulty = rank == faulty_rank
    if scenario == "missing" and faulty:
        transport = GlooPlanTransport(capability_override=Capability(
            "gloo-plan", False, decline=DeclineReason.TRANSPORT_MISSING, detail="no kernel library on this rank"))
    elif scenario == "abi" and faulty:
        cap = transport.capability()
        transport = GlooPlanTransport(capability_override=Capability(
            cap.name, True, abi_version=2, entry_points=cap.entry_points, dtypes=cap.dtypes,
            supports_unaligned=True))
    elif scenario == "alloc" and faulty:
        transport = GlooPlanTransport(fail_steps=("alloc_window",))
    elif scenario == "nvlink" and faulty:
        transport = GlooPlanTransport(topology_override=TopologyReport(DeclineReason.NOT_NVLINK, "PCIe only"))
    elif scenario == "window":
        kw["window_bytes"] = 4096 * (rank + 1)
    elif scenario == "hosts":
        kw["identity"] = lambda: (f"host{rank}", "boot")
    elif scenario == "boot_id":
        kw["identity"] = lambda: ("samehost", f"boot{rank}")
    return transport, kw


def a2a(helper, x, mode: int, *, seq_splits=None, head_splits=None):
    """The differentiable all-to-all through ``helper`` (the one op with that helper; validated in its core)."""
    from fastvideo.distributed.ulysses import ops

    return ops.all_to_all(x, mode, helper=helper, seq_splits=seq_splits, head_splits=head_splits)


@contextlib.contextmanager
def in_flight_routes():
    """The route of every exchange started in flight inside the block, in order (``AllToAllHandle.route``: the
    public op's eager starts, the starts autograd records, and their backwards' starts, whose handles the caller
    never holds): what ``exchange.issue`` returned for each ``in_flight`` call."""
    from fastvideo.distributed.ulysses import exchange

    routes: list[str] = []
    real = exchange.issue

    def spy(*args, **kw):
        started, saved = real(*args, **kw)
        if kw.get("in_flight"):
            routes.append(started.route)
        return started, saved

    exchange.issue = spy
    try:
        yield routes
    finally:
        exchange.issue = real


@contextlib.contextmanager
def recorded_calls():
    """``(route, decline reason label or None)`` of each call recorded inside the block by the agreed route's helper
    (``registry.resolved()``, read at the block's end: the block's first call may resolve the route), from that
    helper's ``history``, in order: ``("nccl", "disabled")`` for a call of ``off`` in checked mode, ``("nccl",
    reason)`` for a call the helper declined, ``("fused", None)`` for a fused one. Empty where the route has no
    helper (``off`` outside checked mode: the NCCL route without a vote)."""
    from fastvideo.distributed.ulysses import registry

    existing = (registry.current_default_helper(), registry.current_checked_off_helper())
    marks = {id(h): len(h.history) for h in existing if h is not None}  # what each had recorded before the block
    calls: list[tuple[str, str | None]] = []
    try:
        yield calls
    finally:
        _, helper = registry.resolved()
        if helper is not None:
            since = marks.get(id(helper), 0)
            calls.extend((r.route, None if r.reason is None else r.reason.label) for r in list(helper.history)[since:])


def log_lines(logger_name: str) -> list[str]:
    """A list that the named logger's records are appended to (their messages), from now on in this process."""
    import logging

    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logging.getLogger(logger_name).addHandler(Collect())
    return lines


def rank_input(rank: int, shape, dtype=None, seed: int = 0, requires_grad: bool = False):
    """Deterministic, rank-distinct input (any rank can rebuild any other rank's input)."""
    import torch

    dtype = dtype or torch.float32
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    x = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    return x.requires_grad_(requires_grad)


def oracle(x, mode: int, splits=None):
    """The NCCL route over the SP device group (gloo on CPU): the correctness oracle (``splits``: a
    ``layout.Splits``, None for even)."""
    from fastvideo.distributed.communication_op import EVEN, nccl_route
    from fastvideo.distributed.parallel_state import get_sp_group

    return nccl_route(x.detach(), mode, get_sp_group().device_group, splits=splits or EVEN)


def nccl_reference(x, w, mode: int):
    """Output and input gradient of ``(a2a(x) * w).sum()`` from the plain NCCL route, without autograd: the
    all-to-all is a permutation, so the gradient is the inverse all-to-all of ``w``."""
    from fastvideo.distributed.communication_op import nccl_route
    from fastvideo.distributed.parallel_state import get_sp_group

    group = get_sp_group().device_group
    return nccl_route(x.detach(), mode, group), nccl_route(w.detach().contiguous(), 1 - mode, group)


def bit_equal(a, b) -> bool:
    """Same shape, dtype and bits (NaN-safe: compares the raw bytes)."""
    import torch

    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.detach().contiguous().view(torch.uint8), b.detach().contiguous().view(torch.uint8))


def last(helper):
    """The last CallRecord as a plain tuple (route, plan word or 0, reason label or None, chunks, phase)."""
    rec = helper.history[-1]
    reason = rec.reason.label if rec.reason is not None else None  # DISABLED is 0: test for None
    return (rec.route, rec.plan.word if rec.plan else 0, reason, rec.chunks,
            rec.phase.name)


@contextlib.contextmanager
def local_config(h, **changes):
    """``h``'s planning configuration (``planner.PlanConfig``) changed on this rank only inside the block (the
    proposal cache dropped on entry and exit): how a test gives one rank a local reason to decline
    (``dtypes=()``: its transport moves no dtype) or to fail while proposing (``long_training="bogus"``)."""
    saved = {name: getattr(h.planner.config, name) for name in changes}
    h.planner.replace(**changes)
    try:
        yield h
    finally:
        h.planner.replace(**saved)


def non_contiguous(x):
    """``x`` with the same shape and values in a non-contiguous layout: a real rank-local reason to decline."""
    import torch

    return torch.empty_strided(x.shape, tuple(reversed(torch.empty(tuple(reversed(x.shape))).stride())),
                               dtype=x.dtype).copy_(x).requires_grad_(x.requires_grad)


@contextlib.contextmanager
def forced_capture(h):
    """CUDA-graph capture forced on for ``h``'s calls inside the block (CPU has no graphs: ``build_helper`` gave
    ``h`` a ``CaptureSwitch`` as its ``capturing``), off again after it."""
    switch = capture_switch(h)
    switch.on = True
    try:
        yield h
    finally:
        switch.on = False


def catch(fn, *args, **kw):
    """Run ``fn``; return ("ok", result) or (exception type name, message, field name or None)."""
    try:
        return ("ok", fn(*args, **kw))
    except Exception as exc:  # noqa: BLE001 - the test asserts on what came back
        field = getattr(exc, "field", None)
        return (type(exc).__name__, str(exc), field.name if field is not None else None)


def script_env(**extra: str) -> dict[str, str]:
    """The environment a check script under ``tests/distributed/`` runs in as a subprocess (its own torchrun, or
    plain python): this repository on PYTHONPATH, NVLS off as on the GPU hosts, no rank variables of a launcher
    this test may run under; ``extra`` on top."""
    import os
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "NCCL_NVLS_ENABLE": "0", **extra}
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        env.pop(key, None)
    return env


# ---------------------------------------------------------------------------------------------------
# The built kernel library the shared-memory vote tests load (scripts/build_kernel.sh 2.28.9 build/kernel;
# FASTVIDEO_KERNEL_TEST_BUILD overrides), or why they skip.

def _built_vote_library():
    import ctypes
    import os
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    try:
        import fastvideo_kernel
    except ImportError:  # the loader is pure Python: use it from the source tree (sys.path reaches the ranks)
        sys.path.insert(0, str(repo / "fastvideo-kernel"))
        import fastvideo_kernel

    built = Path(os.environ.get("FASTVIDEO_KERNEL_TEST_BUILD")
                 or repo / "build" / "kernel" / fastvideo_kernel.LIBRARY_NAME)
    if not built.is_file():
        return built, f"no built kernel library at {built} (run scripts/build_kernel.sh 2.28.9 build/kernel)"
    try:
        lib = ctypes.CDLL(str(built))
    except OSError as exc:
        return built, f"built library {built} cannot be loaded here: {exc}"
    missing = [name for name in fastvideo_kernel.VOTE_SYMBOLS if not hasattr(lib, name)]
    return built, (f"built library {built} predates the shared-memory vote (lacks {missing})" if missing else None)


BUILT_LIBRARY, SHM_VOTE_SKIP = _built_vote_library()
SHM_VOTE_ENV = {"FASTVIDEO_KERNEL_LIBRARY": str(BUILT_LIBRARY)}  # how the ranks load it, as in production
