"""GPU test: the helper's watchdog thread must not break a CUDA-graph capture begun in another thread.

The watchdog thread polls CUDA events (``query()``) while the training thread may be capturing a graph
(``torch.cuda.graph``, global capture mode). CUDA prohibits "potentially unsafe" calls from other
threads during a global-mode capture, and torch's NCCL watchdog relaxes its thread's capture mode for
that reason; the native transport's ``watchdog_thread_setup`` does the same (``fvk_relax_capture_mode``).
Here a real ``FusedCallWatchdog`` tracks a real in-flight event while the main thread captures and
replays a graph. The negative control is a watchdog whose poll also synchronises the device, a call
CUDA does prohibit during another thread's capture: it must break the capture, which shows the test
can see a watchdog that does. (Measured on one H200, driver 580, CUDA 13, 2026-11-29: plain event
queries from a thread in global mode did not break a capture; the relaxed mode is defensive there.)
Skips without CUDA or without a library that has the call.
"""

from __future__ import annotations

import time

import pytest
import torch

from fastvideo.distributed.ulysses.watchdog import FusedCallWatchdog, InFlight
from tests.kernel import check_sim_peers as sim

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def relax(gpu_lib):
    lib = gpu_lib
    if not hasattr(lib, "fvk_relax_capture_mode"):
        pytest.skip("kernel library without fvk_relax_capture_mode")

    def setup() -> None:
        assert lib.fvk_relax_capture_mode() == 0, sim.fastvideo_kernel.last_error(lib)

    return setup


def _capture_while_polling(thread_setup, synchronizing_poll: bool = False) -> tuple[bool, str, int]:
    """Capture a graph of many small kernels while a watchdog polls a pending event from its own thread.

    Returns (capture and replay exact, the error if the capture broke, polls during the capture)."""
    x = torch.randn(1 << 16, device="cuda")
    side = torch.cuda.Stream()
    event = torch.cuda.Event()
    with torch.cuda.stream(side):  # a "fused call" that stays in flight for the whole capture
        torch.cuda._sleep(int(2e9))  # ~1 s of device time
        event.record(side)
    polls = 0
    fired: list[str] = []
    watchdog = FusedCallWatchdog(60.0, rank=0, ranks=[0, 1], on_timeout=fired.append, poll_s=0.0005,
                                 thread_setup=thread_setup)
    original = watchdog.poll

    def counting_poll(now=None):
        nonlocal polls
        polls += 1
        if synchronizing_poll:
            try:
                torch.cuda.synchronize()  # prohibited while another thread captures in global mode
            except Exception:  # noqa: BLE001 - the capture is what must show it
                pass
        return original(now)

    watchdog.poll = counting_poll  # type: ignore[method-assign]
    watchdog.track(InFlight(seq=1, generation=1, what="test", plan="test", marker=event, launched=time.monotonic()))
    time.sleep(0.05)  # the thread is polling
    graph, error = torch.cuda.CUDAGraph(), ""
    y = torch.empty_like(x)
    start = polls
    try:
        with torch.cuda.graph(graph):
            z = x
            for _ in range(3000):  # long enough that the thread polls during it
                z = z * 1.0001 + 0.0
            y.copy_(z)
        during = polls - start
        graph.replay()
        torch.cuda.synchronize()
        ref = x
        for _ in range(3000):
            ref = ref * 1.0001 + 0.0
        ok = torch.equal(y, ref)
    except Exception as exc:  # noqa: BLE001 - the negative control expects the capture to break
        during, ok, error = polls - start, False, f"{type(exc).__name__}: {exc}"
    finally:
        watchdog.stop()
        torch.cuda.synchronize()
    assert not fired
    return ok, error, during


def test_watchdog_thread_does_not_break_a_capture(relax):
    ok, error, polls = _capture_while_polling(relax)
    assert polls > 0, "the watchdog did not poll during the capture: the test proves nothing"
    assert ok, f"capture broke or replay differed with the relaxed watchdog thread: {error}"


def test_negative_control_a_synchronizing_watchdog_breaks_the_capture(relax):
    ok, error, polls = _capture_while_polling(None, synchronizing_poll=True)
    assert polls > 0
    assert not ok and error, "a device synchronisation from another thread should invalidate the capture"
    torch.cuda.synchronize()
    # The device is usable afterwards (the failed capture was discarded).
    assert torch.ones(4, device="cuda").sum().item() == 4
