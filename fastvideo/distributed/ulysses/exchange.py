"""One Ulysses all-to-all call, from its input to its output: the core every entry point shares (``issue``).

    validate -> route -> the helper (propose, vote, decide, execute the fused plan, record) -> the NCCL route
    where every rank declined or no helper votes

The call with its wait inlined (the synchronous op's body, the public function's eager path): on the caller's
stream, no side stream and no event (under CUDA-graph capture too). In flight (``in_flight``: the start op's body,
the eager path of ``async_op=True``): on CUDA on this process's communication stream, forked from the caller's,
with an event the wait makes the caller's stream wait on; on CPU the NCCL route left running in gloo's threads.
It then returns an ``AllToAllHandle``, which ``wait`` completes. The input is validated once
(``all_to_all.validate_input`` on the SP group); in checked mode a caller error is voted first (``fail``), so
that every rank raises.

**The input is the caller's until ``wait()``.** On CUDA an exchange in flight reads it on the communication
stream, and ``record_stream`` guards only against the allocator. Eager, the start keeps the input's version
counter and ``wait`` raises where it moved: an in-place write between start and wait (``x.add_(...)``, an
optimizer step on it) is caught on the rank that wrote. The check is that rank's: on CUDA its peers may have
received the written data, so the error must end the step. It cannot see writes that bypass the counter
(through ``.data``, raw pointers, other processes) and it flags a write to another slice of the same storage (the
counter is the base's). Under ``torch.inference_mode`` tensors carry no counter: on CUDA the rule is the
caller's to keep (a copy per call would cost the compute stream a pass over the operand). On CPU gloo's threads
never read ``x`` after the start (they send a copy where they would send its own memory), so every rank's output
is the input as it stood at the start, and the write still raises where the counter saw it. Traced code (``own``:
``torch.compile``, make_fx) passes ownership instead: a compiler plans buffer reuse by graph liveness, so the
start copies its input where the route would read the caller's buffer after returning. So does every start through
the op that is not eager (an ``nn.Parameter`` or another subclass, a plain tensor under a dispatch mode): its write
between start and wait is no error, and every rank's output is the input as it stood at the start.

**A dropped start is released.** An exchange whose ``wait`` is never called is released when nothing can wait
for it any more (its handle or token is collected): a ``ResourceWarning`` and one log line name where it was
started. A backward that raised between a start and its wait leaves the token with autograd's engine, which drops
it, and so releases the exchange, at that thread's next backward (not at ``gc.collect()``). A start without its wait
in the same compiled region is refused at trace time (``ops.py``).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import sys
import time
import warnings
import weakref
from collections.abc import Callable, Iterator

import torch

from fastvideo.distributed.all_to_all import Splits, nccl_route, validate_input
from fastvideo.distributed.sp_groups import GroupCoordinator
from fastvideo.distributed.ulysses import registry
from fastvideo.distributed.ulysses.helper import UlyssesHelper

logger = logging.getLogger(__name__)

Outcome = tuple[int, int, int]  # what a call saves for its backward: (helper id, outcome code, SEQ word)
_IDS = itertools.count(1)
_STREAMS: dict[int, torch.cuda.Stream] = {}  # device index -> this process's communication stream
# The exchanges started in this process and not yet waited for: held by their handles (eager) or their tokens
# (the start op's, through the release hook), never by this table.
_PENDING: weakref.WeakValueDictionary[int, AllToAllHandle] = weakref.WeakValueDictionary()
_WARNED: set[str] = set()  # start sites whose dropped exchange was logged
# Frames of this package's distributed and attention layers (a pipelined DistributedAttention starts exchanges for its
# caller) and of torch (modules named so, or inside them) are skipped when naming where a start was made: a user
# module whose name merely begins alike ("torch_step") is the user's.
_SKIPPED = (__name__.rsplit(".", 2)[0] + ".", "fastvideo.attention.", "torch.")
_TORCH = (os.path.join(os.path.dirname(torch.__file__), ""), "<")  # torch's files; code compiled from a string


class InputModifiedError(RuntimeError):
    """The input of an exchange in flight was written in place before its ``wait()``."""


class AllToAllHandle:
    """An all-to-all in flight (``sequence_model_parallel_all_to_all_4D(..., async_op=True)``). ``wait()`` returns
    its output, as ``torch.distributed``'s ``Work.wait()`` makes an ``async_op`` result usable; call it once. A
    handle dropped without ``wait()`` is released with a ``ResourceWarning`` naming where it started."""

    __slots__ = ("__weakref__", "event", "finish", "ident", "marker", "out", "release", "route", "source", "version",
                 "where")

    def __init__(self) -> None:
        self.route = ""  # "fused", "nccl" (the side stream on CUDA), "nccl-async" (gloo's threads) or "identity"
        self.out: torch.Tensor | None = None
        self.finish: Callable[[], torch.Tensor] | None = None  # gloo's work: waits and lays the output out
        self.marker: object = None  # a CPU transport's completion marker (it lands its data after returning)
        self.event: torch.cuda.Event | None = None  # CUDA: recorded on the communication stream
        self.source: torch.Tensor | None = None  # the input whose version is checked at the wait
        self.version = 0
        self.where = ""
        self.ident = next(_IDS)
        self.release: weakref.finalize | None = None  # the release of a dropped start (``release_when_dropped``)

    def wait(self) -> torch.Tensor:
        """The output, once landed where the caller reads it: on CUDA the caller's current stream waits for the
        exchange's event (the host does not); on CPU the backend's work is waited for. Local; raises
        ``InputModifiedError`` for an input written in place since the start, and for a second wait."""
        pending(self.ident, take=True)
        if self.release is not None:
            self.release.detach()
        if self.event is not None:
            out = self.out
            caller = torch.cuda.current_stream(out.device)
            caller.wait_event(self.event)
            out.record_stream(caller)  # allocated on the side stream, used on the caller's: the allocator is told
        elif self.finish is not None:
            out = self.finish()
        else:
            while self.marker is not None and not self.marker.query():  # a transport that lands its data later
                time.sleep(50e-6)
            out = self.out
        if self.source is not None and self.source._version != self.version:
            raise InputModifiedError(
                f"Ulysses all-to-all (started at {self.where}): input_ was modified in place between the call with "
                "async_op=True and handle.wait(), while the exchange could still read it; on CUDA this output and "
                "the peers' may mix old and new data, so do not go on with this step. Write to the input only after "
                "wait(), or pass a copy.")
        return out


def comm_stream(device: torch.device) -> torch.cuda.Stream:
    """This process's communication stream on ``device`` (created at first use, then kept)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _STREAMS.get(index)
    if stream is None:
        stream = _STREAMS[index] = torch.cuda.Stream(device=index)
    return stream


