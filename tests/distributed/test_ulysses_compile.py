"""torch.compile of the public op without graph breaks (``fastvideo::ulysses_all_to_all_4d``), over gloo ranks.

``torch.compile(f, fullgraph=True)`` of a function calling the public op twice traces one opaque op per call
(a Python collective in the graph would raise ``Unsupported: HOP: Unsafe side effect``). On two gloo ranks:

* ``fullgraph=True`` with ``aot_eager`` (under each route: the test is marked ambient on it) and with
  ``inductor`` (once, on the CPU fused route, where the backward must run its forward's plan): forward and
  backward bit-exact against eager, one compiled frame for two calls with the same shapes, and every
  compiled call still votes (the helper's history has the eager call sequence: phases, routes, plans);
* a sequence length marked dynamic compiles once for three lengths (the control without the mark
  compiles twice for two);
* checked mode checks compiled calls too (ranks whose compiled graphs disagree raise on every rank);
* ``torch.library.opcheck`` passes on a forward's and a backward's call of the op (the control: a
  deliberately wrong fake impl fails it);
* a FakeTensor never reaches a collective (a fake output of the right shape, no vote), and a meta tensor
  outside tracing raises.

Inductor compiles C++ on CPU: its one case costs about 16 s on the 2-core CI VM with a cold cache
(``/tmp/torchinductor_<user>``) and about 5 s warm.
"""

from __future__ import annotations

import pytest
import torch

from fastvideo import envs
from fastvideo.distributed.ulysses.policy import Plan
from tests.distributed.conftest import bit_equal, build_helper, oracle, rank_input

A2A, CHECKED = "FASTVIDEO_ULYSSES_A2A", "FASTVIDEO_ULYSSES_A2A_CHECKED"
SHAPE = (2, 4, 12, 8)  # [B, S_local, H, D]; H = 12 has the CPU fixture's tuned rows (fused, 144 CTAs)


