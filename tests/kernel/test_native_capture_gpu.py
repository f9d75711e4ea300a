"""GPU test: the native transport's captured launches (``execute(..., capture=True)``) on one GPU, both plan kinds.

A one-rank communicator (P = 1: the all-to-all is the identity, so every output must equal its input)
runs the real library: ``fvk_launch`` with ``FVK_CALL_CAPTURE``, for the fused kernel and for the
copy-engine kind (its fork onto the context's copy stream, entry barrier, per chunk the barrier,
own-block and copy-out kernels, join) are captured with ``torch.cuda.graph`` and replayed with fresh
inputs, alone, two calls in one graph, and interleaved with eager calls on another stream without host
synchronisation. At P = 1 a call pushes nothing and replays and eager calls share no window bytes, so the
interleaving shows that they run without error and exact, not that they are ordered: the ordering through
the library's completion event is the host property check's (``CE_MODEL_STREAM_PER_CALL`` in
``tests/kernel/test_ce_sync.py``) and the 2-GPU check's (``tests/distributed/check_ulysses_graphs.py
--capture-engines ce,sm``), as are the captured copy-engine pushes. Refusals, each before anything is
enqueued (the context stays usable): the eager copy-engine entry on a capturing stream, a captured entry on a
stream that is not capturing, and a copy-engine call while the context's copy stream is still inside an open
capture. The output check flags a perturbed replay output (its negative control).
Skips without CUDA or without a library that offers both captures.
"""

from __future__ import annotations

import pytest
import torch

from fastvideo.distributed.ulysses.native import NativeKernelError, NativeTransport
from fastvideo.distributed.ulysses.policy import ENGINE_CE, Geometry, Plan
from fastvideo.distributed.ulysses.transport import ENTRY_CAPTURE, ENTRY_CE_CAPTURE, ConstructionContext

pytestmark = pytest.mark.gpu

SHAPE = (2, 512, 8, 128)
PLANS = {
    "sm": Plan(144, 1, 200, tuned=True),  # 6 chunks: uneven row ranges
    "ce": Plan(66, 1, 200, tuned=True, engine=ENGINE_CE),
}


@pytest.fixture(scope="module")
def transport(gpu_lib):
    t = NativeTransport()
    cap = t.capability()
    if not cap.present:
        pytest.skip(f"kernel library unusable here: {cap.detail}")
    if not {ENTRY_CAPTURE, ENTRY_CE_CAPTURE} <= cap.entry_points:
        pytest.skip(f"kernel library offers no capture of both kinds ({sorted(cap.entry_points)})")
    device = torch.device("cuda", 0)
    ctx = ConstructionContext(rank=0, world_size=1, device=device, window_bytes=64 << 20, max_ctas=144,
                              device_group=None, all_gather_object=lambda obj: [obj])
    for step in t.construction_steps(ctx):
        step.run()
    yield t
    torch.cuda.synchronize()
    t.destroy()


def rand() -> torch.Tensor:
    """Random bf16 input, drawn on the CPU: torch's CUDA generator can be left in a capture state by another
    test's deliberately broken capture (tests/kernel/test_capture_watchdog_gpu.py's negative control)."""
    return torch.randn(SHAPE).to("cuda", torch.bfloat16)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def capture(transport, x_static: torch.Tensor, plans: list[tuple[int, Plan]]):
    """A graph of consecutive captured calls (mode, plan), each on the previous call's output."""
    graph = torch.cuda.CUDAGraph()
    outs = []
    with torch.cuda.graph(graph):
        y = x_static
        for mode, plan in plans:
            y = transport.execute(y, Geometry.from_input(y.shape, mode, 1, y.dtype), plan, capture=True)
            outs.append(y)
    return graph, outs


