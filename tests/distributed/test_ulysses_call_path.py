"""The fused call's path from the public function to the library call, traced rather than read.

``docs/architecture.md`` lists the modules one eager fused call passes through, in order, none entered twice (a
module is entered twice when the call leaves it for another module and comes back into it, or enters it again
after leaving): the public function, the op layer, the SP group, the core, the layouts' validation, the route,
the helper (which numbers the call itself: an untagged call enters no tag counter), its runtime, the transport.
Two gloo ranks run the public function on a helper whose transport is the native one driving the stand-in library
of ``tests/kernel/test_native_dispatch.py`` (the voted form, over the real shared-memory vote), and a profile hook
records every Python function of ``fastvideo/`` entered from the call's start to the library call. The checks read
that record: the modules entered, in order, each once; the chain of modules on the stack at the last Python call
before the library's. A negative control feeds the checker a record in which a module is entered twice.
"""

from __future__ import annotations

import sys

import pytest

from tests.distributed.conftest import SHM_VOTE_ENV, SHM_VOTE_SKIP, rank_input, stand_in_native_helper

pytestmark = pytest.mark.skipif(SHM_VOTE_SKIP is not None, reason=SHM_VOTE_SKIP or "")

PATH = ("communication_op", "ulysses.ops", "sp_groups", "ulysses.exchange", "all_to_all", "ulysses.registry",
        "ulysses.helper", "ulysses.runtime", "ulysses.native")
# On the stack at the launch: the public function, the op layer, the core, the helper, its runtime, the transport.
CHAIN = ("communication_op", "ulysses.ops", "ulysses.exchange", "ulysses.helper", "ulysses.runtime", "ulysses.native")
SHAPE = (3, 16, 12, 8)


def _module(frame) -> str | None:
    name = frame.f_globals.get("__name__", "")
    return name.removeprefix("fastvideo.distributed.") if name.startswith("fastvideo.") else None


def _chain(frame) -> tuple[str, ...]:
    """The ``fastvideo`` modules on the stack from the outermost frame in to ``frame``, a run of one module's frames
    as one entry."""
    found = []
    while frame is not None:
        module = _module(frame)
        if module is not None and (not found or found[-1] != module):
            found.append(module)
        frame = frame.f_back
    return tuple(reversed(found))


def record(call, launched) -> tuple[list[str], tuple[str, ...]]:
    """Run ``call`` under a profile hook until ``launched`` (a list the library stand-in appends to) is non-empty:
    the ``fastvideo`` module of every Python function entered, in order, and the module chain at the launch."""
    entered: list[str] = []
    at_launch: list[tuple[str, ...]] = []

    def hook(frame, event, arg) -> None:
        if launched or event != "call":
            return
        module = _module(frame)
        if module is not None:
            entered.append(module)
            at_launch[:] = [_chain(frame)]

    sys.setprofile(hook)
    try:
        call()
    finally:
        sys.setprofile(None)
    return entered, at_launch[0] if at_launch else ()


def stays(entered: list[str]) -> list[str]:
    """The modules in the order the call entered them, consecutive functions of one module as one stay."""
    return [m for i, m in enumerate(entered) if i == 0 or entered[i - 1] != m]


def reentered(entered: list[str]) -> list[str]:
    """The modules with more than one stay: entered, left, and entered again."""
    order = stays(entered)
    return sorted({m for m in order if order.count(m) > 1})


def _traced_call(rank: int, world_size: int, hot: bool = False):
    import torch

    from fastvideo.distributed import sequence_model_parallel_all_to_all_4D
    from fastvideo.distributed.ulysses import registry
    launched: list = []

    def launch(lib):
        if hot:  # a C-callable stand-in (the extension calls the launch by its address); it appends per launch
            from tests.distributed.test_ulysses_hot_path import _stand_in

            return _stand_in(world_size, launched)
        python_launch = lib.fvk_launch

        def counted(*args):
            launched.append(1)
            return python_launch(*args)

        return counted

    helper, _ = stand_in_native_helper(rank, world_size, launch, hot)
    registry.use_route(helper)
    x = rank_input(rank, SHAPE, torch.float32)
    try:
        with torch.no_grad():
            for _ in range(2):  # the caches warm: the planner's, the launch's, the vote row's
                sequence_model_parallel_all_to_all_4D(x, 2, 1)
            ran = (helper.history[-1].route, helper.stats()["voted_launch"])
            launched.clear()
            hot_calls = helper.stats()["hot_calls"]
            entered, chain = record(lambda: sequence_model_parallel_all_to_all_4D(x, 2, 1), launched)
            hot_calls = helper.stats()["hot_calls"] - hot_calls
    finally:
        registry.reset()
        helper.destroy()
    return ran, len(launched), entered, chain, hot_calls


def test_the_fused_call_enters_each_module_once_before_the_library_call(ranks):
    for r in ranks(2, _traced_call, env=SHM_VOTE_ENV):
        ran, launches, entered, chain, hot_calls = r
        assert ran == ("fused", True)  # the voted form on the native transport
        assert launches == 1 and hot_calls == 0
        assert tuple(stays(entered)) == PATH, " ".join(stays(entered))
        assert reentered(entered) == []
        assert chain == CHAIN


def test_on_the_hot_path_the_call_enters_each_module_once_then_one_native_call(ranks):
    """A signature launched fused before: the public function's modules and the helper, then the extension's one
    call (``HotCalls.run``) up to the library; the transport's module is not entered before the launch."""
    from tests.distributed.test_ulysses_hot_path import _hot_unavailable
    from tests.kernel.built import unavailable

    why = _hot_unavailable()
    if why is not None:
        unavailable(f"hot-path extension: {why}")
    for r in ranks(2, _traced_call, True, env=SHM_VOTE_ENV):
        ran, launches, entered, chain, hot_calls = r
        assert ran == ("fused", True) and launches == 1 and hot_calls == 1
        assert tuple(stays(entered)) == PATH[:-2], " ".join(stays(entered))
        assert reentered(entered) == []
        # the stack at the last Python call before the native one: the helper's call itself
        assert chain == CHAIN[:-2]


def test_negative_control_a_module_entered_twice_is_seen():
    """The record of a call that goes back into a module it left (the SP group's module read again after the
    input checks, as the public function once did) and one that calls out and back (a dataclass hash in the
    policy module, called from the transport)."""
    back = ["communication_op", "ulysses.ops", "sp_groups", "ulysses.exchange", "sp_groups", "all_to_all"]
    assert reentered(back) == ["sp_groups"] and tuple(stays(back)) != PATH
    out_and_back = ["ulysses.native", "ulysses.native", "ulysses.policy", "ulysses.native", "ulysses.vote"]
    assert reentered(out_and_back) == ["ulysses.native"]
    assert reentered(list(PATH)) == [] and stays(["a", "a", "b"]) == ["a", "b"]
