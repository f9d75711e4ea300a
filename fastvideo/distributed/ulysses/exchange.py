"""One Ulysses all-to-all call, from its input to its output: the core every entry point shares.

    validate -> route -> the helper (propose, vote, decide, execute the fused plan, record) -> the NCCL route
    where every rank declined or no helper votes

``run`` is the call with its wait inlined: on the caller's stream, no side stream and no event (under CUDA-graph
capture too); the synchronous op's body and its eager shortcut. ``start`` is the same call in flight (the start
op's body): on CUDA on this process's communication stream, forked from the caller's, with an event the wait
makes the caller's stream wait on; on CPU the NCCL route left running in gloo's threads. It returns an
``Exchange``, which ``wait`` completes. ``run`` validates its input once (``all_to_all.validate_input`` on the SP
group); in checked mode a caller error is voted first (``fail``), so that every rank raises.

**The input is the caller's until ``wait()``.** An exchange in flight may still read it (the CUDA routes on the
communication stream, gloo's threads on CPU), and ``record_stream`` guards only against the allocator. Eager, the
start keeps the input's version counter and ``wait`` raises where it moved: an in-place write between start and
wait (``x.add_(...)``, an optimizer step on it) is caught. It cannot see writes that bypass the counter (through
``.data``, ``torch.no_grad`` views' raw pointers, other processes) and it flags a write to another slice of the
same storage (the counter is the base's). Under ``torch.inference_mode`` tensors carry no counter: there the rule
is the caller's to keep (a copy per call would cost the compute stream a pass over the operand). Traced code
(``own``: ``torch.compile``, make_fx) passes ownership instead: a compiler plans buffer reuse by graph liveness,
so the start copies its input where the route would read the caller's buffer after returning.

**A dropped start is released.** An exchange whose ``wait`` is never called is released when nothing can wait
for it any more (its handle or token is collected): a ``ResourceWarning`` and one log line name where it was
started. A start without its wait in the same compiled region is refused at trace time (``ops.py``).
"""

from __future__ import annotations

import itertools
import logging
import os
import sys
import tempfile
import time
import warnings
import weakref
from collections.abc import Callable

import torch

from fastvideo.distributed.all_to_all import nccl_route, validate_input
from fastvideo.distributed.sp_groups import GroupCoordinator
from fastvideo.distributed.ulysses import registry

logger = logging.getLogger(__name__)

_IDS = itertools.count(1)
_STREAMS: dict[int, torch.cuda.Stream] = {}  # device index -> this process's communication stream
_PENDING: dict[int, Exchange] = {}  # the exchanges started in this process and not yet waited for
_WARNED: set[str] = set()  # start sites whose dropped exchange was logged
_PACKAGE = __name__.rsplit(".", 2)[0]  # frames of this package are skipped when naming where a start was made
_GENERATED = (os.path.dirname(torch.__file__), "<", tempfile.gettempdir())  # torch's files and generated code


class InputModifiedError(RuntimeError):
    """The input of an exchange in flight was written in place before its ``wait()``."""


class Exchange:
    """One exchange between its start and its wait (process-local, in flight until ``wait``)."""

    __slots__ = ("__weakref__", "event", "finish", "ident", "marker", "out", "route", "source", "version", "where")

    def __init__(self, route: str, out: torch.Tensor | None, finish: Callable[[], torch.Tensor] | None = None,
                 marker: object = None, event: torch.cuda.Event | None = None) -> None:
        self.route, self.out, self.finish, self.marker, self.event = route, out, finish, marker, event
        self.source: torch.Tensor | None = None  # the input whose version is checked at the wait
        self.version = 0
        self.where = ""
        self.ident = next(_IDS)

    def wait(self) -> torch.Tensor:
        """The output, once landed where the caller reads it: on CUDA the caller's current stream waits for the
        exchange's event (the host does not); on CPU the backend's work is waited for. Local; raises
        ``InputModifiedError`` for an input written in place since the start, and for a second wait."""
        if _PENDING.pop(self.ident, None) is None:
            raise RuntimeError(f"Ulysses all-to-all wait: exchange #{self.ident} is not in flight in this process "
                               "(waited already). Wait for each started exchange exactly once.")
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
                "async_op=True and handle.wait(), while the exchange could still read it; the output may mix old "
                "and new data. Write to the input only after wait(), or pass a copy.")
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


def pending(ident: int) -> Exchange:
    """Local: exchange ``ident`` (a token's value) while in flight (KeyError once waited or released)."""
    return _PENDING[ident]


def fail(sp: GroupCoordinator, x: object, mode: int, error: BaseException):
    """Raise ``error``, a caller error found before any collective; in checked mode first vote it on the agreed
    route's helper (``UlyssesHelper.vote_caller_error``). Collective in checked mode; always raises."""
    if torch.compiler.is_compiling() or sp.world_size == 1:
        raise error
    helper = registry.route()
    if helper is None or not helper.checked:
        raise error  # as with any torch collective: the peers of a rank that raised alone wait for it
    helper.vote_caller_error(mode, torch.is_grad_enabled() and isinstance(x, torch.Tensor) and x.requires_grad, error)


