"""The all-to-all in flight (``async_op=True``: ``ulysses/ops.py``'s start and wait over ``ulysses/exchange.py``'s
core) over gloo ranks.

Outputs and gradients (first and second order) equal the synchronous op bit for bit on every CPU route, with the
route and plan of every call asserted; several exchanges in flight are each waited for their own result in any
order; a transport that lands its data late shows the wait really waits (the control reads the buffer without
waiting and sees unlanded data); ``torch.compile(fullgraph=True)`` traces a start and a separate wait node, and
the route of its starts and of eager's is asserted (``nccl_route_ran``; its negative control runs both through a
helper on the CPU plan transport, where that assertion fails).
"""

from __future__ import annotations

import shutil
import threading
import time

import pytest
import torch

from tests.distributed.conftest import a2a, bit_equal, build_helper, in_flight_routes, rank_input
from tests.plan_transport import GlooPlanTransport

B, S, H, D = 2, 4, 12, 3


def _records(h, n):
    return [(r.phase.name, r.route, r.plan.word if r.plan else 0, None if r.reason is None else r.reason.label)
            for r in list(h.history)[-n:]]


def _both_orders(rank, p, mode, dtype, use_helper):
    """The sync op and the async op on the same input: outputs, first- and second-order gradients, the route of
    each async start, and (through a helper) the call records of both."""
    from fastvideo.distributed.ulysses import exchange, ops

    h = build_helper(window_bytes=1 << 16) if use_helper else None
    shape = (B, S, H, D) if mode == 0 else (B, S * p, H // p, D)
    x = rank_input(rank, shape, dtype, seed=3, requires_grad=True)
    out_shape = (B, S * p, H // p, D) if mode == 0 else (B, S, H, D)
    w = rank_input(rank, out_shape, dtype, seed=4, requires_grad=True)
    v = rank_input(rank, shape, dtype, seed=5)
    routes = []
    real = exchange.issue

    def spy(*args, **kw):  # the route each start took
        started, saved = real(*args, **kw)
        if kw.get("in_flight"):
            routes.append(started.route)
        return started, saved

    exchange.issue = spy
    results = []
    try:
        for asynchronous in (False, True):
            y = (ops.all_to_all_async(x, mode, h).wait() if asynchronous else ops.all_to_all(x, mode, h))
            g, = torch.autograd.grad((y * w).sum(), x, create_graph=True)
            gg, = torch.autograd.grad((g * v).sum(), w)
            results.append((y.detach(), g.detach(), gg))
    finally:
        exchange.issue = real
    (y0, g0, s0), (y1, g1, s1) = results
    recs = _records(h, 6) if h is not None else None
    if h is not None:
        h.destroy()
    return (bit_equal(y0, y1), bit_equal(g0, g1), bit_equal(s0, s1)), routes, recs, exchange.in_flight()


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("mode", [0, 1])
def test_async_equals_sync_on_the_nccl_route(ranks, world_size, mode):
    """``off``: the async start runs gloo's ``all_to_all_single(async_op=True)`` (route ``nccl-async``) for the
    forward, the backward and the double backward; every result equals the synchronous op's bit for bit."""
    for exact, routes, _, left in ranks(world_size, _both_orders, mode, torch.float32, False):
        assert exact == (True, True, True)
        assert routes == ["nccl-async"] * 3 and left == 0  # forward, backward, double backward; none left


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_async_equals_sync_on_the_fused_route_with_the_same_plans(ranks, world_size):
    """Through a helper on the CPU plan transport: the async forward, backward and double backward run fused,
    with the very plans and phases the synchronous calls ran (the call records of both are the same)."""
    for exact, routes, recs, left in ranks(world_size, _both_orders, 0, torch.float32, True):
        assert exact == (True, True, True) and left == 0
        assert routes == ["fused"] * 3
        assert recs[:3] == recs[3:] and [r[1] for r in recs] == ["fused"] * 6
        assert [r[0] for r in recs[:3]] == ["FORWARD_GRAD", "BACKWARD", "BACKWARD"]


def test_async_declines_like_sync_and_runs_the_nccl_route_in_flight(ranks):
    """float64, which the fused transport does not move: the async calls decline ``dtype`` exactly as the
    synchronous ones (the same records) and the declined exchange runs on the NCCL route in flight."""
    for exact, routes, recs, _ in ranks(2, _both_orders, 0, torch.float64, True):
        assert exact == (True, True, True)
        assert routes == ["nccl-async"] * 3
        assert recs[:3] == recs[3:] and all(r[1:] == ("nccl", 0, "dtype") for r in recs)


def _many_in_flight(rank, p, order):
    from fastvideo.distributed.communication_op import sequence_model_parallel_all_to_all_4D as a2a_public
    from fastvideo.distributed.ulysses import exchange

    xs = [rank_input(rank, (B, S, H, D), seed=10 + i) for i in range(4)]
    handles = [a2a_public(x, 2, 1, async_op=True) for x in xs]
    peak = exchange.in_flight()
    outs = {i: handles[i].wait() for i in order}
    expected = [a2a_public(x, 2, 1) for x in xs]
    try:
        handles[order[0]].wait()
        again = "no error"
    except RuntimeError as exc:
        again = str(exc)
    return [bit_equal(outs[i], expected[i]) for i in range(4)], peak, exchange.in_flight(), again


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("order", [(0, 1, 2, 3), (3, 1, 0, 2)])
def test_exchanges_in_flight_each_give_their_own_result_in_any_wait_order(ranks, world_size, order):
    """Four exchanges started back to back are all in flight at once; waited in issue order or shuffled, each
    returns its own input's exchange; a second wait raises."""
    for exact, peak, left, again in ranks(world_size, _many_in_flight, order):
        assert exact == [True] * 4 and peak == 4 and left == 0
        assert "not in flight" in again


class _Landing:
    """A completion marker that completes when the background copy has landed."""

    def __init__(self) -> None:
        self.done = threading.Event()

    def query(self) -> bool:
        return self.done.is_set()


class DelayedTransport(GlooPlanTransport):
    """The CPU plan transport with late data: ``execute`` returns a NaN-filled output at once and a thread writes
    the real exchange into it after ``delay_s`` (as a device copy lands after the launch returns)."""

    name = "gloo-plan"  # the same capability as every peer's

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s = delay_s
        self._marker: _Landing | None = None

    def execute(self, x, geom, plan, **kw):
        result = super().execute(x, geom, plan, **kw)
        out = torch.full_like(result, float("nan"))
        marker = self._marker = _Landing()

        def land() -> None:
            time.sleep(self.delay_s)
            out.copy_(result)
            marker.done.set()

        threading.Thread(target=land, daemon=True).start()
        return out

    def completion_marker(self):
        return self._marker


def _delayed(rank, p, wait):
    from fastvideo.distributed.ulysses import exchange, ops

    h = build_helper(transport=DelayedTransport(0.3))
    x = rank_input(rank, (B, S, H, D), seed=20)
    real, started = exchange.issue, []
    exchange.issue = lambda *args, **kw: started.append(real(*args, **kw)) or started[-1]
    try:
        handle = ops.all_to_all_async(x, 0, h)
    finally:
        exchange.issue = real
    if wait:
        out = handle.wait()
    else:  # the negative control: the consumer reads the output buffer without waiting
        out = started[0][0].out.clone()
        handle.wait()
    expected = a2a(h, x, 0)
    time.sleep(0.4)  # the synchronous call's own late landing
    result = bit_equal(out, expected), _records(h, 1)[0][1]
    h.destroy()
    return result


def test_a_consumer_really_waits_for_late_data(ranks):
    """The transport lands its data 0.3 s after returning: the waited output is the exchange, bit for bit; the
    control, which reads the buffer without the wait, sees unlanded data (so the check can fail)."""
    for exact, route in ranks(2, _delayed, True):
        assert exact and route == "fused"
    for exact, route in ranks(2, _delayed, False):
        assert not exact and route == "fused"


class _OpHandle:
    """A start through the op itself and its wait, for SP size 1 (where the public op returns its input; the
    output's shape is the input's)."""

    def __init__(self, x, mode, tag=None):
        self.args = (mode, list(x.shape), x.dtype, x.device)
        self.token, self.outcome = torch.ops.fastvideo.ulysses_all_to_all_4d_start(x, mode, False, None, 0, tag=tag,
                                                                                    own_input=True)
        self.tag = tag

    def wait(self):
        return torch.ops.fastvideo.ulysses_all_to_all_4d_wait(self.token, self.outcome, *self.args, tag=self.tag)


def _op_call(x, mode, tag=None):
    return torch.ops.fastvideo.ulysses_all_to_all_4d(x, mode, False, None, 0, tag=tag)[0]


def _compiled(rank, p, backend="aot_eager", fused=False):
    """``f`` (a start, compute, its wait) compiled with ``backend`` and eagerly: whether they agree, the frames, the
    start's and the wait's order and what lies between them, and what ran: the route of each start in flight,
    compiled and eager (the forward's and the backward's, ``in_flight_routes``), whether the agreed route is
    resolved, and the (route, decline reason) of each call its helper recorded (None without one: the NCCL route).
    ``fused`` (the route assertion's negative control): through a helper on the CPU plan transport."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from fastvideo.distributed.communication_op import sequence_model_parallel_all_to_all_4D as a2a_public
    from fastvideo.distributed.ulysses import registry

    if fused:
        registry.install_default_helper(build_helper())
    x = rank_input(rank, (B, S, H, D), seed=30, requires_grad=True)
    w = rank_input(rank, (B, S * p, H // p, D), seed=31)

    def f(x, w):
        handle = a2a_public(x * 2, 2, 1, async_op=True)
        z = torch.sin(w)  # compute between the start and the wait
        return (handle.wait() * z).sum()

    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend)
    with in_flight_routes() as compiled:
        loss = torch.compile(f, backend=counter, fullgraph=True)(x, w)
        (g,) = torch.autograd.grad(loss, x)
    with in_flight_routes() as eager:
        loss_ref = f(x, w)
        (g_ref,) = torch.autograd.grad(loss_ref, x)
    resolved, helper = registry.resolved()
    records = None
    if helper is not None:
        records = [(r.route, None if r.reason is None else r.reason.label) for r in helper.history]
    ran = (compiled, eager, resolved, records)
    nodes = [str(n.target) for n in counter.graphs[0].graph.nodes if n.op == "call_function"]
    start = nodes.index("fastvideo.ulysses_all_to_all_4d_start")
    wait = nodes.index("fastvideo.ulysses_all_to_all_4d_wait")
    between = [n for n in nodes[start + 1:wait] if "sin" in n]
    if backend != "aot_eager":  # inductor fuses the surrounding math: equal within float32 rounding
        agree = torch.allclose(loss, loss_ref, rtol=1e-5), torch.allclose(g, g_ref, rtol=1e-5, atol=1e-6)
    else:
        agree = bit_equal(loss.reshape(1), loss_ref.reshape(1)), bit_equal(g, g_ref)
    return *agree, counter.frame_count, wait > start, between, ran


def nccl_route_ran(p: int) -> tuple:
    """What ``_compiled`` reports under ``off`` (no helper: the agreed route resolved to none, the NCCL route):
    compiled, the forward's start and the backward's on gloo's threads (``nccl-async``), at SP size 1 too (the
    traced op exchanges over its one-rank group); eager the same at P = 2, while at P = 1 eager's start returns its
    input itself (its handle's route ``identity``) and no exchange runs in its backward."""
    return ["nccl-async"] * 2, ["identity"] if p == 1 else ["nccl-async"] * 2, True, None


@pytest.mark.parametrize("world_size", [1, 2])
def test_compile_fullgraph_traces_a_start_and_a_separate_wait(ranks, world_size):
    """``torch.compile(fullgraph=True, backend="aot_eager")``: one frame, the start and the wait two nodes with the
    compute between them; forward and gradient equal eager bit for bit, and both ran on the NCCL route
    (``nccl_route_ran``). At SP size 1 too, where eager returns the input itself (no exchange runs, forward or
    backward: its handle's route says ``identity``): traced, the start is still the op (its wait a node of the
    graph), exchanging over the one-rank group."""
    for exact_y, exact_g, frames, ordered, between, ran in ranks(world_size, _compiled, timeout_s=180):
        assert exact_y and exact_g and frames == 1 and ordered
        assert between  # torch.sin sits between the two nodes in the traced graph
        assert ran == nccl_route_ran(world_size), ran


def test_negative_control_the_route_assertion_fails_where_another_route_ran(ranks):
    """The same function through a helper on the CPU plan transport (``auto``): compiled and eager agree bit for bit,
    every start runs fused and the helper records its forwards and backwards fused, so the route assertion above
    fails on them."""
    results = ranks(2, _compiled, "aot_eager", True, env={"FASTVIDEO_ULYSSES_A2A": "auto"}, timeout_s=180)
    for exact_y, exact_g, frames, ordered, between, ran in results:
        assert exact_y and exact_g and frames == 1 and ordered and between
        assert ran == (["fused"] * 2, ["fused"] * 2, True, [("fused", None)] * 4), ran
        assert ran != nccl_route_ran(2)


@pytest.mark.skipif(not any(shutil.which(c) for c in ("g++", "clang++", "c++")),
                    reason="inductor on CPU needs a C++ compiler")
def test_compile_fullgraph_with_inductor_on_cpu(ranks):
    """The same function through inductor (C++ on CPU): one frame, the two nodes, forward and gradient equal to
    eager within float32 rounding (inductor fuses the sin and the products around the exchange)."""
    for close_y, close_g, frames, ordered, between, _ in ranks(2, _compiled, "inductor", timeout_s=300):
        assert close_y and close_g and frames == 1 and ordered and between


def _owned_launches(rank, p, backend):
    """Which exchanges own their input (``exchange.start``'s ``own``, in start order) through a forward and its
    backward of the public op in flight, compiled with ``backend`` (``None``: eager), and whether the gradient is
    right."""
    from fastvideo.distributed.communication_op import sequence_model_parallel_all_to_all_4D as a2a_public
    from fastvideo.distributed.ulysses import exchange

    owns = []
    issuing = exchange.issue

    def issue(*args, **kw):
        if kw.get("in_flight"):
            owns.append(kw.get("own", False))
        return issuing(*args, **kw)

    exchange.issue = issue
    x = rank_input(rank, (B, S, H, D), seed=30, requires_grad=True)
    w = rank_input(rank, (B, S * p, H // p, D), seed=31)

    def f(x, w):
        handle = a2a_public(x * 2, 2, 1, async_op=True)
        return (handle.wait() * torch.sin(w)).sum()

    g_ref, = torch.autograd.grad(f(x, w), x)
    owns.clear()
    torch._dynamo.reset()
    g, = torch.autograd.grad((torch.compile(f, backend=backend, fullgraph=True) if backend else f)(x, w), x)
    return owns, torch.allclose(g, g_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["aot_eager", None])
def test_traced_forward_and_backward_exchanges_own_their_inputs(ranks, backend):
    """Compiled, the forward's start and the backward's reverse start (traced by AOT autograd, where the wait's
    backward runs under functional tensors) are both baked with ``own_input``; eager (the control) neither copies."""
    for owns, right in ranks(2, _owned_launches, backend, timeout_s=180):
        assert owns == ([True, True] if backend else [False, False]) and right


def _two_in_flight_compiled(rank, p):
    """Two exchanges of intermediates in flight at once under inductor, through the op's own start and wait (also
    at SP 1, where the public op would return its input): both outputs against eager, and whether each start node
    owns its input (``own_input``, baked in at trace time), so inductor may reuse the caller's buffer."""
    from torch._dynamo.testing import CompileCounterWithBackend

    import fastvideo.distributed.ulysses.ops  # noqa: F401 - defines the ops this test calls directly

    def start(x):
        token, outcome = torch.ops.fastvideo.ulysses_all_to_all_4d_start(x, 0, False, None, 0, own_input=True)
        return lambda: torch.ops.fastvideo.ulysses_all_to_all_4d_wait(token, outcome, 0, [B, S * p, H // p, D],
                                                                       x.dtype, x.device)

    def f(x):
        first = start(x * 2)
        second = start(x * 3)  # same size as x * 2: a buffer inductor would take over were x * 2 dead
        return first(), second()

    x = rank_input(rank, (B, S, H, D), seed=7)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    got = torch.compile(f, backend=counter, fullgraph=True)(x)
    expected = f(x)
    nodes = [n for n in counter.graphs[0].graph.nodes if n.op == "call_function"]
    starts = [n for n in nodes if "ulysses_all_to_all_4d_start" in str(n.target)]
    waits = [n for n in nodes if "ulysses_all_to_all_4d_wait" in str(n.target)]
    owned = [s.kwargs.get("own_input") is True for s in starts]
    return [bit_equal(a, b) for a, b in zip(got, expected, strict=True)], owned, len(starts), len(waits)


@pytest.mark.skipif(not any(shutil.which(c) for c in ("g++", "clang++", "c++")),
                    reason="inductor on CPU needs a C++ compiler")
@pytest.mark.parametrize("world_size", [1, 2])
def test_compiled_starts_own_their_inputs(ranks, world_size):
    """An exchange in flight still reads its input, and inductor reuses a buffer once the graph is done with it, so
    the traced start owns its input. Both outputs bit-exact (data movement) with two exchanges of intermediates in
    flight; without the ownership copy inductor writes the second input into the first's buffer (at SP 1 the
    exchange reads it in place, and the first output then holds the second's data)."""
    for exact, owned, starts, waits in ranks(world_size, _two_in_flight_compiled, timeout_s=300):
        assert starts == waits == 2 and owned == [True, True]
        assert exact == [True, True]


def _pipelined_block_compiled(rank, p):
    """The pipelined attention block (4 head groups: group g+1's input is packed while group g's exchange is in
    flight) under inductor at SP 1, its exchanges through the op's own start and wait: max |compiled - eager|."""
    from fastvideo.attention.layer import DistributedAttention
    from fastvideo.distributed.all_to_all import mode_for_dims

    def forced(x, scatter_dim, gather_dim, name="", *, async_op=False, tag=None, **_):
        mode = mode_for_dims(scatter_dim, gather_dim)
        return _OpHandle(x, mode, tag) if async_op else _op_call(x, mode, tag)

    layer = DistributedAttention(8, 8, overlap_chunks=4, prefix="c", all_to_all=forced)
    layer._set_compile_forward_enabled(True)  # traced whole, as a regional compile does
    q, k, v = (rank_input(rank, (1, 16, 8, 8), seed=s) for s in (1, 2, 3))
    torch._dynamo.reset()
    got = torch.compile(lambda q, k, v: layer(q, k, v)[0], backend="inductor", fullgraph=True)(q, k, v)
    return float((got - layer(q, k, v)[0]).abs().max())


@pytest.mark.skipif(not any(shutil.which(c) for c in ("g++", "clang++", "c++")),
                    reason="inductor on CPU needs a C++ compiler")
def test_compiled_pipelined_block_reads_each_group_as_it_was(ranks):
    """Under inductor the pipelined block equals eager within float32 rounding (1e-5: inductor runs its own SDPA
    kernel; they differ by about 1e-6). Without the start's ownership copy inductor packs the next group's q/k/v
    into the buffer the exchange in flight is reading, and the output is off by about 1."""
    for diff in ranks(1, _pipelined_block_compiled, timeout_s=300):
        assert diff <= 1e-5, diff



BF16_TOLERANCE = 2.0 ** -6  # a few bf16 ulps at the output's magnitude; a group read from a reused buffer is off by ~1


def _starts_freed_before_their_waits(code: str) -> tuple[int, int, list[bool]]:
    """In inductor's generated ``call``: how many start nodes there are, how many of their input buffers the code
    frees or hands to another tensor (``del bufN``, ``bufM = bufN; del bufN  # reuse``) before the wait of the
    same exchange (matched by tag), and whether each start was baked with ``own_input=True``."""
    import re

    lines = code.splitlines()
    starts = [(i, line) for i, line in enumerate(lines) if "ulysses_all_to_all_4d_start.default(" in line]
    freed, owned = 0, []
    for i, line in starts:
        buf = re.search(r"start\.default\((?:reinterpret_tensor\()?(\w+)", line).group(1)
        tag = re.search(r"tag='([^']+)'", line).group(1)
        owned.append("own_input=True" in line)
        wait = next(j for j in range(i + 1, len(lines))
                    if "ulysses_all_to_all_4d_wait.default(" in lines[j] and f"tag='{tag}'" in lines[j])
        pattern = re.compile(rf"^\s*(\w+ = {buf}; )?del {buf}\b")
        freed += any(pattern.match(lines[j]) for j in range(i + 1, wait))
    return len(starts), freed, owned


def _pipelined_block_bf16_runs(rank, p, own, runs, stop_at_first=False):
    """The pipelined block in bf16 under inductor at SP 1 (the exchanges' inputs are bf16 intermediates inductor
    plans buffers for), compiled once and run up to ``runs`` times: per run, max |compiled - eager| and the heads
    beyond ``BF16_TOLERANCE``; and the generated code's starts (see ``_starts_freed_before_their_waits``). ``own``
    False drops the start's ownership copies, the traced start's and gloo's own send copy in flight (the negative
    control: the exchange, gloo's thread at SP 1, then reads a buffer the compiled code has already reused)."""
    from torch._inductor.utils import run_and_get_code

    from fastvideo.attention.layer import DistributedAttention
    from fastvideo.distributed.all_to_all import mode_for_dims
    from fastvideo.distributed.ulysses import exchange

    if not own:  # the op body's call; the graph still says own_input=True
        owning, routing = exchange.issue, exchange.nccl_route
        exchange.issue = lambda *args, **kw: owning(*args, **{**kw, "own": False})
        exchange.nccl_route = lambda *args, **kw: routing(*args, **{**kw, "own_input": False})

    def forced(x, scatter_dim, gather_dim, name="", *, async_op=False, tag=None, **_):
        mode = mode_for_dims(scatter_dim, gather_dim)
        return _OpHandle(x, mode, tag) if async_op else _op_call(x, mode, tag)

    layer = DistributedAttention(8, 8, overlap_chunks=4, prefix="c", all_to_all=forced)
    layer._set_compile_forward_enabled(True)
    q, k, v = (rank_input(rank, (1, 16, 8, 8), seed=s).to(torch.bfloat16) for s in (1, 2, 3))
    expected = layer(q, k, v)[0].float()
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: layer(q, k, v)[0], backend="inductor", fullgraph=True)
    first, (code, *_) = run_and_get_code(compiled, q, k, v)
    results = []
    for n in range(runs):
        diff = (first if n == 0 else compiled(q, k, v)).float().sub(expected).abs()
        results.append((float(diff.max()), [h for h, d in enumerate(diff.amax(dim=(0, 1, 3)).tolist())
                                            if d > BF16_TOLERANCE]))
        if stop_at_first and results[-1][1]:
            break
    return results, _starts_freed_before_their_waits(code)


@pytest.mark.skipif(not any(shutil.which(c) for c in ("g++", "clang++", "c++")),
                    reason="inductor on CPU needs a C++ compiler")
def test_compiled_bf16_pipelined_block_is_right_every_run(ranks):
    """The compiled bf16 pipelined block frees or reuses exchange inputs before their waits (the generated code
    says so: the hazard is real in this very program), and is right on every one of 200 runs, because each traced
    start owns its input. Negative control: without the ownership copy the same program reads reused buffers and a
    head group comes out wrong (by about 1.9) within 2000 runs (seen in a few percent of runs here; stopped at the
    first)."""
    results, (starts, freed, owned) = ranks(1, _pipelined_block_bf16_runs, True, 200, timeout_s=300)[0]
    assert starts == 8 and owned == [True] * 8
    assert len(results) == 200
    wrong = [(n, d, heads) for n, (d, heads) in enumerate(results) if heads or d > BF16_TOLERANCE]
    assert not wrong, wrong
    if freed == 0:  # another torch's inductor may keep every exchange input until its wait
        pytest.skip(f"the 200 compiled runs were right, but this torch's inductor ({torch.__version__}) frees no "
                    "exchange input before its wait: the hazard is absent here, so the negative control cannot show it")
    results, (starts, freed, _) = ranks(1, _pipelined_block_bf16_runs, False, 2000, True, timeout_s=300)[0]
    assert starts == 8 and freed > 0
    assert results[-1][1], f"the race did not show in {len(results)} runs without the ownership copy"
