"""The per-call vote channel: 12 int64 fields all-gathered over a gloo group.

The group is the SP group's vote group (``GroupCoordinator.vote_group``: created once with the SP
group, shared by every helper built on it, destroyed with it), or, for a standalone ``GlooVote``
(benchmarks), a group of its own. Buffers are allocated once per helper and reused (no per-call
allocation on the hot path). The vote's timeout is set on the group (or, where torch refuses that, carried
by each exchange), so a vote that never completes (a dead peer, a peer that is not calling the helper)
raises instead of hanging; a gloo group is unusable after that, so the caller must treat any failure as
terminal.

``ShmVote`` is the same-host fast path for the per-call exchange: a POSIX shared-memory segment
driven by the kernel library's ``fvk_vote_*`` functions (``csrc/ulysses_a2a/shm_vote.cpp``), set up
collectively over the ``GlooVote``. Same interface, same timeout rule, same terminal failure.
"""

from __future__ import annotations

import ctypes
import datetime
import logging
import time
import uuid

import numpy as np
import torch
import torch.distributed as dist

from fastvideo.distributed.host_exchange import all_gather_objects, classify_failure, gather_into
from fastvideo.distributed.host_exchange import allgather_options as _allgather_options
from fastvideo.distributed.ulysses.caches import bounded_put
from fastvideo.distributed.ulysses.contract import NUM_FIELDS, Field

logger = logging.getLogger(__name__)

ROWS_KEPT = 1024  # native_row's send rows (one per proposal a job votes: a few per layer kind)


class VoteError(RuntimeError):
    """A vote or construction exchange failed; terminal for the helper (the vote group is unusable after it).
    ``kind``: ``timeout`` (a peer is stopped, stuck or not calling), ``peer_gone`` (a peer's process or
    connection is gone) or ``failed``."""

    kind = "failed"


class VoteTimeoutError(VoteError):
    """The exchange did not complete within the vote timeout."""

    kind = "timeout"


class PeerGoneError(VoteError):
    """A peer's process exited, or its connection closed, while this rank waited for it."""

    kind = "peer_gone"


_ADVICE = ("A peer is stopped, stuck, or is not calling the op (e.g. FASTVIDEO_ULYSSES_A2A differs between ranks: "
           "set it identically everywhere).")


def gloo_failure(what: str, ranks: list[int], rank: int, exc: BaseException, seconds: float,
                 timeout_s: float) -> VoteError:
    """The error for a failed exchange over gloo, saying whether it timed out or a peer's connection closed, and
    which rank it waited for where that is known (two ranks: the other one)."""
    kind = classify_failure(exc)
    peers = [r for r in ranks if r != rank]
    waiting = f"rank {peers[0]}" if len(peers) == 1 else f"one of ranks {peers} (gloo does not say which)"
    if kind == "timeout":
        return VoteTimeoutError(
            f"{what} over SP ranks {ranks} timed out after {seconds:.1f} s (the vote timeout, {timeout_s:g} s: "
            f"FASTVIDEO_ULYSSES_A2A_VOTE_TIMEOUT_S, 0 = the SP group's timeout) waiting for {waiting}. {_ADVICE} "
            f"({exc})")
    if kind == "closed":
        return PeerGoneError(
            f"{what} over SP ranks {ranks} failed after {seconds:.3f} s: the peer closed the connection (it raised "
            f"or exited; {waiting}: see its log). ({exc})")
    return VoteError(f"{what} over SP ranks {ranks} failed after {seconds:.3f} s: {exc}. {_ADVICE}")


class _Buffers:
    """What both vote channels hold: the SP ranks, the timeout, and the send row and ``[P, 12]`` receive buffer,
    allocated once and reused by every exchange (no per-call allocation on the hot path)."""

    def __init__(self, ranks: list[int], timeout_s: float) -> None:
        self.ranks = list(ranks)
        self.world_size = len(ranks)
        self.timeout_s = timeout_s
        self._send = torch.zeros(NUM_FIELDS, dtype=torch.int64)
        self._send_np = self._send.numpy()
        self._recv = torch.zeros(self.world_size * NUM_FIELDS, dtype=torch.int64)
        self._recv_rows = self._recv.view(self.world_size, NUM_FIELDS)
        self.last_s = 0.0  # the last exchange's host seconds (a fused vote-and-launch sets it too)
        self.destroyed = False  # a plain attribute: the native transport reads it on every voted launch


