"""The Ulysses all-to-all in flight: a start op and a wait op, so that the exchange runs beside compute.

    torch.ops.fastvideo.ulysses_all_to_all_4d_start(x, mode, grad, outcome, helper, *, seq_splits=None,
                                                    head_splits=None, tag=None, own_input=False)
        -> (token, outcome_out)
    torch.ops.fastvideo.ulysses_all_to_all_4d_wait(token, outcome, mode, shape, dtype, device, *,
                                                   seq_splits=None, head_splits=None, tag=None) -> out

Like torch's functional collectives (an ``all_to_all_single`` then a ``wait_tensor``), the compiler sees two
nodes joined only by ``token``, so it may schedule compute between them. The arguments are the synchronous op's
(``ops.py``); ``token`` is a one-element float64 CPU tensor naming the exchange in flight in this process, and the
output exists only as the wait's result: nothing can read it before the exchange landed.

**Who owns the input.** An exchange in flight may still read its input after the start returned (the CUDA routes
on the communication stream, gloo's threads on CPU). Eager, the caller owns it: ``record_stream`` keeps its memory
from the allocator, and the caller must not write it before the wait (torch's ``async_op`` rule). A compiler cannot
be told that rule: inductor plans buffer reuse by graph liveness, and may even compute a cheap pointwise input once
per consumer, so no argument of the wait can keep the buffer the start read alive. So under tracing
(``own_input=True``, set by the public wrappers when ``torch.compiler.is_compiling()`` or a tracing mode is active,
and baked into the graph) the start op owns its input: where the route would read the caller's buffer after
returning, it first copies the input into a buffer of its own, on the caller's stream, and the compiler may reuse
the caller's buffer as soon as the start returns. The cost: one device copy of the operand on the caller's stream,
compiled path only, and none where the route already packs into a fresh buffer before returning (the gloo route
whose send layout is a copy). The eager path stays copy-free.

* **Start** (collective): the vote, on the host, at issue, exactly as the synchronous op votes (the helper's own
  ``call``, so the phase, call-site tag counts, checked mode and hot path are the same); then the agreed route is
  launched on the communication stream (CUDA: one side stream per device, forked from the caller's current
  stream) or, on CPU over gloo, the NCCL route's ``all_to_all_single(async_op=True)`` is left running in gloo's
  threads. A fused CPU transport executes at issue unless it leaves a completion marker (``Transport.
  completion_marker``), which the wait then waits for.
* **Wait** (local): makes the caller's current stream wait for the exchange's event (CUDA) or waits for the
  backend's work / marker (CPU), then returns the output. A second wait of one token raises.
* **Autograd**: the wait's backward *starts* the reverse exchange of the output gradient (with the forward's
  outcome: the same plan, and it still votes) and hands its token back as the token's gradient; the start's
  backward waits for it. So the gradient exchange is in flight while autograd runs the backward of what the
  forward computed between start and wait. Both backwards go through these same two ops: twice differentiable.
* **Fake impls**: the token and the output's shape; no collective.
* Tagged ``torch.Tag.cudagraph_unsafe`` as the synchronous op is. Under a manual ``torch.cuda.graph`` capture the
  side stream is forked from and joined back into the capturing stream by events (every start must be waited
  before the capture ends).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence

import torch
from torch._subclasses.fake_tensor import is_fake

from fastvideo.distributed.parallel_state import get_sp_group
from fastvideo.distributed.ulysses import registry
from fastvideo.distributed.ulysses.contract import check_tag
from fastvideo.distributed.ulysses.helper import live_helper
from fastvideo.distributed.ulysses.layout import Splits, output_shape, validate_input
from fastvideo.distributed.ulysses.nccl import nccl_route, nccl_route_start
from fastvideo.distributed.ulysses.ops import _TAGS, _listed, _splits, fail, is_plain

START = "fastvideo::ulysses_all_to_all_4d_start"
WAIT = "fastvideo::ulysses_all_to_all_4d_wait"
START_SCHEMA = ("(Tensor x, int mode, bool grad, Tensor? outcome, int helper, *, SymInt[]? seq_splits=None, "
                "SymInt[]? head_splits=None, str? tag=None, bool own_input=False) -> (Tensor, Tensor)")
WAIT_SCHEMA = ("(Tensor token, Tensor outcome, int mode, SymInt[] shape, ScalarType dtype, "
               "Device device, *, SymInt[]? seq_splits=None, SymInt[]? head_splits=None, str? tag=None) -> Tensor")

_IDS = itertools.count(1)
_STREAMS: dict[int, torch.cuda.Stream] = {}  # device index -> this process's communication stream


class InFlight:
    """One exchange between its start and its wait (process-local, kept in ``_PENDING`` by id)."""

    __slots__ = ("event", "finish", "marker", "out", "route")

    def __init__(self, route: str, out: torch.Tensor | None = None,
                 finish: Callable[[], torch.Tensor] | None = None, marker: object = None) -> None:
        self.route, self.out, self.finish, self.marker = route, out, finish, marker
        self.event: torch.cuda.Event | None = None

    def complete(self) -> torch.Tensor:
        """The output, once landed where the caller reads it (see the module docstring). Local."""
        if self.event is not None:  # CUDA: the caller's stream waits; the host does not
            out = self.out
            caller = torch.cuda.current_stream(out.device)
            caller.wait_event(self.event)
            out.record_stream(caller)  # allocated on the side stream, used on the caller's: the allocator is told
            return out
        if self.finish is not None:
            return self.finish()
        if self.marker is not None:
            while not self.marker.query():  # a transport that lands its data after returning (tests delay it)
                time.sleep(50e-6)
        return self.out


_PENDING: dict[int, InFlight] = {}


def comm_stream(device: torch.device) -> torch.cuda.Stream:
    """This process's communication stream on ``device`` (created at first use, then kept)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _STREAMS.get(index)
    if stream is None:
        stream = _STREAMS[index] = torch.cuda.Stream(device=index)
    return stream


