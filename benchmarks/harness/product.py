"""The one place the benchmarks reach into fastvideo beyond its public surface.

Everything here is either an attribute the helper does not promise (``transport``, ``capability``,
``gpu_name``), a measurement-only call of the native transport (``fabric_copy``), a module that is moving (the
default-helper registry), or a stub a measurement installs for its own process. When the product moves one of
these, this file is the one to change. The helper's promised surface (``UlyssesHelper(...)``, ``stats()``,
``history``, ``vote_seconds()``, ``destroy()``, ``fused_available``, ``tuned_table``, ``window_bytes``) is used
directly by the cases.

Imports are deferred to the call: the tree under test is put on ``sys.path`` first (``harness.tree``). Where
an older tree under ``--compare-revs`` kept something elsewhere, the adapter says so and handles both.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import torch


def registry() -> ModuleType:
    """The module that holds the op's default helper (``install_default_helper``, ``get_default_helper``,
    ``current_default_helper``): ``ulysses.registry`` (older trees: ``ulysses.helper``)."""
    try:
        from fastvideo.distributed.ulysses import registry as module
    except ImportError:
        from fastvideo.distributed.ulysses import helper as module
    return module


def plan_transport() -> type:
    """The CPU plan transport (``GlooPlanTransport``, a simulation): the tree's own where it ships one in the package
    (older trees), else this repository's ``tests/plan_transport.py``, loaded from its file (a tree under test that
    is first on ``sys.path`` shadows the ``tests`` package)."""
    try:
        from fastvideo.distributed.ulysses.transport import GlooPlanTransport
    except ImportError:
        name = "_benchmarks_plan_transport"
        module = sys.modules.get(name)
        if module is None:
            spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[2] / "tests"
                                                          / "plan_transport.py")
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
        GlooPlanTransport = module.GlooPlanTransport
    return GlooPlanTransport


def default_helper(device: torch.device):
    """The helper the public op uses under ``auto``, built if needed. Collective (construction).

    On CPU it is built on ``GlooPlanTransport`` and installed as the default, so the whole fused pipeline (vote,
    plans, chunks, window) runs over gloo (its timings mean nothing); without it ``auto`` on CPU declines at
    construction and every call takes the NCCL route.
    """
    if device.type != "cuda":
        from fastvideo.distributed.ulysses.helper import UlyssesHelper

        helper = UlyssesHelper(transport=plan_transport()())
        registry().install_default_helper(helper)
        return helper
    return registry().get_default_helper()


def current_default_helper():
    """The op's default helper if one exists (never builds one)."""
    return registry().current_default_helper()


def transport(helper):
    """The helper's transport (its ``execute(x, geom, plan)`` runs one plan with no vote and no policy)."""
    return getattr(helper, "transport", None)


def entry_points(helper) -> frozenset[str]:
    """The entry points the helper's transport reported (``fabric``, ``ce``, ...); empty without a transport."""
    capability = getattr(helper, "capability", None)
    return frozenset(getattr(capability, "entry_points", ()) or ())


def gpu_key(helper) -> str:
    """The GPU model as the policy's table is keyed (``H200``; ``CPU`` on CPU)."""
    from fastvideo.distributed.ulysses.policy import normalize_gpu_name

    return normalize_gpu_name(getattr(helper, "gpu_name", "cpu"))


def library_candidates(helper) -> list[str]:
    """Paths the helper's transport names for the native library it loaded (its capability's ``detail``)."""
    out = []
    t = transport(helper)
    for attr in ("library_path", "lib_path", "path"):
        value = getattr(t, attr, None)
        if isinstance(value, (str, os.PathLike)) and value:
            out.append(str(value))
    capability = getattr(helper, "capability", None)
    if capability is not None and getattr(capability, "present", False) and getattr(capability, "detail", ""):
        out.append(capability.detail)  # NativeTransport reports the loaded library's path here
    return out


def _native_testing():
    """The test library's Python side (``tests/kernel/native_testing.py``), or None where it is not importable."""
    try:
        from tests.kernel import native_testing
    except ImportError:
        return None
    return native_testing