class GlooVote(_Buffers):
    """All-gather of the 12-field contract over a dedicated gloo group. Collective on every call."""

    def __init__(self, ranks: list[int], timeout_s: float, group: dist.ProcessGroup | None = None) -> None:
        super().__init__(ranks, timeout_s)
        self.rank = dist.get_rank()  # global, as ``ranks``
        self.owns_group = group is None
        if group is None:
            # Standalone (benchmarks): a group of its own. use_local_synchronization: only these ranks
            # take part in creating it, so another SP group never blocks on this one.
            group = dist.new_group(
                self.ranks,
                backend="gloo",
                timeout=datetime.timedelta(seconds=timeout_s),
                use_local_synchronization=True,
            )
        # A shared group: this vote's timeout applies to its exchanges from now on (one helper votes on a group at
        # a time; the next one sets its own).
        self._bound_each_call = not self.owns_group and not _set_group_timeout(group, timeout_s)
        self.group = group
        # Where the group's timeout could not be set, each exchange carries this vote's timeout itself, so
        # that what bounds a vote is still timeout_s and not the timeout the group was created with. Under
        # TORCH_DISTRIBUTED_DEBUG=DETAIL (any torch) the debug wrapper runs a monitored barrier before each
        # collective, bounded by the group's creation timeout: with a dead peer, the vote then fails after
        # that one (the SP groups' vote timeout when they were created, which is also the helpers' default).
        self._gather_opts = _allgather_options(timeout_s) if self._bound_each_call else None
        if self._bound_each_call and self._gather_opts is None:
            logger.warning(
                "Ulysses vote over SP ranks %s: this torch neither sets a process group's timeout nor takes one per "
                "call; votes are bounded by the timeout the vote group was created with, not by %g s.", self.ranks,
                timeout_s)

    def exchange(self, fields: list[int]) -> torch.Tensor:
        """Gather every rank's fields: returns the reused ``[P, 12]`` buffer (read it before the next call)."""
        self._send_np[:] = fields
        start = time.perf_counter()
        try:
            gather_into(self._recv, self._send, self.group, self._gather_opts)
        except RuntimeError as exc:
            raise gloo_failure("Ulysses vote", self.ranks, self.rank, exc, time.perf_counter() - start,
                               self.timeout_s) from exc
        self.last_s = time.perf_counter() - start
        return self._recv_rows

    def all_gather_object(self, obj: object) -> list[object]:
        """Construction-time exchange of small Python objects (pickled, length-prefixed, over gloo)."""
        start = time.perf_counter()
        try:
            return all_gather_objects(self.group, self.world_size, obj,
                                      timeout_s=self.timeout_s if self._bound_each_call else None)
        except RuntimeError as exc:
            error = gloo_failure("Ulysses construction exchange", self.ranks, self.rank, exc,
                                 time.perf_counter() - start, self.timeout_s)
            if hasattr(error, "add_note"):  # Python 3.11+
                error.add_note("Every SP rank must construct the helper at the same point.")
            raise error from exc

    def destroy(self) -> None:
        """Local. Never destroys the group: a shared group belongs to its SP group. A group of its own is not
        deregistered either: torch names a group created with use_local_synchronization after
        len(_world.pg_names), so deregistering it makes the next GlooVote on the same ranks reuse its name
        and store keys, and peers then connect to stale addresses. It goes with the default process group."""
        self.destroyed = True


def _set_group_timeout(group: dist.ProcessGroup, timeout_s: float) -> bool:
    """Set ``group``'s timeout for its later collectives; False where this torch cannot.

    A torch without ``ProcessGroup.set_timeout`` cannot, and neither can torch 2.11 under
    ``TORCH_DISTRIBUTED_DEBUG=DETAIL``: the group's backend is then a wrapper, whose ``set_timeout`` raises
    "Backend gloo does not support setting timeout" (torch 2.13 forwards it to the wrapped gloo backend).
    """
    try:
        group.set_timeout(datetime.timedelta(seconds=timeout_s))
    except (AttributeError, RuntimeError, NotImplementedError, TypeError, ValueError) as exc:
        logger.debug("vote group timeout not settable (%s): each exchange carries its own", exc)
        return False
    return True


_FVK_ERR_TIMEOUT, _FVK_ERR_PEER_GONE = 7, 8


def load_vote_library():
    """The kernel library (``fastvideo_kernel.load()``) if it exports the shm vote, else None. Never raises."""
    try:
        import fastvideo_kernel

        lib = fastvideo_kernel.load()
    except Exception as exc:  # noqa: BLE001 - an optional speed-up: absence means the gloo vote
        logger.debug("shared-memory vote unavailable: %s", exc)
        return None
    return lib if all(hasattr(lib, name) for name in fastvideo_kernel.VOTE_SYMBOLS) else None


def _last_error(lib) -> str:
    return (lib.fvk_last_error() or b"").decode(errors="replace")