def in_flight() -> int:
    """Local: how many exchanges this process started and has not waited for (nor released)."""
    return len(_PENDING)


def pending(ident: int, *, take: bool = False) -> AllToAllHandle:
    """Local: exchange ``ident`` (a token's value) while in flight, no longer in flight once ``take`` (its wait);
    raises RuntimeError once waited or released."""
    handle = _PENDING.pop(ident, None) if take else _PENDING.get(ident)
    if handle is None:
        raise RuntimeError(f"Ulysses all-to-all wait: exchange #{ident} is not in flight in this process (waited "
                           "already, or started elsewhere). Wait for each started exchange exactly once.")
    return handle


def fail(sp: GroupCoordinator, mode: int, grad: bool, error: BaseException):
    """Raise ``error``, a caller error found before any collective, through the agreed route's helper
    (``UlyssesHelper.vote_caller_error``: collective in checked mode, which votes it first); always raises."""
    # Under tracing no route is resolved (its first resolution is collective) and nothing is voted.
    helper = None if sp.world_size == 1 or torch.compiler.is_compiling() else registry.route()
    if helper is None:
        raise error  # as with any torch collective: the peers of a rank that raised alone wait for it
    helper.vote_caller_error(mode, grad, error)


@contextlib.contextmanager
def voted_errors(sp: GroupCoordinator, mode: int, grad: bool) -> Iterator[None]:
    """Around a call's argument checks on this rank of ``sp``: a caller error raised inside (``TypeError``,
    ``ValueError``, ``RuntimeError``, and ``AttributeError``: an argument of another type than the checks read) is
    raised through ``fail``, voted in checked mode, so that every peer raises for this call instead of pairing it
    with this rank's next. Collective only where it raises in checked mode."""
    try:
        yield
    except (TypeError, ValueError, RuntimeError, AttributeError) as exc:
        fail(sp, mode, grad, exc)


def validated(sp: GroupCoordinator, x: torch.Tensor, mode: int, grad: bool, seq_splits, head_splits,
              tag: str | None) -> Splits:
    """``validate_input`` for this rank of ``sp``: the split tables, or the caller's error raised through ``fail``
    (voted in checked mode). Collective only where it raises in checked mode. (Not ``voted_errors``: a context
    manager's frames cost every call more than a ``try``, which costs nothing until it raises.)"""
    try:
        return validate_input(x, mode, sp.world_size, sp.rank_in_group, seq_splits, head_splits, tag)
    except (TypeError, ValueError, RuntimeError) as exc:
        fail(sp, mode, grad, exc)


