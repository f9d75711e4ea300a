"""The fused-call watchdog (``fastvideo/distributed/ulysses/watchdog.py``) on CPU.

A "transport that never completes" stands in for a fused kernel spinning in an LSA barrier: its
completion marker's ``query()`` stays False. The unit tests drive ``FusedCallWatchdog`` directly
(injected action, so the test observes instead of exiting; one test lets the default action end a
subprocess); the gloo tests run the helper with the CPU transport on two ranks, where the peer probe
goes through the job's real store. The 2-GPU SIGKILL run is ``check_ulysses_watchdog_sigkill.py``.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fastvideo.distributed.ulysses.watchdog import (
    POLL_EVERY,
    WATCHDOG_EXIT_CODE,
    FusedCallWatchdog,
    InFlight,
    StoreProbe,
)
from tests.distributed.conftest import a2a, build_helper, rank_input
from tests.plan_transport import GlooPlanTransport

ROOT = Path(__file__).resolve().parents[2]


class Never:
    """A marker whose work never completes (a kernel stuck at a barrier)."""

    def query(self) -> bool:
        return False


class Done:
    def query(self) -> bool:
        return True


class After:
    """Completes ``delay`` seconds after creation."""

    def __init__(self, delay: float) -> None:
        self.at = time.monotonic() + delay

    def query(self) -> bool:
        return time.monotonic() >= self.at


def call(seq: int = 41, marker=None) -> InFlight:
    return InFlight(seq, 3, "forward_grad, Geometry(B=3)", "tuned: 144 CTAs, one plane per chunk", marker or Never(),
                    time.monotonic())


def wait_for(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def watchdog_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("fastvideo-ulysses-watchdog")]


# ------------------------------------------------------------------------------------- the logic


def test_a_call_that_never_completes_fires_once_naming_call_plan_and_what_to_check():
    fired: list[str] = []
    w = FusedCallWatchdog(0.2, rank=1, ranks=[0, 1], on_timeout=fired.append, poll_s=0.02)
    start = time.monotonic()
    w.track(call())
    assert wait_for(lambda: fired, 5.0)
    elapsed = time.monotonic() - start
    time.sleep(0.2)  # and never again
    w.stop()
    assert len(fired) == 1 and 0.2 <= elapsed < 2.0
    message = fired[0]
    for part in ("call seq 41", "gen3", "tuned: 144 CTAs, one plane per chunk", "rank 1 of SP ranks [0, 1]",
                 "has not completed (timeout 0.2 s)", "LSA barrier", "Check:", f"exit code {WATCHDOG_EXIT_CODE}",
                 "FASTVIDEO_ULYSSES_A2A_WATCHDOG_TIMEOUT_S"):
        assert part in message, part
    assert w.fired == message


def test_calls_that_complete_never_fire():
    """Negative control: 100 calls that complete (some after a delay shorter than the timeout) never fire."""
    fired: list[str] = []
    w = FusedCallWatchdog(0.3, rank=0, ranks=[0, 1], on_timeout=fired.append, poll_s=0.02)
    for i in range(100):
        w.track(call(i, Done() if i % 2 else After(0.1)))
    time.sleep(0.6)
    in_flight = w.in_flight()
    w.stop()
    assert fired == [] and in_flight == 0


def test_one_thread_per_watchdog_however_many_calls_and_stop_joins_it():
    before = len(watchdog_threads())
    w = FusedCallWatchdog(5.0, rank=0, ranks=[0, 1], on_timeout=lambda m: None)
    assert len(watchdog_threads()) == before  # none until the first launch
    for i in range(1000):
        w.track(call(i, Done()))
    assert len(watchdog_threads()) == before + 1
    w.stop()
    assert len(watchdog_threads()) == before
    w.track(call(1000, Never()))  # after stop: no new thread
    assert len(watchdog_threads()) == before
    w.stop()  # idempotent


def test_the_next_call_polls_and_fires_without_waiting_for_the_thread():
    fired: list[str] = []
    w = FusedCallWatchdog(1.0, rank=0, ranks=[0, 1], on_timeout=fired.append, poll_s=3600)
    c = call()
    w.track(c)
    assert w.poll(now=c.launched + 0.5) is None and fired == []  # not yet overdue
    assert w.poll(now=c.launched + 1.5) is c and len(fired) == 1
    assert w.poll(now=c.launched + 9.0) is None and len(fired) == 1  # fires once
    w.stop()


class Counted:
    """A marker that counts its queries and says ``done``."""

    def __init__(self, done: bool) -> None:
        self.done, self.queries = done, 0

    def query(self) -> bool:
        self.queries += 1
        return self.done


def test_a_poll_queries_the_newest_first_and_drops_every_call_before_a_complete_one():
    """Calls complete in order: where the newest is complete, one query drops them all (the older markers are
    never queried); where it is not, the scan from the oldest stops at the first incomplete one."""
    w = FusedCallWatchdog(60.0, rank=0, ranks=[0, 1], on_timeout=lambda m: None, poll_s=3600)
    older = [Counted(False) for _ in range(POLL_EVERY - 2)]
    for i, m in enumerate(older):
        w._pending.append(call(i, m))
    newest = Counted(True)
    w._pending.append(call(99, newest))
    assert w.poll() is None and len(w._pending) == 0
    assert newest.queries == 1 and all(m.queries == 0 for m in older)
    # Negative control: the newest incomplete, the oldest complete: the scan drops the oldest alone.
    first, second, last = Counted(True), Counted(False), Counted(False)
    for i, m in enumerate((first, second, last)):
        w._pending.append(call(i, m))
    assert w.poll() is None and [c.marker for c in w._pending] == [second, last]
    assert first.queries == 1 and last.queries == 1
    w.stop()


def test_the_host_thread_polls_every_poll_every_calls_without_waiting_for_the_thread():
    """``track`` takes no lock and queries nothing until ``POLL_EVERY`` calls are pending; then it polls once, so
    completed calls never pile up between the background thread's polls."""
    w = FusedCallWatchdog(60.0, rank=0, ranks=[0, 1], on_timeout=lambda m: None, poll_s=3600)
    markers = [Counted(True) for _ in range(POLL_EVERY)]
    for i, m in enumerate(markers[:-1]):
        w.track(call(i, m))
    assert len(w._pending) == POLL_EVERY - 1 and all(m.queries == 0 for m in markers)
    w.track(call(POLL_EVERY, markers[-1]))
    assert len(w._pending) == 0 and markers[-1].queries == 1
    w.stop()