class ShmVote(_Buffers):
    """The per-call exchange over a same-host shared-memory segment. Build it with ``ShmVote.create``."""

    def __init__(self, lib, handle: ctypes.c_void_p, ranks: list[int], timeout_s: float) -> None:
        super().__init__(ranks, timeout_s)
        self._lib = lib
        self._handle: ctypes.c_void_p | None = handle
        # send_row's rows, per proposal: fields -> (words, address). Public for the native transport's hot path,
        # which looks a row up here without a call; only send_row adds to it.
        self.send_rows: dict[tuple[int, ...], tuple[np.ndarray, int]] = {}
        # Everything the call passes is converted once here: the hot path allocates nothing.
        self._exchange = lib.fvk_vote_exchange
        self._args = (
            handle,
            ctypes.c_void_p(self._send.data_ptr()),
            ctypes.c_void_p(self._recv.data_ptr()),
            ctypes.c_int64(int(timeout_s * 1e9)),
        )

    @classmethod
    def create(cls, gloo: GlooVote, rank: int, lib) -> tuple[ShmVote | None, str]:
        """Collective over ``gloo``'s ranks: every rank gets a ``ShmVote``, or every rank ``(None, why)``.

        Rank 0 creates a uniquely named segment and shares the name; the others open it; all agree on
        success; then rank 0 unlinks the name (the mappings stay), so nothing leaks if the job dies.
        """
        world = gloo.world_size
        handle = ctypes.c_void_p()

        def open_segment(name: str, create: bool) -> str:
            if lib is None:
                return "the kernel library with the shared-memory vote did not load"
            try:
                if lib.fvk_vote_open(name.encode(), world, rank, int(create), ctypes.byref(handle)) != 0:
                    return _last_error(lib)
            except Exception as exc:  # noqa: BLE001 - agreed on below, never raised alone
                return f"{type(exc).__name__}: {exc}"
            return ""

        name, error = "", ""
        if rank == 0:
            name = f"/fastvideo-vote-{uuid.uuid4().hex}"
            error = open_segment(name, create=True)
        name, creator_error = gloo.all_gather_object((name, error))[0]
        if not creator_error and rank != 0:
            error = open_segment(name, create=False)
        errors = gloo.all_gather_object(error)
        if handle.value and rank == 0:
            lib.fvk_vote_unlink(handle)  # every rank has tried to open it: the name is no longer needed
        failed = "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e)
        if failed:
            if handle.value:
                lib.fvk_vote_close(handle, int(rank == 0))
            return None, failed
        return cls(lib, handle, gloo.ranks, gloo.timeout_s), ""

    def exchange(self, fields: list[int]) -> torch.Tensor:
        """Gather every rank's fields: returns the reused ``[P, 12]`` buffer (read it before the next call)."""
        self._send_np[:] = fields
        start = time.perf_counter()
        status = self._exchange(*self._args) if self._handle is not None else -1
        self.last_s = time.perf_counter() - start
        if status != 0:
            raise self.failure(status)
        return self._recv_rows

    def native_channel(self) -> tuple:
        """For a library call that runs the exchange itself (``fvk_launch`` with a vote, the voted form): (handle,
        receive buffer, timeout in ns) as the library takes them, the same every call. The gathered rows are then in
        ``rows``."""
        if self._handle is None:
            raise self.failure(-1)
        return self._args[0], self._args[2], self._args[3]

    def send_row(self, fields: tuple[int, ...]) -> tuple[np.ndarray, int]:
        """The send row kept for ``fields`` (a proposal's, SEQ 0), for a library call that runs the exchange itself:
        ``(words, address)``, an int64[12] holding ``fields`` and its address. A caller writes this call's SEQ into
        ``words[Field.SEQ]`` and passes the address, so a call writes one word, not twelve. Kept in ``send_rows``
        (a caller holding a pair keeps its array valid). Local."""
        if self._handle is None:
            raise self.failure(-1)
        row = self.send_rows.get(fields)
        if row is None:
            words = np.array(fields, dtype=np.int64)
            # bounded; the library reads a row only during its call
            row = bounded_put(self.send_rows, fields, (words, words.ctypes.data), ROWS_KEPT)
        return row

    def native_row(self, fields: tuple[int, ...], seq: int) -> int:
        """The address of ``send_row(fields)`` with SEQ = ``seq`` written into it. Local."""
        words, address = self.send_row(fields)
        words[Field.SEQ] = seq
        return address

    @property
    def rows(self) -> torch.Tensor:
        """The reused ``[P, 12]`` receive buffer: the last exchange's votes."""
        return self._recv_rows

    def failure(self, status: int) -> VoteError:
        """The error for a failed exchange (library status ``status``; -1: the vote was destroyed). The library
        names the rank it waited for, and how long (ranks by SP rank)."""
        detail = _last_error(self._lib) if self._handle is not None and status != -1 else "the vote was destroyed"
        where = f"Ulysses vote over SP ranks {self.ranks} (shared memory)"
        if status == _FVK_ERR_TIMEOUT:
            return VoteTimeoutError(
                f"{where} timed out (the vote timeout, {self.timeout_s:g} s: FASTVIDEO_ULYSSES_A2A_VOTE_TIMEOUT_S, "
                f"0 = the SP group's timeout): {detail}. {_ADVICE}")
        if status == _FVK_ERR_PEER_GONE:
            return PeerGoneError(f"{where} failed: {detail}; that peer's process is gone (see its log: killed, "
                                 "crashed, out of memory).")
        return VoteError(f"{where} failed: {detail}. {_ADVICE}")

    def destroy(self) -> None:
        """Unmap the segment (local; the name was unlinked at construction). A second call is a no-op."""
        self.destroyed = True
        if self._handle is not None:
            self._lib.fvk_vote_close(self._handle, 0)
            self._handle = None