def can_fabric_copy(helper) -> bool:
    """Whether ``fabric_copy`` can run: a constructed native transport on the test library (this tree), or one
    with its own ``fabric_copy`` (older trees under ``--compare-revs``). The same answer on every rank: every
    rank loads the same library."""
    if helper is None or not helper.fused_available:
        return False
    t = transport(helper)
    if hasattr(t, "fabric_copy"):
        return "fabric" in entry_points(helper)
    testing = _native_testing()
    return testing is not None and testing.available(t)


def fabric_copy(helper, nbytes: int, *, engine: int, ctas: int) -> None:
    """``fvk_fabric_copy`` on the helper's communicator: barrier, every rank pushes ``nbytes`` into every peer's
    window at once (``engine`` 0: copy engines, 1: SM stores with ``ctas`` CTAs), barrier.

    Collective (every rank with the same arguments), enqueued on the current stream, not capture-safe; bypasses
    the vote. The only call site of this measurement-only entry point."""
    t = transport(helper)
    if hasattr(t, "fabric_copy"):  # an older tree's transport
        t.fabric_copy(nbytes, engine=engine, ctas=ctas)
        return
    _native_testing().fabric_copy(t, nbytes, engine=engine, ctas=ctas)


@contextlib.contextmanager
def one_rank_helpers() -> Iterator[None]:
    """Let helpers be built at P = 1 inside the block (the policy's minimum SP size lowered to 1 in this process),
    for measurements of everything in a fused call but the peer. Local; restores the bound on exit."""
    from fastvideo.distributed.ulysses import policy

    try:  # where construction checks the SP size (older trees: the helper module)
        from fastvideo.distributed.ulysses import construction as checker
    except ImportError:
        from fastvideo.distributed.ulysses import helper as checker
    saved = policy.MIN_WORLD_SIZE, checker.MIN_WORLD_SIZE
    policy.MIN_WORLD_SIZE = checker.MIN_WORLD_SIZE = 1
    try:
        yield
    finally:
        policy.MIN_WORLD_SIZE, checker.MIN_WORLD_SIZE = saved


def hot_path(helper, on: bool) -> None:
    """Turn ``helper``'s hot path (``fastvideo/distributed/ulysses/hot.py``) off or on between calls, for an A/B on
    one helper: the table it holds is emptied either way, so an "on" row starts as a first call does (learned at its
    first call; ``stats()["hot_calls"]`` counts the calls that then take it). Local. Raises SystemExit for ``on``
    where the helper cannot have it (saying why)."""
    if hasattr(helper, "use_hot_path"):  # a helper with the switch
        why = helper.use_hot_path(on)
        if on and why:
            raise SystemExit(f"the hot path is unavailable here: {why}")
        return
    from fastvideo.distributed.ulysses import hot  # older trees: the helper's own fields

    if on and helper.hot_decline:
        raise SystemExit(f"the hot path is unavailable here: {helper.hot_decline}")
    hot.forget(helper)  # the next learn takes the table over, emptied (hot.learn)
    helper._hot, helper._hot_ok = None, on


def one_rank_native_transport(device: torch.device, window_bytes: int):
    """A ``NativeTransport`` constructed at P = 1 on ``device`` (its own one-rank NCCL communicator and window),
    or ``(None, why)`` where the kernel library is unavailable. Local (no peers). Returns (transport, detail)."""
    from fastvideo.distributed.ulysses.native import NativeTransport
    from fastvideo.distributed.ulysses.transport import ConstructionContext

    native = NativeTransport()
    capability = native.capability()
    if not capability.present:
        return None, capability.detail
    ctx = ConstructionContext(rank=0, world_size=1, device=device, window_bytes=window_bytes, max_ctas=144,
                              device_group=None, all_gather_object=lambda obj: [obj])
    for step in native.construction_steps(ctx):
        step.run()
    return native, capability.detail


def library_noop(native):
    """A no-op call into the transport's library (``fvk_abi_version``): the cost of one ctypes call."""
    return native._lib.fvk_abi_version