def in_flight() -> int:
    """Local: how many exchanges this process started and has not waited for."""
    return len(_PENDING)


def route_of(ident: int) -> str:
    """Local: what exchange ``ident`` (a token's value) runs on: ``fused``, ``nccl`` (the caller's side stream on
    CUDA) or ``nccl-async`` (gloo's ``async_op`` work on CPU). For tests and ``explain``."""
    return _PENDING[ident].route


def _issue(x: torch.Tensor, mode: int, grad: bool, outcome: tuple[int, int] | None, helper: int, splits: Splits,
           tag: str | None, own: bool) -> tuple[InFlight, tuple[int, int]]:
    """Vote (where the route votes) and launch on the current stream, leaving the exchange in flight."""
    if outcome is None:
        target = live_helper(helper) if helper else registry.route()
        code = None
    else:
        helper, code = outcome
        target = live_helper(helper) if helper else None  # id 0: the forward ran without a helper
    saved = (0, 0)
    if target is not None:
        # The synchronous op's own propose/vote/decide; a decline comes back as (None, code) and the NCCL route
        # below runs it, in flight.
        out, code = target.call(x, mode, grad, code, fallback=False, splits=splits, tag=tag)
        saved = (target.id, code)
        if out is not None:
            marker = target.transport.completion_marker() if not x.is_cuda else None
            return InFlight("fused", out, marker=marker), saved
    group = get_sp_group().device_group
    if x.is_cuda:  # on the side stream already: NCCL's stream follows it, and the host never waits for NCCL
        return InFlight("nccl", nccl_route(x, mode, group, splits=splits)), saved
    return InFlight("nccl-async", finish=nccl_route_start(x, mode, group, splits=splits, own_input=own)), saved


def launch(x: torch.Tensor, mode: int, grad: bool, outcome: tuple[int, int] | None, helper: int, splits: Splits,
           tag: str | None, own: bool = False) -> tuple[int, tuple[int, int]]:
    """The start op's body on validated input: ``(token id, (helper id, outcome code))``. Collective; blocks the
    host only for the vote; capture-safe on CUDA. ``own``: the exchange may not read ``x`` after this returns (see
    the module docstring, "Who owns the input")."""
    if x.is_cuda:
        caller = torch.cuda.current_stream(x.device)
        if own:  # every CUDA route reads its input on the communication stream, after this returns
            x = x.clone(memory_format=torch.contiguous_format)  # on the caller's stream: the side stream waits for it
        comm = comm_stream(x.device)
        comm.wait_stream(caller)  # x was written on the caller's stream
        with torch.cuda.stream(comm):
            pending, saved = _issue(x, mode, grad, outcome, helper, splits, tag, own)
            pending.event = torch.cuda.Event()
            pending.event.record(comm)
        x.record_stream(comm)  # the side stream reads x: its memory is not reused before that is done
    else:  # the CPU plan transport has read x when it returns; the gloo route copies where its send is x's view
        pending, saved = _issue(x, mode, grad, outcome, helper, splits, tag, own)
    ident = next(_IDS)
    _PENDING[ident] = pending
    return ident, saved