Outcome = tuple[int, int, int]  # what a call saves for its backward: (helper id, outcome code, SEQ word)


def run(sp: GroupCoordinator, x: torch.Tensor, mode: int, grad: bool, outcome: Outcome | None, route_id: int,
        seq_splits, head_splits, tag: str | None, in_flight: bool = False,
        own: bool = False) -> tuple[torch.Tensor | Callable[[], torch.Tensor], Outcome]:
    """The call: validate, route, the helper's call (propose, vote, decide, execute, record), the NCCL route where
    every rank declined or no helper votes. Returns ``(output, saved outcome)``, the latter what a backward of it
    passes as ``outcome``. Collective over ``sp``; blocks the host for the vote where there is one; capture-safe
    (on the current stream). ``in_flight`` (``start``): on CPU the NCCL route is left running in gloo's threads and
    the output is its ``finish()``; ``own``: it may not read ``x`` once this returns."""
    try:
        splits = validate_input(x, mode, sp.world_size, sp.rank_in_group, seq_splits, head_splits, tag=tag)
    except (TypeError, ValueError, RuntimeError) as exc:
        fail(sp, x, mode, exc)
    backward = outcome is not None
    helper = registry.route(outcome[0] if backward else route_id, backward)
    out, saved = None, (0, 0, 0)
    if helper is not None:
        out, (code, word) = helper.call(x, mode, grad, outcome[1:] if backward else None, splits=splits, tag=tag)
        sp, saved = helper.sp, (helper.id, code, word)
    if out is None:
        out = nccl_route(x, mode, sp.device_group, splits=splits, async_op=in_flight and not x.is_cuda,
                         own_input=own)
    return out, saved


def start(sp: GroupCoordinator, x: torch.Tensor, mode: int, grad: bool, outcome: Outcome | None, route_id: int,
          seq_splits, head_splits, tag: str | None, own: bool = False) -> tuple[Exchange, Outcome]:
    """The call in flight (``run`` on the communication stream): ``(exchange, saved outcome)``. Collective over
    ``sp``; blocks the host only for the vote; capture-safe on CUDA (every start must be waited before the capture
    ends). ``own``: the exchange may not read ``x`` after this returns (traced callers; the module docstring)."""
    source = x
    if x.is_cuda:
        caller = torch.cuda.current_stream(x.device)
        if own:  # every CUDA route reads its input on the communication stream, after this returns
            x = x.clone(memory_format=torch.contiguous_format)  # on the caller's stream: the side stream waits for it
        comm = comm_stream(x.device)
        comm.wait_stream(caller)  # x was written on the caller's stream
        with torch.cuda.stream(comm):  # on the side stream: NCCL's stream follows it, the host never waits for NCCL
            out, saved = run(sp, x, mode, grad, outcome, route_id, seq_splits, head_splits, tag, True, own)
            event = torch.cuda.Event()
            event.record(comm)
        x.record_stream(comm)  # the side stream reads x: its memory is not reused before that is done
        started = Exchange("fused" if saved[1] > 0 else "nccl", out, event=event)
    else:
        out, saved = run(sp, x, mode, grad, outcome, route_id, seq_splits, head_splits, tag, True, own)
        if callable(out):  # gloo's threads run it; they read x where the send layout is x's own memory
            started = Exchange("nccl-async", None, finish=out)
        else:  # the CPU plan transport has read x when it returns (a test one may land it later)
            started = Exchange("fused", out, marker=registry.route(saved[0]).transport.completion_marker())
    if not own and not source.is_inference():
        started.source, started.version = source, source._version
    started.where = _caller()
    _PENDING[started.ident] = started
    return started, saved


def watch_dropped(owner: object, exchange: Exchange) -> None:
    """Release ``exchange`` with a warning if ``owner`` (its handle, or the token a wait would take) is collected
    while it is still in flight. Local."""
    weakref.finalize(owner, _dropped, exchange.ident, exchange.where)


def _dropped(ident: int, where: str) -> None:
    if _PENDING.pop(ident, None) is None:
        return  # waited
    message = (f"Ulysses all-to-all started at {where} with async_op=True was never waited for; it is released "
               "now. Call handle.wait() once for every start (its peers' exchange completed regardless).")
    warnings.warn(message, ResourceWarning, stacklevel=2)
    if where not in _WARNED:
        _WARNED.add(where)
        logger.warning(message)


def _caller() -> str:
    """``file:line`` of the innermost frame outside this package and torch (its modules and the code its compilers
    generate): where the user started the exchange."""
    frame = sys._getframe(2)
    while frame is not None and (frame.f_globals.get("__name__", "").startswith((_PACKAGE, "torch"))
                                 or frame.f_code.co_filename.startswith(_GENERATED)):
        frame = frame.f_back
    return f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else "?"