def _route_sites(modules: tuple[str, ...]) -> list[tuple[object, str, object]]:
    """``(owner, name, stub)`` for the first of ``modules`` (``fastvideo.distributed.<module>``) that holds the
    NCCL route as ``nccl_route``, else the oldest trees' ``communication_op._NcclAllToAll.apply``."""
    import importlib

    stub = lambda t, mode, group, **_: t  # noqa: E731 - ``**_``: the route's keyword-only splits and flags
    for module in modules:
        try:
            target = importlib.import_module(f"fastvideo.distributed.{module}")
        except ImportError:
            continue
        if "nccl_route" in vars(target):
            return [(target, "nccl_route", stub)]
    from fastvideo.distributed import communication_op as op

    return [(op._NcclAllToAll, "apply", staticmethod(lambda t, mode, group: t))]


@contextlib.contextmanager
def _stubbed(sites: list[tuple[object, str, object]]) -> Iterator[None]:
    saved = [(owner, name, owner.__dict__[name]) for owner, name, _ in sites]
    for owner, name, stub in sites:
        setattr(owner, name, stub)
    try:
        yield
    finally:
        for owner, name, real in saved:
            setattr(owner, name, real)


def stub_public_op_route() -> contextlib.AbstractContextManager:
    """Replace the public op's NCCL route (``off``) with an identity in this process: what the op itself adds. The
    route is the exchange's ``nccl_route`` (older trees: the op module's, then ``_NcclAllToAll.apply``)."""
    return _stubbed(_route_sites(("ulysses.exchange", "ulysses.ops")))


def stub_checked_route() -> contextlib.AbstractContextManager:
    """Replace the route the checked mode's decline runs with an identity (the exchange's ``nccl_route``; older
    trees: the helper module's)."""
    return _stubbed(_route_sites(("ulysses.exchange", "ulysses.helper")))


def checked_vote_kind() -> str | None:
    """Which vote the checked mode's helper of the ``off`` route used (``shm`` or ``gloo``), if it exists."""
    module = registry()
    current = getattr(module, "current_checked_off_helper", None)
    checked = current() if current is not None else getattr(module, "_CHECKED_OFF", None)
    return checked.stats()["vote"] if checked is not None else None


@contextlib.contextmanager
def stub_sp_group(world_size: int = 2) -> Iterator[None]:
    """The public op in this process alone: its SP group replaced by a stub of ``world_size`` with the ``off``
    route agreed (checked mode off) and its NCCL route by an identity. Local; restored on exit."""
    from fastvideo.distributed import communication_op as op

    class StubGroup:
        device_group = None
        rank_in_group = 0

        def __init__(self) -> None:
            self.world_size = world_size

    group = StubGroup()
    patches: list[tuple[object, str, object]] = [(op, "get_sp_group", lambda: group)]
    undo_on_exit: list[Callable[[], None]] = []
    try:  # this tree: settings agreed once; the route is the registry's (None: the NCCL route)
        from fastvideo.distributed.ulysses import ops
        from fastvideo.distributed.ulysses import registry as routes

        patches.append((ops, "get_sp_group", lambda: group))
        if hasattr(routes, "use_route"):  # the route until the next resolution; reset on exit
            routes.use_route(None)
            undo_on_exit.append(routes.reset)
        else:  # older trees kept the resolved route as a module global
            patches.append((routes, "ROUTE", None))
    except ImportError:  # older trees re-read the settings per call through the SP group
        from fastvideo.distributed import settings

        agreed = settings.AgreedSettings(settings.raw_now(), {"FASTVIDEO_ULYSSES_A2A": "off",
                                                              "FASTVIDEO_ULYSSES_A2A_CHECKED": False})
        group.agreed_settings = lambda: agreed  # type: ignore[attr-defined]
    saved = [(target, name, getattr(target, name)) for target, name, _ in patches]
    for target, name, value in patches:
        setattr(target, name, value)
    try:
        with stub_public_op_route():
            yield
    finally:
        for target, name, value in saved:
            setattr(target, name, value)
        for undo in undo_on_exit:
            undo()