def complete(ident: int) -> torch.Tensor:
    """The wait op's body: the output of exchange ``ident``. Local; raises for an unknown or already waited id."""
    pending = _PENDING.pop(ident, None)
    if pending is None:
        raise RuntimeError(f"Ulysses all-to-all wait: exchange #{ident} is not in flight in this process (waited "
                           "already, or started elsewhere). Wait for each started exchange exactly once.")
    return pending.complete()


def _token(ident: int) -> torch.Tensor:
    return torch.tensor([float(ident)], dtype=torch.float64)


@torch.library.custom_op(START, mutates_args=(), schema=START_SCHEMA, tags=_TAGS)
def _start(x: torch.Tensor, mode: int, grad: bool, outcome: torch.Tensor | None, helper: int, *,
           seq_splits: list[int] | None = None, head_splits: list[int] | None = None,
           tag: str | None = None, own_input: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    sp = get_sp_group()
    try:
        splits = validate_input(x, mode, sp.world_size, rank=sp.rank_in_group, seq_splits=seq_splits,
                                head_splits=head_splits)
        if tag is not None:
            check_tag(tag, START)
    except (TypeError, ValueError, RuntimeError) as exc:
        fail(x, mode, exc)
    ident, saved = launch(x, mode, grad, None if outcome is None else tuple(outcome.tolist()), helper, splits, tag,
                          own=own_input)
    return _token(ident), torch.tensor(saved, dtype=torch.int64)


@_start.register_fake
def _start_fake(x, mode, grad, outcome, helper, *, seq_splits=None, head_splits=None, tag=None, own_input=False):
    if not is_fake(x):  # the Meta dispatch key outside tracing: raise (as the synchronous op), never a fake token
        sp = get_sp_group()
        try:
            validate_input(x, mode, sp.world_size, rank=sp.rank_in_group, seq_splits=seq_splits,
                           head_splits=head_splits)
        except ValueError as exc:
            fail(x, mode, exc)
    return torch.empty(1, dtype=torch.float64), torch.empty(2, dtype=torch.int64)


@torch.library.custom_op(WAIT, mutates_args=(), schema=WAIT_SCHEMA, tags=_TAGS)
def _wait(token: torch.Tensor, outcome: torch.Tensor, mode: int, shape: list[int],
          dtype: torch.dtype, device: torch.device, *, seq_splits: list[int] | None = None,
          head_splits: list[int] | None = None,
          tag: str | None = None) -> torch.Tensor:
    return complete(int(token.item()))


@_wait.register_fake
def _wait_fake(token, outcome, mode, shape, dtype, device, *, seq_splits=None, head_splits=None, tag=None):
    return torch.empty(shape, dtype=dtype, device=device)


def _start_setup(ctx, inputs: tuple, output: tuple, keyword_only_inputs: dict) -> None:
    x = inputs[0]
    ctx.mode, ctx.shape, ctx.dtype, ctx.device = inputs[1], tuple(x.shape), x.dtype, x.device
    ctx.kw = {k: v for k, v in keyword_only_inputs.items() if k != "own_input"}  # the wait's keywords
    ctx.save_for_backward(output[1])


def _start_backward(ctx, grad_token: torch.Tensor | None, _grad_outcome):
    """The reverse exchange was started by the wait's backward (its token is ``grad_token``): wait for it here."""
    if grad_token is None:
        return None, None, None, None, None
    (outcome,) = ctx.saved_tensors
    grad_x = torch.ops.fastvideo.ulysses_all_to_all_4d_wait(grad_token, outcome, 1 - ctx.mode,
                                                            list(ctx.shape), ctx.dtype, ctx.device, **ctx.kw)
    return grad_x, None, None, None, None


def _wait_setup(ctx, inputs: tuple, output, keyword_only_inputs: dict) -> None:
    ctx.mode = inputs[2]
    ctx.kw = dict(keyword_only_inputs)
    ctx.save_for_backward(inputs[1])


def _wait_backward(ctx, grad_out: torch.Tensor):
    """Start the inverse exchange of ``grad_out`` with the forward's outcome (its plan; it votes as the synchronous
    backward does) and pass its token on: the start's backward waits for it. Traced (the backward graph of
    ``torch.compile``, compiled autograd, ``make_fx``), the start owns ``grad_out`` as the forward's does."""
    (outcome,) = ctx.saved_tensors
    grad_out = grad_out.contiguous()
    grad = torch.is_grad_enabled() and grad_out.requires_grad
    traced = torch.compiler.is_compiling() or not is_plain(grad_out)
    if not grad and not traced:
        splits = _splits(ctx.kw.get("seq_splits"), ctx.kw.get("head_splits"))
        token = _token(launch(grad_out, 1 - ctx.mode, False, tuple(outcome.tolist()), 0, splits,
                              ctx.kw.get("tag"))[0])
    else:
        token = torch.ops.fastvideo.ulysses_all_to_all_4d_start(grad_out, 1 - ctx.mode, grad, outcome, 0,
                                                                **ctx.kw, own_input=traced)[0]
    return token, None, None, None, None, None


_start.register_autograd(_start_backward, setup_context=_start_setup)
_wait.register_autograd(_wait_backward, setup_context=_wait_setup)


class AllToAllHandle:
    """An all-to-all in flight (``sequence_model_parallel_all_to_all_4D(..., async_op=True)``). ``wait()`` returns
    its output, as ``torch.distributed``'s ``Work.wait()`` makes an ``async_op`` result usable; call it once."""

    __slots__ = ("_args", "_ident", "_kw", "_outcome", "_result", "_token")

    def __init__(self, token: torch.Tensor | None, outcome: torch.Tensor | None, args: tuple, kw: dict,
                 ident: int = 0, result: torch.Tensor | None = None) -> None:
        self._token, self._outcome, self._args, self._kw = token, outcome, args, kw
        self._ident, self._result = ident, result

    def wait(self) -> torch.Tensor:
        """The output: local; does not block the host on CUDA (the current stream waits for the exchange); on CPU
        it waits for the backend. Differentiable where the input was. A second call raises."""
        if self._result is not None:  # SP size 1: nothing was exchanged
            return self._result
        if self._ident:  # the eager shortcut: no autograd, no dispatcher
            ident, self._ident = self._ident, -1
            return complete(ident)
        return torch.ops.fastvideo.ulysses_all_to_all_4d_wait(self._token, self._outcome, *self._args, **self._kw)


def start(x: torch.Tensor, mode: int, helper_id: int, splits: Splits, tag: str | None = None) -> AllToAllHandle:
    """``ops.call`` in flight (validated input, SP size > 1): collective; blocks the host only for the vote."""
    seq, heads = _listed(splits.seq), _listed(splits.heads)
    sp = get_sp_group()
    shape = list(output_shape(x.shape, mode, sp.world_size, rank=sp.rank_in_group, splits=splits))
    args, kw = (mode, shape, x.dtype, x.device), {"seq_splits": seq, "head_splits": heads, "tag": tag}
    grad = torch.is_grad_enabled() and x.requires_grad
    traced = torch.compiler.is_compiling() or not is_plain(x)  # a compiler plans x's buffer: the start owns x
    if not traced and not grad:
        return AllToAllHandle(None, None, args, kw, ident=launch(x, mode, False, None, helper_id, splits, tag)[0])
    token, outcome = torch.ops.fastvideo.ulysses_all_to_all_4d_start(x, mode, grad, None, helper_id, seq_splits=seq,
                                                                     head_splits=heads, tag=tag, own_input=traced)
    return AllToAllHandle(token, outcome, args, kw)


def done(x: torch.Tensor) -> AllToAllHandle:
    """A handle whose ``wait()`` returns ``x`` (SP size 1: nothing to exchange)."""
    return AllToAllHandle(None, None, (), {}, result=x)


def all_to_all_async(x: torch.Tensor, mode: int, helper=None, *, seq_splits: Sequence[int] | None = None,
                     head_splits: Sequence[int] | None = None, tag: str | None = None) -> AllToAllHandle:
    """``ops.all_to_all`` in flight (validated input; ``helper`` None: the agreed route)."""
    if tag is not None:
        check_tag(tag, "async_ops.all_to_all_async")
    return start(x, mode, 0 if helper is None else helper.id, _splits(seq_splits, head_splits), tag)