def test_a_marker_that_raises_is_incomplete_and_named_at_timeout():
    class Faulted:
        def query(self) -> bool:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    fired: list[str] = []
    w = FusedCallWatchdog(1.0, rank=0, ranks=[0, 1], on_timeout=fired.append, poll_s=3600)
    c = call(marker=Faulted())
    w.track(c)
    assert w.poll(now=c.launched + 0.1) is None
    assert w.poll(now=c.launched + 2.0) is c
    assert "illegal memory access" in fired[0]
    w.stop()


def test_the_default_action_ends_the_process_with_the_message():
    """Not injected: the watchdog logs, writes the message to stderr and exits the process (code 87) within
    its timeout plus a poll, however long the main thread would have waited."""
    code = (
        "import time\n"
        "from fastvideo.distributed.ulysses.watchdog import FusedCallWatchdog, InFlight\n"
        "class Never:\n    def query(self): return False\n"
        "w = FusedCallWatchdog(0.5, rank=1, ranks=[0, 1], poll_s=0.05)\n"
        "w.track(InFlight(7, 1, 'forward_no_grad', 'original: 36 CTAs', Never(), time.monotonic()))\n"
        "time.sleep(60)\nprint('survived')\n"
    )
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    elapsed = time.monotonic() - start
    assert proc.returncode == WATCHDOG_EXIT_CODE, proc.stderr
    assert "Ulysses fused all-to-all watchdog: call seq 7" in proc.stderr and "survived" not in proc.stdout
    assert elapsed < 30  # the interpreter start dominates; the watchdog itself fires at 0.5 s


class FakeStore:
    def __init__(self, keys=(), fail: bool = False) -> None:
        self.keys, self.fail = set(keys), fail

    def set(self, key, value) -> None:
        if self.fail:
            raise RuntimeError("connection refused")
        self.keys.add(key)

    def check(self, keys) -> bool:
        return all(k in self.keys for k in keys)


def test_store_probe_names_missing_and_waiting_peers():
    c = call(seq=5)
    prefix = "fastvideo/ulysses/watchdog/0-1-2/gen3/seq5"
    one_missing = StoreProbe(FakeStore({f"{prefix}/2"}), [0, 1, 2], 0, "0-1-2", wait_s=0.1)(c, 1.0)
    assert "ranks [1] did not report" in one_missing and "ranks [2] report waiting" in one_missing
    none_missing = StoreProbe(FakeStore({f"{prefix}/1", f"{prefix}/2"}), [0, 1, 2], 0, "0-1-2", wait_s=0.1)(c, 1.0)
    assert "every peer ([1, 2]) reports waiting" in none_missing
    assert "peer state unknown" in StoreProbe(FakeStore(fail=True), [0, 1], 0, "0-1", wait_s=0.1)(c, 1.0)