@pytest.mark.parametrize("kind", sorted(PLANS))
def test_replays_of_a_captured_call_are_exact(transport, kind):
    plan = PLANS[kind]
    x_static = rand()
    transport.execute(x_static, Geometry.from_input(SHAPE, 0, 1, x_static.dtype), plan)  # eager warm-up
    torch.cuda.synchronize()
    graph, (out,) = capture(transport, x_static, [(0, plan)])
    for i in range(20):
        x_static.copy_(rand())
        out.fill_(float("nan"))  # poison: every element must be written by the replay
        graph.replay()
        torch.cuda.synchronize()
        assert same(out, x_static), f"replay {i}"
    # Negative control: the check sees a single flipped element.
    out.view(torch.int16).view(-1)[123] ^= 1
    assert not same(out, x_static)


@pytest.mark.parametrize("kind", sorted(PLANS))
def test_two_calls_in_one_graph_and_replays_interleaved_with_eager_calls(transport, kind):
    plan = PLANS[kind]
    x_static = rand()
    graph, (y, z) = capture(transport, x_static, [(0, plan), (1, plan)])
    side = torch.cuda.Stream()
    geom = Geometry.from_input(SHAPE, 0, 1, torch.bfloat16)
    xs = [rand() for _ in range(8)]
    eager_in = [rand() for _ in range(8)]
    with torch.cuda.stream(side):
        eager_out = [torch.empty_like(t) for t in eager_in]  # allocated on the side stream, up front
    torch.cuda.synchronize()  # inputs ready: below, only the library orders the two streams' fused work
    results = []
    for i in range(8):
        x_static.copy_(xs[i])
        graph.replay()
        results.append((y.clone(), z.clone()))
        with torch.cuda.stream(side):  # no wait_stream, no host sync
            eager_out[i].copy_(transport.execute(eager_in[i], geom, plan))
    torch.cuda.synchronize()
    inputs = list(zip(xs, results, strict=True))
    for i, (x_i, (y_i, z_i)) in enumerate(inputs):
        assert same(y_i, x_i) and same(z_i, x_i), f"replay {i}"
        assert same(eager_out[i], eager_in[i]), f"eager call {i}"


def test_the_eager_copy_engine_entry_refuses_a_capturing_stream(transport):
    x_static = rand()
    geom = Geometry.from_input(SHAPE, 0, 1, x_static.dtype)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(NativeKernelError, match="cannot be captured"):
        with torch.cuda.graph(graph):
            transport.execute(x_static, geom, PLANS["ce"])
    torch.cuda.synchronize()
    # The refusal happens before any enqueue: the context stays usable (an agreed check, no poisoning).
    assert same(transport.execute(x_static, geom, PLANS["ce"]), x_static)


def test_a_captured_entry_on_a_stream_that_is_not_capturing_is_refused(transport):
    x = rand()
    geom = Geometry.from_input(SHAPE, 0, 1, x.dtype)
    for kind in sorted(PLANS):
        with pytest.raises(NativeKernelError, match="needs a stream that is capturing"):
            transport.execute(x, geom, PLANS[kind], capture=True)
        assert same(transport.execute(x, geom, PLANS[kind]), x)  # not poisoned


def test_a_copy_engine_call_while_the_copy_stream_is_in_an_open_capture_is_refused(transport):
    x = rand()
    other = rand()
    geom = Geometry.from_input(SHAPE, 0, 1, x.dtype)
    side = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    refused = ""
    with torch.cuda.graph(graph, capture_error_mode="relaxed"):
        out = transport.execute(x, geom, PLANS["ce"], capture=True)  # the copy stream is now in this capture
        with torch.cuda.stream(side):  # an eager call while that capture is still open
            try:
                transport.execute(other, geom, PLANS["ce"])
            except NativeKernelError as exc:
                refused = str(exc)
    assert "open CUDA-graph capture" in refused, refused or "the eager call was not refused"
    graph.replay()  # the capture was not disturbed
    torch.cuda.synchronize()
    assert same(out, x)
    assert same(transport.execute(other, geom, PLANS["ce"]), other)  # after the capture: accepted