def _two_calls(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What a DiT attention block does with the op: there, work on the head shard, and back."""
    from fastvideo.distributed.communication_op import sequence_model_parallel_all_to_all_4D as a2a

    y = a2a(x, 2, 1)
    return a2a(y * w, 1, 2)


def _step(fn, rank: int, seed: int, between=None):
    """One forward + backward of ``fn`` on this rank's input: (output, input gradient). ``between()`` runs
    after the forward, before the backward."""
    x = rank_input(rank, SHAPE, seed=seed, requires_grad=True)
    w = rank_input(rank + 100, (SHAPE[0], SHAPE[1] * 2, SHAPE[2] // 2, SHAPE[3]), seed=seed)
    g = rank_input(rank + 200, SHAPE, seed=seed)
    out = fn(x, w)
    if between is not None:
        between()
    (out * g).sum().backward()
    return out.detach(), x.grad


def _records(helper, start: int) -> list[tuple]:
    if helper is None:
        return []
    return [(r.phase.name, r.mode, r.route, r.plan.word if r.plan else 0, None if r.reason is None else r.reason.label)
            for r in list(helper.history)[start:]]


def _compiled_exact(rank, world_size, backend, fused):
    from torch._dynamo.testing import CompileCounterWithBackend

    from fastvideo.distributed.ulysses import registry
    from fastvideo.distributed.ulysses.policy import Geometry

    if fused:
        registry.install_default_helper(build_helper())
    _step(_two_calls, rank, seed=1)  # builds the helper (collective) before anything is counted
    helper = registry.current_default_helper()
    table = helper.tuned_table if helper is not None else ()
    policy_at_backward = []

    def drop_tuned_rows() -> None:
        # Between forward and backward the policy changes (no tuned rows: the original plan). The backward
        # must still run the plan its forward ran, which only the op's saved tensor carries through the graph.
        if fused:
            helper.tuned_table = ()
            geom = Geometry.from_input(SHAPE, 0, world_size, torch.float32)
            policy_at_backward.append(helper.plan_for(geom, grad=True).plan.word)

    def step(fn) -> tuple:
        mark = len(helper.history) if helper is not None else 0
        try:
            return _step(fn, rank, seed=1, between=drop_tuned_rows), _records(helper, mark)
        finally:
            if helper is not None:
                helper.tuned_table = table

    eager, eager_records = step(_two_calls)
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(_two_calls, backend=counter, fullgraph=True)
    first, first_records = step(compiled)
    second, _ = step(compiled)
    exact = [bit_equal(a, b) for got in (first, second) for a, b in zip(got, eager)]
    return exact, counter.frame_count, eager_records, first_records, policy_at_backward


@pytest.mark.ambient(A2A)
def test_fullgraph_aot_eager_is_exact_compiles_once_and_still_votes(ranks, ulysses_ambient):
    """Both routes (off: the NCCL route, no helper; auto: the helper that declined at construction on CPU):
    fullgraph compiles, output and input gradient bit-exact vs eager, one frame for two calls."""
    for exact, frames, eager_records, compiled_records, _ in ranks(2, _compiled_exact, "aot_eager", False):
        assert exact == [True] * 4 and frames == 1
        assert compiled_records == eager_records  # the same calls reached the helper (none under off)
        assert len(eager_records) == (4 if envs.registry()[A2A].parse(ulysses_ambient[A2A]) == "auto" else 0)


def test_fullgraph_inductor_on_the_fused_route_runs_the_forwards_plan_in_backward(ranks):
    """Inductor, auto with the CPU fused transport: bit-exact forward and backward, one frame, and the
    compiled graph's four calls voted and ran fused, each backward with the plan its forward ran."""
    results = ranks(2, _compiled_exact, "inductor", True, env={A2A: "auto"}, timeout_s=240)
    for exact, frames, eager_records, compiled_records, policy_at_backward in results:
        assert exact == [True] * 4 and frames == 1
        assert compiled_records == eager_records
        phases = [(phase, mode, route) for phase, mode, route, _, _ in compiled_records]
        assert phases == [("FORWARD_GRAD", 0, "fused"), ("FORWARD_GRAD", 1, "fused"), ("BACKWARD", 0, "fused"),
                          ("BACKWARD", 1, "fused")]
        plans = [plan for _, _, _, plan, _ in compiled_records]
        tuned = Plan.from_word(plans[0])
        assert tuned.tuned and tuned.ctas == 144 and plans == [plans[0]] * 4  # backward: the forward's plan
        # Control: what the policy would have chosen at backward time is another plan (the original one).
        assert policy_at_backward and all(Plan.from_word(w).ctas == 36 for w in policy_at_backward)


# ------------------------------------------------------------------------------------- dynamic lengths


def _dynamic(rank, world_size):
    from torch._dynamo.testing import CompileCounterWithBackend

    from fastvideo.distributed.communication_op import sequence_model_parallel_all_to_all_4D as a2a

    def f(x):
        return a2a(a2a(x, 2, 1) * 2, 1, 2)

    results = []
    for mark in (True, False):
        counter = CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(f, backend=counter, fullgraph=True, dynamic=None if mark else False)
        exact = []
        for s in (4, 6, 8)[: 3 if mark else 2]:
            x = rank_input(rank, (2, s, 12, 8), seed=s)
            if mark:
                torch._dynamo.mark_dynamic(x, 1)
            exact.append(bit_equal(compiled(x), f(x)))
        results.append((exact, counter.frame_count))
    return results


def test_dynamic_sequence_length_compiles_once(ranks):
    """S_local marked dynamic: one frame for S = 4, 6, 8, each exact. Control, unmarked and dynamic=False:
    two lengths, two frames (the counter counts recompiles)."""
    for marked, control in ranks(2, _dynamic):
        assert marked == ([True] * 3, 1)
        assert control == ([True] * 2, 2)


# ------------------------------------------------------------------------------------- checked mode, compiled


def _checked_compiled(rank, world_size):
    from fastvideo.distributed.ulysses import registry

    eager = _step(_two_calls, rank, seed=2)
    before = len(registry.current_checked_off_helper().vote_seconds())
    compiled = torch.compile(_two_calls, backend="aot_eager", fullgraph=True)
    exact = all(bit_equal(a, b) for a, b in zip(_step(compiled, rank, seed=2), eager))
    votes = len(registry.current_checked_off_helper().vote_seconds()) - before
    # Rank 1 compiles a graph for another batch size: the first vote of its compiled call catches it.
    b = SHAPE[0] + rank
    x = rank_input(rank, (b, *SHAPE[1:]))
    w = torch.ones(b, SHAPE[1] * 2, SHAPE[2] // 2, SHAPE[3])
    try:
        compiled(x, w)
        mismatch = ("ok", None)
    except Exception as exc:  # noqa: BLE001 - the test asserts on what came back
        mismatch = (type(exc).__name__, getattr(getattr(exc, "field", None), "name", None))
    return exact, votes, mismatch


def test_checked_mode_votes_every_compiled_call(ranks):
    """off + checked: the compiled forward + backward are exact and vote 4 times, and compiled graphs that
    disagree across ranks (another B on rank 1) raise ContractMismatchError naming B on every rank."""
    for exact, votes, mismatch in ranks(2, _checked_compiled, env={A2A: "off", CHECKED: "1"}):
        assert exact and votes == 4
        assert mismatch == ("ContractMismatchError", "B")


# ------------------------------------------------------------------------------------- opcheck


def _opcheck(rank, world_size):
    from fastvideo.distributed.parallel_state import get_sp_group
    from fastvideo.distributed.ulysses.exchange import issue
    from fastvideo.distributed.ulysses.ops import call  # noqa: F401 - defines the ops opcheck calls

    op = torch.ops.fastvideo.ulysses_all_to_all_4d.default
    x = rank_input(rank, SHAPE, seed=3)
    # A forward's saved outcome carries its SEQ word, the call count every call advances, so two runs of a forward
    # differ there by design: the AOT-dispatch checks (which compare two runs) take the backward's call, whose word
    # is its forward's (carried in ``outcome``), the same on every run.
    forward_checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    results = [torch.library.opcheck(op, (x.clone().requires_grad_(), 0, True, None, 0), test_utils=forward_checks)]
    out, outcome = op(x, 0, False, None, 0)
    results.append(torch.library.opcheck(op, (torch.ones_like(out), 1, False, outcome, 0)))  # a backward's call

    # Negative control: the same eager implementation behind a fake impl with the wrong output shape.
    @torch.library.custom_op("fastvideo_test::wrong_fake", mutates_args=())
    def wrong(t: torch.Tensor) -> torch.Tensor:
        return issue(get_sp_group(), t, 0, False, None, 0, None, None, None)[0]

    @wrong.register_fake
    def _(t):
        return t.new_empty(t.shape)  # should be [B, S*P, H/P, D]

    try:
        torch.library.opcheck(wrong, (x,), test_utils=("test_faketensor",))
        control = "passed"
    except Exception as exc:  # noqa: BLE001 - the test asserts on what came back
        control = type(exc).__name__
    return [sorted(set(r.values())) for r in results], control


def test_opcheck_passes_on_the_forward_and_backward_calls_and_fails_a_wrong_fake(ranks):
    """opcheck (schema, autograd registration, fake tensor; AOT dispatch on the backward's call, whose outputs are
    the same on every run) on two ranks in lockstep, under auto (the helper's path; the checks are about the op's
    registration, the same under either route)."""
    for results, control in ranks(2, _opcheck, env={A2A: "auto"}, timeout_s=120):
        assert results == [["SUCCESS"]] * 2
        assert control == "OpCheckError"


# ------------------------------------------------------------------------------------- fake and meta tensors


def _fake_and_meta(rank, world_size):
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fastvideo.distributed.communication_op import sequence_model_parallel_all_to_all_4D as a2a

    fake_shape = None
    if rank == 0:  # rank 1 is not calling anything: a collective or a vote here would hang until the timeout
        with FakeTensorMode():
            y = a2a(torch.empty(SHAPE), 2, 1)
            fake_shape = (type(y).__name__, tuple(y.shape), tuple(y.stride()), y.dtype)
    meta = []
    for call in (lambda t: a2a(t, 2, 1), lambda t: torch.ops.fastvideo.ulysses_all_to_all_4d(t, 0, False, None, 0)):
        try:
            call(torch.empty(SHAPE, device="meta"))
            meta.append("returned")
        except ValueError as exc:
            meta.append(str(exc))
    x = rank_input(rank, SHAPE)  # both ranks still in step: the next real call is exact
    return fake_shape, meta, bit_equal(a2a(x, 2, 1), oracle(x, 0))


def test_fake_tensor_gets_a_fake_output_and_meta_raises(ranks):
    """FakeTensorMode on rank 0 alone: a fake [B, S*P, H/P, D] output, contiguous, no collective and no vote
    (checked mode on, 20 s vote timeout: a vote would have failed; 5 s flaked on a loaded 2-core machine). A
    meta tensor outside tracing, through the public function or the op itself: ValueError naming the meta
    tensor, on both ranks, no hang."""
    env = {A2A: "auto", CHECKED: "1", "FASTVIDEO_ULYSSES_A2A_VOTE_TIMEOUT_S": "20"}
    results = ranks(2, _fake_and_meta, env=env, timeout_s=60)
    b, s, h, d = SHAPE
    assert results[0][0] == ("FakeTensor", (b, 2 * s, h // 2, d), (2 * s * h // 2 * d, h // 2 * d, d, 1),
                             torch.float32)
    for _, meta, in_step in results:
        assert len(meta) == 2 and all("meta tensor" in m for m in meta), meta
        assert in_step


# ------------------------------------------------------------------------------------- CUDA-graph trees


def test_the_op_is_left_out_of_inductor_cuda_graphs():
    """The op carries torch.Tag.cudagraph_unsafe, which inductor's CUDA-graph trees read to run an op between
    captured partitions (so it votes on every replay) instead of capturing it; aten.mul is the control."""
    from torch._inductor.utils import is_cudagraph_unsafe_fx_node

    import fastvideo.distributed.ulysses.ops  # noqa: F401 - registers the op

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    node = graph.call_function(torch.ops.fastvideo.ulysses_all_to_all_4d.default, (x, 0, False, None, 0))
    control = graph.call_function(torch.ops.aten.mul.Tensor, (x, x))
    assert is_cudagraph_unsafe_fx_node(node) and not is_cudagraph_unsafe_fx_node(control)