def send_layout(x: torch.Tensor, mode: int, world_size: int) -> torch.Tensor:
    """The NCCL route's already-permuted send buffer for ``x`` (what ``all_to_all_single`` moves)."""
    try:
        from fastvideo.distributed.all_to_all import send_layout as layout
    except ImportError:
        try:  # the trees of early December (dc38bf4 among them) kept it in the ulysses package
            from fastvideo.distributed.ulysses.layout import send_layout as layout
        except ImportError:  # older trees re-exported it from the public module
            from fastvideo.distributed.communication_op import _send_layout as layout
    return layout(x, mode, world_size)


@contextlib.contextmanager
def settings(**values: str | None) -> Iterator[None]:
    """FastVideo settings for the block on every rank (collective: every rank enters it at the same point). This
    tree agrees settings explicitly (``override_ulysses_settings``); an older tree re-read the environment per
    call, so a plain override was enough there."""
    from fastvideo import envs
    from fastvideo.distributed import parallel_state

    override = getattr(parallel_state, "override_ulysses_settings", None)
    if override is None or not parallel_state.model_parallel_is_initialized():
        with envs.override(**values):
            yield
        return
    with override(**values):
        yield


def agree_settings() -> None:
    """Collective where the tree agrees settings explicitly (this one): agree the environment as it is now."""
    from fastvideo.distributed import parallel_state

    agree = getattr(parallel_state, "agree_ulysses_settings", None)
    if agree is not None and parallel_state.model_parallel_is_initialized():
        agree()


def call_stages(helper, x, mode: int) -> dict:
    """The fused call cut at its layers, each a callable returning the output, for a decomposition of its host time
    (this tree's helper or an older one's): ``call`` (``UlyssesHelper.call`` on validated input: no public-function
    checks), ``native`` (where the helper's hot lane holds this signature: the lane's native call and the
    transport's end of it, no helper frame), ``voted`` (the transport's voted launch alone: this call's proposal,
    the library's vote and launch, no helper bookkeeping; only where the helper fuses the vote) and ``launch`` (the
    transport's launch without a vote). Local; makes one call of the lane to find whether it holds the signature."""
    import itertools

    try:
        from fastvideo.distributed.all_to_all import EVEN
    except ImportError:  # older trees kept the split tables in the layout module
        from fastvideo.distributed.ulysses.layout import EVEN
    from fastvideo.distributed.ulysses.contract import Phase
    from fastvideo.distributed.ulysses.planner import Signature

    t = transport(helper)
    sig = Signature(x.shape, x.dtype, x.device, mode, Phase.FORWARD_NO_GRAD, None, False, x.is_contiguous(),
                    x.data_ptr() % x.element_size() == 0, EVEN)
    proposal = helper.planner.propose(sig)
    stages = {"call": lambda: helper.call(x, mode)[0],
              "launch": lambda: t.execute(x, proposal.geom, proposal.plan)}
    stats = helper.stats()
    if stats["voted_launch"] if "voted_launch" in stats else getattr(helper, "_fused_vote", False):
        seq = itertools.count(1 << 40)  # SEQ words no helper call uses (P = 1: no peer compares them)
        runtime = getattr(helper, "_runtime", None)  # older trees keep the channel on the helper itself
        vote = runtime.call_vote if runtime is not None else helper._call_vote
        stages["voted"] = lambda: t.execute(x, proposal.geom, proposal.plan, vote=vote, fields=proposal.fields,
                                            seq=next(seq))
        # The hot lane (older trees: its table itself, None while it holds nothing): its run returns None for a
        # signature it does not hold, else the launch, which its finish completes.
        lane = getattr(helper, "_hot", None)
        run = getattr(lane, "run", None)
        hit = run(x, mode, next(seq)) if run is not None else None
        if hit is not None:
            finish = lane.finish
            finish(x, hit, vote)
            stages["native"] = lambda: finish(x, run(x, mode, next(seq)), vote)
    return stages