def issue(sp: GroupCoordinator, x: torch.Tensor, mode: int, grad: bool, outcome: Outcome | None, route_id: int,
          seq_splits, head_splits, tag: str | None, *, in_flight: bool = False, own: bool = False,
          eager: bool = False) -> tuple[torch.Tensor | AllToAllHandle, Outcome]:
    """The call: ``(output, saved outcome)``, the latter what a backward of it passes as ``outcome``; in flight
    (``in_flight``) the output is an ``AllToAllHandle``. Collective over ``sp``; blocks the host for the vote where
    there is one; capture-safe on CUDA (the in-flight form must be waited before the capture ends). ``own``: the
    exchange may not read ``x`` once this returns (traced callers: the module docstring). ``eager``: the public
    function's eager path, whose handle owns its exchange and whose output at SP size 1 is ``x`` itself (an op's
    start is owned by its token, and an op's output may not alias its input)."""
    splits = validated(sp, x, mode, grad, seq_splits, head_splits, tag)  # first: nothing below may touch a bad x
    handle = AllToAllHandle() if in_flight else None  # made before the call leaves this module
    fork = contextlib.nullcontext()
    if in_flight and x.is_cuda:  # the communication stream, forked from the caller's (x was written there)
        caller, comm = torch.cuda.current_stream(x.device), comm_stream(x.device)
        if own:  # every CUDA route reads its input on the communication stream, after this returns
            x = x.clone(memory_format=torch.contiguous_format)  # on the caller's stream: the side stream waits for it
        comm.wait_stream(caller)
        fork = torch.cuda.stream(comm)
    with fork:  # on the side stream, NCCL's stream follows it: the host never waits for NCCL
        out, saved = None, (0, 0, 0)
        if eager and sp.world_size == 1:
            out = x
        else:
            backward = outcome is not None
            helper: UlyssesHelper | None = registry.route(outcome[0] if backward else route_id, backward)
            if helper is not None:
                out, (code, word) = helper.call(x, mode, grad, outcome[1:] if backward else None, splits=splits,
                                                tag=tag)
                sp, saved = helper.sp, (helper.id, code, word)
                if out is not None and handle is not None and not x.is_cuda:  # a test transport may land it later
                    handle.marker = helper.transport.completion_marker()
            if out is None:
                # In flight on CPU, gloo's threads send a copy where they would send x's own memory (one layout;
                # the others pack a copy anyway): a write before the wait then reaches no peer.
                threads = in_flight and not x.is_cuda
                out = nccl_route(x, mode, sp.device_group, splits=splits, async_op=threads, own_input=own or threads)
        if handle is None:
            return out, saved
        handle.route = "identity" if out is x else "fused" if saved[1] > 0 else "nccl"
        if callable(out):  # gloo's threads run it
            handle.route, handle.finish = "nccl-async", out
        else:
            handle.out = out
        if isinstance(fork, torch.cuda.StreamContext):
            handle.event = torch.cuda.Event()
            handle.event.record(comm)
            x.record_stream(comm)  # the side stream reads x: its memory is not reused before that is done
    if not own and not x.is_inference():  # the version counter is checked at the wait (module docstring)
        handle.source, handle.version = x, x._version
    handle.where = _caller()
    _PENDING[handle.ident] = handle
    if eager:
        release_when_dropped(handle, handle)
    return handle, saved


def release_when_dropped(owner: object, handle: AllToAllHandle) -> None:
    """Release ``handle`` with a warning if ``owner`` (the handle itself, or the token a wait would take) is
    collected before its ``wait()``; a token keeps its exchange's handle alive until then. Local."""
    handle.release = weakref.finalize(owner, _dropped, handle.ident, handle.where,
                                      None if owner is handle else handle)


def _dropped(ident: int, where: str, _kept: AllToAllHandle | None) -> None:
    _PENDING.pop(ident, None)
    message = (f"Ulysses all-to-all started at {where} (async_op=True, or the backward of one) was never waited "
               "for; it is released now. Call handle.wait() once for every start (a forward or backward that raised "
               "before its wait, a pipelined DistributedAttention's too, leaves it to the release; peers finished it).")
    warnings.warn(message, ResourceWarning, stacklevel=2)
    if where not in _WARNED:
        _WARNED.add(where)
        logger.warning(message)


def _caller() -> str:
    """``file:line`` of the innermost frame outside this package's distributed and attention layers and torch (its
    modules and the code its compilers generate): where the user started the exchange, or called the layer that
    did."""
    # Inductor's generated modules live in its cache folder, which it writes to TORCHINDUCTOR_CACHE_DIR when it
    # first compiles (not the whole temporary folder: the user's own code may live there).
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    skip = _TORCH if not cache else (*_TORCH, os.path.join(cache, ""))
    frame = sys._getframe(2)
    while frame is not None and ((frame.f_globals.get("__name__", "") + ".").startswith(_SKIPPED)
                                 or frame.f_code.co_filename.startswith(skip)):
        frame = frame.f_back
    return f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else "?"
