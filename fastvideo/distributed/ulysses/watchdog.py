"""A watchdog for fused calls in flight: a peer that dies during a launch must not leave this rank
spinning in an LSA barrier forever.

The vote only catches peers that are dead *before* a launch. Once every rank voted RUN, each rank's
kernel waits at per-CTA LSA barriers for its peers' CTAs; a peer killed after the vote (or one whose
launch failed locally) never arrives, and the survivors spin with no host code running that could
notice: the host is typically blocked in a CUDA synchronisation. So, as torch's NCCL watchdog does:

* every launched fused call is tracked: its completion marker (a CUDA event; anything with
  ``query()``), sequence number, plan and geometry;
* a daemon thread (one per helper, started at its first tracked launch, stopped by ``stop()``),
  and the host thread every ``POLL_EVERY`` tracked calls, drop completed calls and look at the oldest
  incomplete one;
* when it has been incomplete for longer than the timeout, the watchdog logs one clear error naming
  the call, the plan, the peers that did not report being stuck in the same call (whose barrier
  arrivals are the missing ones) and what to check, then ends the process (``os._exit``) so the job
  fails instead of hanging. The action is injectable (tests observe it instead of exiting).

Hot path: ``track`` is a deque append (no lock, no thread, no allocation beyond the record), and every
``POLL_EVERY`` calls one ``poll`` (a lock and, in the common case, one query); markers are only
``query()``-ed, never synchronised.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import NamedTuple, Protocol

logger = logging.getLogger(__name__)

WATCHDOG_EXIT_CODE = 87  # what the process exits with when the watchdog ends it (documented)
POLL_EVERY = 8  # tracked calls between the host thread's own polls (the background thread polls on its timer)


class Marker(Protocol):
    def query(self) -> bool:
        """True once the device work it marks has completed."""


class InFlight(NamedTuple):
    """One launched fused call. ``what`` and ``plan`` may be callables returning the text: formatting is
    deferred to the (rare) timeout, keeping ``track`` off the per-call cost (a named tuple for the same
    reason: one is built per fused call)."""

    seq: int
    generation: int
    what: str | Callable[[], str]  # phase, geometry
    plan: str | Callable[[], str]  # the plan's description
    marker: Marker
    launched: float  # time.monotonic() at launch


def _text(value: str | Callable[[], str]) -> str:
    return value() if callable(value) else value


def end_process(message: str) -> None:
    """The default action: the error is already logged (on stderr too when logging is off), then exit
    without cleanup.

    ``os._exit``: atexit handlers, CUDA context teardown or NCCL destruction could block on the very
    kernel that is stuck.
    """
    try:
        if not logger.isEnabledFor(logging.ERROR):
            sys.stderr.write(message + "\n")
        sys.stderr.flush()
        for handler in logging.getLogger().handlers:
            handler.flush()
    finally:
        os._exit(WATCHDOG_EXIT_CODE)


class StoreProbe:
    """Peer reports through the job's key-value store (the default process group's store), only at timeout.

    Every rank whose watchdog fires on the same call writes a key for it; this rank then waits up to
    ``wait_s`` for its peers' keys. A peer that is stuck in the same call reports too (its watchdog fires
    about when this one does); a peer that does not report is dead, or never entered the call, so its
    barrier arrivals are the missing ones. Costs nothing before a timeout.
    """

    def __init__(self, store, ranks: list[int], rank: int, key: str, wait_s: float = 5.0) -> None:
        self.store, self.ranks, self.rank, self.key, self.wait_s = store, list(ranks), rank, key, wait_s

    def __call__(self, call: InFlight, timeout_s: float) -> str:
        prefix = f"fastvideo/ulysses/watchdog/{self.key}/gen{call.generation}/seq{call.seq}"
        try:
            self.store.set(f"{prefix}/{self.rank}", "stuck")
            peers = [r for r in self.ranks if r != self.rank]
            reported: set[int] = set()
            deadline = time.monotonic() + self.wait_s
            while True:
                reported |= {r for r in peers if r not in reported and self.store.check([f"{prefix}/{r}"])}
                if len(reported) == len(peers) or time.monotonic() >= deadline:
                    break
                time.sleep(0.05)
        except Exception as exc:  # noqa: BLE001 - a probe must never stop the watchdog from ending the process
            return f"peer state unknown (the store could not be reached: {type(exc).__name__}: {exc})"
        missing = [r for r in peers if r not in reported]
        stuck = sorted(reported)
        if missing:
            return (
                f"ranks {missing} did not report being stuck in this call within {self.wait_s:g} s: they are dead, "
                f"hung elsewhere, or never launched it, so theirs are the missing barrier arrivals"
                + (f"; ranks {stuck} report waiting in it too" if stuck else "")
            )
        return (
            f"every peer ({stuck}) reports waiting in this call too: no barrier arrival is missing from a dead "
            "peer, so suspect the device or the kernel (a launch that cannot make progress)"
        )


class FusedCallWatchdog:
    """Tracks launched fused calls; ends the process when one stays incomplete past ``timeout_s``."""

    def __init__(
        self,
        timeout_s: float,
        *,
        rank: int,
        ranks: list[int],
        on_timeout: Callable[[str], None] = end_process,
        # (call, timeout_s) -> text: publish that this rank is stuck in the call, say what is known of the peers;
        # never raises (``StoreProbe``)
        probe: Callable[[InFlight, float], str] | None = None,
        poll_s: float | None = None,
        thread_setup: Callable[[], None] | None = None,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"FusedCallWatchdog: timeout_s={timeout_s!r} must be positive.")
        self.timeout_s = timeout_s
        self.rank, self.ranks = rank, list(ranks)
        self.on_timeout = on_timeout
        self.probe = probe
        # Run first in the watchdog's own thread: the native transport relaxes that thread's CUDA
        # stream-capture mode there, so its event queries never invalidate a graph capture elsewhere.
        self.thread_setup = thread_setup
        self.poll_s = poll_s if poll_s is not None else min(1.0, max(0.01, timeout_s / 10))
        self.fired: str | None = None  # the message, once fired
        self._pending: deque[InFlight] = deque()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def for_group(cls, timeout_s: float, ranks: list[int], rank_in_group: int, on_timeout: Callable[[str], None],
                  thread_setup: Callable[[], None] | None = None) -> FusedCallWatchdog:
        """A watchdog for one SP group's fused calls, probing peers through the job's key-value store (the
        default process group's) when there is one."""
        try:
            import torch.distributed as dist

            store = dist.distributed_c10d._get_default_store()
        except Exception:  # noqa: BLE001 - the probe is optional: without it the watchdog still ends the process
            store = None
        rank = ranks[rank_in_group]
        probe = None if store is None else StoreProbe(store, ranks, rank, key="-".join(map(str, ranks)),
                                                      wait_s=min(5.0, max(2.0, timeout_s / 2)))
        return cls(timeout_s, rank=rank, ranks=ranks, on_timeout=on_timeout, probe=probe, thread_setup=thread_setup)

    # ------------------------------------------------------------------ hot path

    def track(self, call: InFlight) -> None:
        """Record a launched call. Starts the background thread on the first one (never per call). The host
        thread drops completed calls itself every ``POLL_EVERY`` calls (one query: ``poll``)."""
        if self.fired is not None:
            return  # it has fired (and an injected action returned): nothing more to watch
        pending = self._pending
        pending.append(call)  # no lock: a deque append is atomic, and pollers only pop from the left
        if len(pending) >= POLL_EVERY:
            self.poll()
        if self._thread is None and not self._stop.is_set():
            self._thread = threading.Thread(target=self._loop, name=f"fastvideo-ulysses-watchdog-r{self.rank}",
                                            daemon=True)
            self._thread.start()

    def in_flight(self) -> int:
        """Launched calls not yet seen complete (queries them now)."""
        with self._lock:
            self._drop_completed()
            return len(self._pending)

    def _drop_completed(self) -> tuple[InFlight | None, Exception | None]:
        """Under the lock: drop the calls seen complete. Returns the oldest incomplete one (None: none) and the
        exception its query raised, if it raised (a sticky device error counts as incomplete)."""
        pending = self._pending
        # Calls complete in order (they share one window): the newest complete means all are, one query for the
        # common case. The first n are stable while the host thread appends on the right.
        n = len(pending)
        try:
            newest_done = n > 1 and pending[n - 1].marker.query()
        except Exception:  # noqa: BLE001 - the scan below queries again and reports it
            newest_done = False
        if newest_done:
            for _ in range(n):
                pending.popleft()
        while pending:
            try:
                done = pending[0].marker.query()
            except Exception as exc:  # noqa: BLE001 - reported by firing, never lost in a thread
                return pending[0], exc
            if not done:
                return pending[0], None
            pending.popleft()
        return None, None

    def poll(self, now: float | None = None) -> InFlight | None:
        """Drop completed calls; fire on the oldest incomplete one when it is overdue. Returns the call it fired on.

        A query that raises (a sticky device error) counts as incomplete: the main thread normally raises that
        error itself first; if it is blocked instead, the timeout still ends the process, naming the error."""
        with self._lock:
            if self.fired is not None:
                return None
            oldest, error = self._drop_completed()
            if oldest is None:
                return None
            now = time.monotonic() if now is None else now
            if now - oldest.launched <= self.timeout_s:
                return None
            self.fired = "firing"  # claimed under the lock: the thread and the next call never both fire
        self._fire(oldest, now, error)
        return oldest

    # ------------------------------------------------------------------ timeout

    def _fire(self, call: InFlight, now: float, error: Exception | None = None) -> None:
        peers = self.probe(call, self.timeout_s) if self.probe is not None else "peer state not probed"
        state = f"has not completed (timeout {self.timeout_s:g} s)"
        if error is not None:
            state += f"; querying its completion raised {type(error).__name__}: {error}"
        message = (
            f"Ulysses fused all-to-all watchdog: call seq {call.seq} (helper gen{call.generation}, "
            f"{_text(call.what)}; plan {_text(call.plan)}) on rank {self.rank} of SP ranks {self.ranks} was "
            f"launched {now - call.launched:.1f} s ago and {state}. Its CTAs are most likely spinning in an LSA "
            f"barrier for a peer's CTAs that will never arrive. Peers: {peers}. Check: whether a peer process died "
            "or was killed (its log, dmesg for OOM kills or Xid errors), that every SP rank issues the same sequence "
            f"of calls, and the GPUs' health (nvidia-smi). Ending this process (exit code {WATCHDOG_EXIT_CODE}) so "
            "the job fails instead of hanging; FASTVIDEO_ULYSSES_A2A_WATCHDOG_TIMEOUT_S sets the timeout."
        )
        self.fired = message
        logger.error(message)
        self.on_timeout(message)

    # ------------------------------------------------------------------ thread

    def _loop(self) -> None:
        if self.thread_setup is not None:
            try:
                self.thread_setup()
            except Exception as exc:  # noqa: BLE001 - watching matters more; say what may break
                logger.warning("Ulysses watchdog: thread setup failed (%s: %s); its event queries could invalidate "
                               "a CUDA-graph capture begun in another thread", type(exc).__name__, exc)
        while not self._stop.wait(self.poll_s):
            self.poll()
            if self.fired is not None:
                return

    def stop(self) -> None:
        """Stop and join the thread (idempotent). Pending calls are forgotten."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        with self._lock:
            self._pending.clear()