# ------------------------------------------------------------------------------------- the helper, over gloo


class NeverCompletes(GlooPlanTransport):
    """The CPU transport whose launches never complete (as seen by the watchdog)."""

    def completion_marker(self):
        return Never()


class Completes(GlooPlanTransport):
    """The CPU transport reporting an asynchronous launch that has completed (exercises tracking)."""

    def completion_marker(self):
        return Done()


def _stuck(rank, world_size, stuck_ranks):
    fired: list[str] = []
    transport = NeverCompletes() if rank in stuck_ranks else Completes()
    h = build_helper(transport=transport, watchdog_timeout_s=1.0, on_watchdog_timeout=fired.append)
    start = time.monotonic()
    a2a(h, rank_input(rank, (3, 16, 12, 8)), 0)
    route = h.history[-1].route
    if rank in stuck_ranks:
        wait_for(lambda: fired, 15.0)
    elapsed = time.monotonic() - start
    in_flight = h.stats()["in_flight"]
    threads = len(watchdog_threads())
    h.destroy()
    return route, fired, elapsed, in_flight, threads, len(watchdog_threads())


def test_helper_watchdog_names_the_peer_whose_arrival_is_missing(ranks):
    """Rank 0's launch never completes, rank 1's does: rank 0 logs one error naming the call, its plan and
    rank 1 as the peer that did not report being stuck; rank 1 never fires. destroy() joins the thread."""
    (route0, fired0, elapsed0, in_flight0, threads0, after0), (route1, fired1, _, in_flight1, threads1, after1) = (
        ranks(2, _stuck, (0,), timeout_s=60))
    assert route0 == route1 == "fused"
    assert len(fired0) == 1 and 1.0 <= elapsed0 < 10
    assert "call seq 0" in fired0[0] and "tuned: 144 CTAs" in fired0[0] and "forward_no_grad" in fired0[0]
    assert "ranks [1] did not report being stuck in this call" in fired0[0]
    assert fired1 == [] and in_flight1 == 0 and in_flight0 == 1
    # One thread per helper: rank 1's runs until destroy() joins it; rank 0's ended after firing.
    assert (threads0, threads1, after0, after1) == (0, 1, 0, 0)


def test_helper_watchdog_when_every_rank_is_stuck_suspects_the_device(ranks):
    results = ranks(2, _stuck, (0, 1), timeout_s=60)
    for rank, (_, fired, elapsed, _, _, after) in enumerate(results):
        assert len(fired) == 1 and elapsed < 10 and after == 0
        assert f"every peer ([{1 - rank}]) reports waiting in this call too" in fired[0]


def _declined_helper_starts_no_thread(rank, world_size):
    h = build_helper(transport=Completes(), window_bytes=64)  # the window fits no plan: every call declines
    a2a(h, rank_input(rank, (3, 16, 12, 8)), 0)
    result = (h.history[-1].route, len(watchdog_threads()))
    h.destroy()
    return result


def test_no_watchdog_thread_without_a_fused_launch(ranks):
    assert ranks(2, _declined_helper_starts_no_thread, timeout_s=60) == [("nccl", 0)] * 2


def _watchdog_timeout(rank, world_size):
    h = build_helper(vote_timeout_s=7.0)
    value = h.watchdog_timeout_s
    h.destroy()
    return value


@pytest.mark.parametrize("value, expected", [(None, 7.0), ("0", 7.0), ("2.5", 2.5)])
def test_watchdog_timeout_is_the_registry_setting_or_the_vote_timeout(ranks, value, expected):
    env = {"FASTVIDEO_ULYSSES_A2A_WATCHDOG_TIMEOUT_S": value}
    assert ranks(2, _watchdog_timeout, env=env, timeout_s=60) == [expected] * 2


def test_the_sigkill_check_passes_its_cpu_dry_run():
    """check_ulysses_watchdog_sigkill.py end to end on CPU: rank 1 is SIGKILLed after the vote of call 10, the
    survivor's launch never completes and its host blocks; it exits 87 with the watchdog message naming
    rank 1, well within the timeout + 10 s (the script judges that itself and prints PASS)."""
    proc = subprocess.run([sys.executable, "tests/distributed/check_ulysses_watchdog_sigkill.py", "--cpu-dry-run",
                           "--timeout", "2", "--calls", "20", "--kill-at", "10"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "PASS" in proc.stdout and proc.stdout.count("call seq 10") == 1
